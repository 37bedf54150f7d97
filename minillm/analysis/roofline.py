"""Chapter 1: the roofline model of one transformer step, from a `ModelConfig` alone.

A step runs ops; each op does some FLOPs and moves some bytes between memory and the chip.
Its arithmetic intensity I = FLOPs / bytes. A chip with peak compute F (FLOP/s) and memory
bandwidth W (bytes/s) can at best attain min(F, I * W) FLOP/s, so the op takes at least
max(FLOPs / F, bytes / W) seconds. The ridge point F / W is the intensity where the two meet:
below it an op is memory-bound, above it compute-bound.

Letters: B batch (sequences), T new tokens per sequence in this step, S context already in the
KV cache, H query heads, Hkv KV heads, D head dim, d model width, d_ff MLP width, V vocab.
Prefill is T = prompt length, S = 0; decode is T = 1, S = tokens so far.

Counted: the matmuls (QKV, O, MLP gate/up/down, lm_head) and attention's two batched matmuls
(Q K^T and P V, the full S + T keys, as a dense kernel computes them; a causal flash kernel skips
about half in prefill). Bytes: every weight read once per step, matmul inputs read and outputs
written once, the whole KV cache read once; the score matrix is assumed fused (never written).
Left out on purpose: RMSNorm, RoPE, SiLU, softmax, residual adds and the embedding gather. They
are under 1% of the FLOPs, and a few activation-sized reads that matter only at tiny models.
"""
from dataclasses import dataclass, field

import torch

from minillm._validate import check_int
from minillm.model.config import ModelConfig

# Bytes per element of each dtype a chapter talks about (int4: two weights per byte).
DTYPE_BYTES: dict[str, float] = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2,
                                 "fp8": 1, "int8": 1, "int4": 0.5}
# The one map between these names and torch dtypes (the names with a torch tensor type).
TORCH_DTYPES: dict[str, torch.dtype] = {"fp64": torch.float64, "fp32": torch.float32,
                                        "bf16": torch.bfloat16, "fp16": torch.float16,
                                        "int8": torch.int8}
_TORCH_NAMES = {t: name for name, t in TORCH_DTYPES.items()}


