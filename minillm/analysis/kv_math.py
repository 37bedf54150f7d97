"""Chapter 2: how much memory the KV cache takes, how many sequences fit, and what reserving wastes.

Every token a sequence holds keeps one K and one V vector per layer and KV head:
    KV bytes per token = 2 * n_layer * Hkv * D * bytes_per_element
Grouped-query attention (GQA) shrinks it by n_head / Hkv against multi-head attention (MHA);
multi-query attention (MQA) keeps a single KV head. A quantized cache (chapter 7) stores one
byte per element ("int8", "fp8") and may add a scale per token per KV head:
    KV bytes per token = 2 * n_layer * Hkv * (D * bytes_per_element + scale_bytes)

Letters: B batch (sequences), S tokens a sequence holds, H query heads, Hkv KV heads, D head
dim, L layers, N blocks, P block size (tokens per block).

The capacity planner follows vLLM's arithmetic: of `gpu_memory_utilization * memory`, the
weights and an activation reserve come off, and the rest is cut into blocks of P tokens.
vLLM measures the reserve with a profiling forward of `max_num_batched_tokens` tokens (minillm's
engine does the same on CUDA: `paging.sizing.measure_activation_bytes`); `activation_reserve_bytes`
estimates it from the shapes alone, so the planner can be run for a card you do not have.
Left out on purpose: the CUDA context, allocator fragmentation and CUDA-graph memory, and tensor
parallelism.
"""
import math
from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig
from minillm._validate import check_int, check_real
from minillm.analysis.roofline import Hardware, dtype_bytes


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")


def kv_bytes_per_token(cfg: ModelConfig, dtype="bf16", scale_bytes: float = 0) -> float:
    """2 (K and V) * n_layer * Hkv * (D * bytes + scale_bytes).

    `scale_bytes`: what a quantized cache stores beside each token's D codes per kv head, e.g.
    `kv_bytes_per_token(cfg, "int8", scale_bytes=2)` for int8 codes with one fp16 scale per
    token per head (minillm's int8 KV; its fp8 KV has no scale: "fp8", scale_bytes=0)."""
    _check_cfg(cfg)
    check_real("scale_bytes", scale_bytes, 0)
    return 2 * cfg.n_layer * cfg.n_kv_head * (cfg.head_dim * dtype_bytes(dtype) + scale_bytes)


def kv_cache_bytes(cfg: ModelConfig, num_tokens: int, batch_size: int = 1, dtype="bf16") -> float:
    """KV bytes of B sequences holding S tokens each."""
    check_int("num_tokens", num_tokens, 0)
    check_int("batch_size", batch_size, 1)
    return kv_bytes_per_token(cfg, dtype) * num_tokens * batch_size


def weight_bytes(cfg: ModelConfig, dtype="bf16") -> float:
    """Parameter bytes (int4 = half a byte per weight; scales and zero points left out)."""
    _check_cfg(cfg)
    return cfg.num_params * dtype_bytes(dtype)


def kv_crossover_tokens(cfg: ModelConfig, batch_size: int = 1, kv_dtype="bf16",
                        weight_dtype="bf16") -> float:
    """Context per sequence at which a batch's KV cache weighs as much as the weights: beyond it
    a decode step reads more KV than weights (chapters 2 and 9)."""
    check_int("batch_size", batch_size, 1)
    return weight_bytes(cfg, weight_dtype) / (batch_size * kv_bytes_per_token(cfg, kv_dtype))


def attention_variants(cfg: ModelConfig) -> dict[str, ModelConfig]:
    """The same model shape with MHA (Hkv = H), its own GQA setting, and MQA (Hkv = 1)."""
    _check_cfg(cfg)
    return {"MHA": cfg.with_(n_kv_head=cfg.n_head), "GQA": cfg, "MQA": cfg.with_(n_kv_head=1)}


@dataclass(frozen=True)
class CapacityPlan:
    """What fits: the numbers behind vLLM's gpu_memory_utilization, block_size, max_num_seqs."""

    memory_bytes: float       # device memory
    budget_bytes: float       # gpu_memory_utilization * memory
    weight_bytes: float
    activation_bytes: float   # reserve for activations / workspace
    kv_budget_bytes: float    # budget - weights - activations
    block_size: int           # P tokens per block
    bytes_per_block: float    # P * KV bytes per token
    num_blocks: int           # N = floor(kv_budget / bytes_per_block)
    num_tokens: int           # N * P tokens of KV in the pool
    max_model_len: int        # longest sequence planned for
    blocks_per_seq: int       # ceil(max_model_len / P)
    max_num_seqs: int         # sequences of max_model_len that fit at once