def dtype_name(dtype) -> str:
    """Normalize a dtype (`torch.bfloat16`, "bf16", "bfloat16") to one of DTYPE_BYTES' keys."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise ValueError(f"dtype {dtype} not supported; use one of {list(_TORCH_NAMES)}")
        return _TORCH_NAMES[dtype]
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    key = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "half": "fp16", "float64": "fp64", "double": "fp64"}.get(dtype.lower(), dtype.lower())
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return key


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype for a name ("bf16", "bfloat16", "float32", ...) or a torch dtype."""
    name = dtype_name(dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r} has no torch tensor type here; use one of {list(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def dtype_bytes(dtype) -> float:
    """Bytes per element, e.g. `dtype_bytes("bf16") == 2`, `dtype_bytes(torch.float32) == 4`."""
    return DTYPE_BYTES[dtype_name(dtype)]


@dataclass(frozen=True)
class Hardware:
    """The two ceilings of a roofline plus memory size.

    peak_flops: dense peak FLOP/s per compute dtype (no 2:4 sparsity); mem_bandwidth: bytes/s;
    mem_bytes: device memory in bytes. NVIDIA's "80 GB" (A100, H100) and "141 GB" (H200) are
    GiB: an 80 GB H100 has 80 * 2**30 bytes, of which torch reports about 79 GiB usable.
    """

    name: str
    peak_flops: dict = field(hash=False)
    mem_bandwidth: float
    mem_bytes: float

    def __post_init__(self):
        if self.mem_bandwidth <= 0 or self.mem_bytes <= 0:
            raise ValueError(f"Hardware {self.name!r}: mem_bandwidth and mem_bytes must be > 0")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"Hardware {self.name!r}: peak_flops must map dtypes to values > 0")

    def peak(self, dtype) -> float:
        """Peak FLOP/s for a compute dtype (ValueError naming the known dtypes if missing)."""
        key = dtype_name(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"{self.name} has no peak for dtype {key!r}; "
                             f"known: {sorted(self.peak_flops)}")
        return self.peak_flops[key]

    def ridge(self, dtype) -> float:
        """Ridge point in FLOP/byte: peak / bandwidth."""
        return self.peak(dtype) / self.mem_bandwidth

    def attainable(self, intensity: float, dtype) -> float:
        """Roofline: min(peak, intensity * bandwidth) FLOP/s."""
        if intensity < 0:
            raise ValueError(f"intensity must be >= 0, got {intensity}")
        return min(self.peak(dtype), intensity * self.mem_bandwidth)


_T = 1e12  # tera
GiB = 2**30
# NVIDIA datasheets, dense numbers (the headline figures with sparsity are twice these).
# "fp32" is the non-tensor-core rate, what torch uses for fp32 matmul unless TF32 is enabled.
HARDWARE_PRESETS: dict[str, Hardware] = {
    "a100-80gb-sxm": Hardware("A100-80GB SXM", {
        "fp64": 9.7 * _T, "fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T,
        "fp16": 312 * _T, "int8": 624 * _T}, mem_bandwidth=2.039e12, mem_bytes=80 * GiB),
    "h100-sxm": Hardware("H100 SXM", {
        "fp64": 34 * _T, "fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T,
        "fp16": 989.4 * _T, "fp8": 1978.9 * _T, "int8": 1978.9 * _T},
        mem_bandwidth=3.35e12, mem_bytes=80 * GiB),
    # H200: the H100's compute with more, faster HBM3e memory.
    "h200": Hardware("H200 SXM", {
        "fp64": 34 * _T, "fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T,
        "fp16": 989.4 * _T, "fp8": 1978.9 * _T, "int8": 1978.9 * _T},
        mem_bandwidth=4.8e12, mem_bytes=141 * GiB),
}


def get_hardware(name: str) -> Hardware:
    """Look up a datasheet preset by name, e.g. `get_hardware("a100-80gb-sxm")`."""
    if not isinstance(name, str) or name.lower() not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[name.lower()]


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes moved by one op, summed over all layers."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def _check_pos_int(name: str, value, allow_zero: bool = False) -> None:
    check_int(name, value, 0 if allow_zero else 1)


def _matmul(name: str, n_tok: int, k: int, n: int, layers: int, w: float, a: float) -> OpCost:
    """(n_tok, k) @ (k, n): 2*n_tok*k*n FLOPs; weights k*n, input n_tok*k, output n_tok*n."""
    flops = 2.0 * n_tok * k * n
    nbytes = k * n * w + (n_tok * k + n_tok * n) * a
    return OpCost(name, layers * flops, layers * nbytes)


def step_costs(cfg: ModelConfig, batch_size: int, new_tokens: int, context_len: int,
               dtype="bf16", kv_dtype=None, logits_tokens: int | None = None) -> list[OpCost]:
    """Per-op cost of one forward step: B sequences, each with T new tokens after S cached ones.

    dtype is the weight/activation dtype, kv_dtype the cache's (default: dtype).
    logits_tokens: tokens per sequence that go through lm_head (default 1: a server only needs
    the last position's logits; pass T to match a forward that computes logits everywhere).
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    _check_pos_int("batch_size", batch_size)
    _check_pos_int("new_tokens", new_tokens)
    _check_pos_int("context_len", context_len, allow_zero=True)
    logits_tokens = 1 if logits_tokens is None else logits_tokens
    _check_pos_int("logits_tokens", logits_tokens)
    if logits_tokens > new_tokens:
        raise ValueError(f"logits_tokens ({logits_tokens}) must be <= new_tokens ({new_tokens})")
    w = a = dtype_bytes(dtype)
    kv = dtype_bytes(kv_dtype if kv_dtype is not None else dtype)
    B, Tn, S, L = batch_size, new_tokens, context_len, cfg.n_layer
    H, Hkv, D, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model
    N, keys = B * Tn, S + Tn  # tokens in the step; keys each query attends to
    # Q K^T: (B, H, T, D) @ (B, H, D, S+T) -> (B, H, T, S+T); reads Q and the Hkv-head K cache.
    scores = OpCost("attn_scores", L * 2.0 * B * H * Tn * keys * D,
                    L * (N * H * D * a + B * keys * Hkv * D * kv))
    # P V: (B, H, T, S+T) @ (B, H, S+T, D) -> (B, H, T, D); reads the V cache, writes the output.
    values = OpCost("attn_values", L * 2.0 * B * H * Tn * keys * D,
                    L * (B * keys * Hkv * D * kv + N * H * D * a))
    return [
        _matmul("qkv_proj", N, d, (H + 2 * Hkv) * D, L, w, a),  # (N, d) @ (d, (H+2Hkv)*D)
        scores, values,
        _matmul("o_proj", N, H * D, d, L, w, a),                # (N, H*D) @ (H*D, d)
        _matmul("mlp_gate_up", N, d, 2 * cfg.d_ff, L, w, a),    # (N, d) @ (d, 2*d_ff)
        _matmul("mlp_down", N, cfg.d_ff, d, L, w, a),           # (N, d_ff) @ (d_ff, d)
        _matmul("lm_head", B * logits_tokens, d, cfg.vocab_size, 1, w, a),  # (B*Tl, d) @ (d, V)
    ]


def prefill_costs(cfg: ModelConfig, num_tokens: int, batch_size: int = 1, dtype="bf16",
                  kv_dtype=None, logits_tokens: int | None = None) -> list[OpCost]:
    """Cost of prefilling B prompts of T tokens each (empty cache)."""
    return step_costs(cfg, batch_size, num_tokens, 0, dtype, kv_dtype, logits_tokens)


def decode_costs(cfg: ModelConfig, batch_size: int, context_len: int, dtype="bf16",
                 kv_dtype=None) -> list[OpCost]:
    """Cost of one decode step: B sequences, one new token each, S tokens already cached."""
    return step_costs(cfg, batch_size, 1, context_len, dtype, kv_dtype)


def total_cost(costs: list[OpCost]) -> OpCost:
    """Sum of a step's ops (its intensity is total FLOPs / total bytes)."""
    if not costs:
        raise ValueError("costs must be a non-empty list of OpCost")
    return OpCost("total", sum(c.flops for c in costs), sum(c.bytes for c in costs))


def op_time(cost: OpCost, hw: Hardware, dtype) -> float:
    """Lower-bound seconds of one op: max(FLOPs / peak, bytes / bandwidth)."""
    return max(cost.flops / hw.peak(dtype), cost.bytes / hw.mem_bandwidth)


def step_time(costs: list[OpCost], hw: Hardware, dtype) -> float:
    """Lower-bound seconds of a step: ops run one after another, each at its own roofline."""
    return sum(op_time(c, hw, dtype) for c in costs)


def _first_reaching(intensity, ridge: float, upper: int) -> int | None:
    """Smallest n in [1, upper] with intensity(n) >= ridge (intensity grows with n), by
    bisection; None if even `upper` stays below the ridge."""
    if intensity(upper) < ridge:
        return None
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if intensity(mid) >= ridge else (mid + 1, hi)
    return lo


def decode_compute_bound_batch(cfg: ModelConfig, hw: Hardware, context_len: int = 0,
                               dtype="bf16", kv_dtype=None, max_batch: int = 1 << 20) -> int | None:
    """Smallest batch at which a decode step's total intensity reaches the ridge point.

    Intensity grows with B (the weight bytes are shared, FLOPs are not), so a bisection works.
    Returns None if even `max_batch` stays below the ridge: with a long context the KV reads
    grow with B as fast as the FLOPs do, and attention alone never turns compute-bound.
    """
    ridge = hw.ridge(dtype)

    def intensity(b: int) -> float:
        return total_cost(decode_costs(cfg, b, context_len, dtype, kv_dtype)).intensity

    return _first_reaching(intensity, ridge, max_batch)


def chunk_compute_bound_tokens(cfg: ModelConfig, hw: Hardware, dtype="bf16", context_len: int = 0,
                               kv_dtype=None, max_tokens: int = 1 << 20) -> int | None:
    """Smallest prefill chunk (T new tokens of one prompt, after `context_len` cached ones) whose
    step reaches the ridge point: below it the step costs about one weight read, however many
    tokens it carries ("rides free" on the read a decode step pays anyway); above it every
    extra token adds its FLOPs to the step time (chapter 5's chunk size).

    Only the chunk's last position goes through lm_head, as in a server. Intensity grows with T
    (the weights are read once, the FLOPs grow with T), so a bisection works. Returns None if
    even `max_tokens` stays below the ridge.
    """
    _check_pos_int("context_len", context_len, allow_zero=True)
    _check_pos_int("max_tokens", max_tokens)
    ridge = hw.ridge(dtype)

    def intensity(t: int) -> float:
        return total_cost(step_costs(cfg, 1, t, context_len, dtype, kv_dtype)).intensity

    return _first_reaching(intensity, ridge, max_tokens)