def plan_capacity(cfg: ModelConfig, memory, gpu_memory_utilization: float = 0.9,
                  block_size: int = 16, max_model_len: int | None = None, dtype="bf16",
                  kv_dtype=None, activation_bytes: float = 0.0) -> CapacityPlan:
    """How many KV blocks, tokens and full-length sequences fit in `memory` (bytes or Hardware).

    Example: Llama-3-8B in bf16 with memory=80e9 at 0.9 keeps 72e9 - 16.06e9 bytes for KV,
    at 131072 bytes per token: 26,674 blocks of 16 = 426,784 tokens = 52 sequences of 8192
    (an H100's real 80 GiB, with a 0.97 GB activation reserve: 28,743 blocks, 56 sequences).
    """
    _check_cfg(cfg)
    memory_bytes = memory.mem_bytes if isinstance(memory, Hardware) else memory
    check_real("memory (a Hardware or a byte count)", memory_bytes, 0, low_open=True)
    check_real("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    check_int("block_size", block_size, 1)
    max_model_len = cfg.max_seq_len if max_model_len is None else max_model_len
    check_int("max_model_len", max_model_len, 1)
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    budget = gpu_memory_utilization * memory_bytes
    weights = weight_bytes(cfg, dtype)
    kv_budget = budget - weights - activation_bytes
    if kv_budget <= 0:
        raise ValueError(f"{cfg.name}: weights ({weights / 2**30:.2f} GiB) and activations leave "
                         f"no KV memory in a budget of {budget / 2**30:.2f} GiB")
    per_block = block_size * kv_bytes_per_token(cfg, kv_dtype if kv_dtype is not None else dtype)
    num_blocks = int(kv_budget // per_block)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    return CapacityPlan(memory_bytes, budget, weights, activation_bytes, kv_budget, block_size,
                        per_block, num_blocks, num_blocks * block_size, max_model_len,
                        blocks_per_seq, num_blocks // blocks_per_seq)


def activation_reserve_bytes(cfg: ModelConfig, num_tokens: int, dtype="bf16",
                             logits_rows: int | None = None) -> float:
    """Estimated peak bytes of the transient tensors of one forward over `num_tokens` tokens.

    At any moment one layer's tensors are alive: the residual stream and its normed copy
    (2 * T * d), plus the wider of the attention half (qkv T * (H + 2 Hkv) * D and the attention
    output T * H * D) and the MLP half (gate/up T * 2 d_ff and the activated T * d_ff), in
    `dtype`; then fp32 logits for `logits_rows` rows (default: every token) of V entries.
    Example: Llama-3-8B, 8192 tokens in bf16, logits for 256 rows: 8192 * (2 * 4096 + 3 * 14336)
    * 2 + 256 * 128256 * 4 = 970,194,944 bytes (about 0.9 GiB).
    """
    _check_cfg(cfg)
    check_int("num_tokens", num_tokens, 1)
    rows = num_tokens if logits_rows is None else logits_rows
    check_int("logits_rows", rows, 1)
    T, d, D = num_tokens, cfg.d_model, cfg.head_dim
    attn = (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D     # qkv + attention output
    mlp = 3 * cfg.d_ff                                               # gate/up + activated
    return T * (2 * d + max(attn, mlp)) * dtype_bytes(dtype) + rows * cfg.vocab_size * 4


def seed_max_batch_tokens(cfg: ModelConfig, memory_bytes: float, dtype="bf16",
                          kv_dtype=None) -> float:
    """Seed 001's rule as written: memory / (parameters * 2 + KV estimate), with the KV estimate
    read as one token's KV bytes. Kept to be checked against `plan_capacity`, not to be used."""
    _check_cfg(cfg)
    check_real("memory_bytes", memory_bytes, 0, low_open=True)
    return memory_bytes / (cfg.num_params * 2 + kv_bytes_per_token(cfg, kv_dtype or dtype))


def lognormal_lengths(n: int, median: float, sigma: float, high: int | None = None,
                      generator: torch.Generator | None = None, seed: int = 0) -> list[int]:
    """n seeded log-normal lengths (ints >= 1, at most `high`): exp(log(median) + sigma * z),
    z standard normal, rounded up. The one heavy-tailed length law of chapters 2 and 3 (chapter 4's
    arrival workloads use a bounded Pareto, `lab.workloads.heavy_tailed_lengths`). Pass a
    `generator` to draw several streams from one seed, else `seed` makes one."""
    check_int("n", n, 1)
    if high is not None:
        check_int("high (None or)", high, 1)
    if not (median > 0 and sigma > 0):
        raise ValueError(f"median and sigma must be > 0, got {median}, {sigma}")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(median) + sigma * z).ceil().clamp(1, high)
    return [int(x) for x in lengths.tolist()]


def sample_output_lengths(n: int, max_len: int = 2048, median: float = 128.0,
                          sigma: float = 1.2, seed: int = 0) -> list[int]:
    """n seeded log-normal output lengths in [1, max_len]: most short, a few very long."""
    check_int("max_len", max_len, 1)
    return lognormal_lengths(n, median, sigma, high=max_len, seed=seed)


@dataclass(frozen=True)
class Reservation:
    """KV tokens held by a scheme vs tokens actually used; waste = 1 - used / reserved."""

    scheme: str
    used_tokens: int
    reserved_tokens: int

    @property
    def waste(self) -> float:
        return 1.0 - self.used_tokens / self.reserved_tokens


def reservation_waste(lengths: list[int], max_len: int,
                      block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[Reservation]:
    """Static reservation (every request holds max_len slots) vs blocks of P (ceil(len/P)*P)."""
    check_int("max_len", max_len, 1)
    if not lengths:
        raise ValueError("lengths must be a non-empty list of ints")
    for x in lengths:
        check_int("each length", x, 1)
        if x > max_len:
            raise ValueError(f"length {x} exceeds max_len {max_len}")
    used = sum(lengths)
    out = [Reservation("static", used, max_len * len(lengths))]
    for p in block_sizes:
        check_int("block_size", p, 1)
        out.append(Reservation(f"block {p}", used, sum(math.ceil(x / p) * p for x in lengths)))
    return out
