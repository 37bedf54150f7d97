"""Chapter 11: what parallelism costs in communication, from a `ModelConfig` and a link alone.

Letters: L layers, d model width, V vocab, T tokens in a forward step (summed over the batch),
n ranks in a collective (the tensor-parallel size), p pipeline stages, m micro-batches.

Tensor parallelism (Megatron's split): 2L + 1 all-reduces of T*d elements a forward step and one
all-gather of ceil(V/n) logits per row (`tp_collectives`); `ring_wire_bytes` is what a ring sends.
Time is the alpha-beta model: k ring steps of latency alpha plus wire bytes over bandwidth (an
upper bound for small messages, where NCCL switches algorithm). Pipeline parallelism: the bubble
(p-1)/(m+p-1) (`bubble_fraction`) and the activations sent per boundary (`pp_p2p_bytes`). Link
presets (NVLink 3/4, PCIe 4.0, Ethernet) are per direction, from the datasheets in docs/sources.md.

Left out on purpose: the driver's broadcast of the step plan, overlap of communication with
compute, in-network reduction, expert and sequence parallelism, the backward pass.
"""
import math
from dataclasses import dataclass

from minillm._validate import check_int, check_real
from minillm.analysis.kv_math import weight_bytes
from minillm.analysis.roofline import decode_costs, get_hardware, step_time
from minillm.analysis.roofline import dtype_bytes as bytes_per_element
from minillm.model.config import ModelConfig


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")


def tp_collectives(cfg: ModelConfig, tp: int, num_tokens: int, num_logit_rows: int,
                   dtype_bytes: float = 4) -> dict[str, dict]:
    """{kind: {"calls", "bytes"}} one rank hands the collectives in one Megatron TP forward.

    all_reduce: 2L+1 calls of num_tokens*d elements (attention o_proj and MLP down_proj in each
    layer, plus the vocabulary-parallel embedding); all_gather: 1 call of the local logits shard,
    num_logit_rows*ceil(V/tp) elements. tp=1 makes no collective at all (zero calls).
    """
    _check_cfg(cfg)
    check_int("tp", tp, low=1)
    check_int("num_tokens", num_tokens, low=1)
    check_int("num_logit_rows", num_logit_rows, low=0)
    check_real("dtype_bytes", dtype_bytes, low=0, low_open=True)
    if tp == 1:
        return {"all_reduce": {"calls": 0, "bytes": 0}, "all_gather": {"calls": 0, "bytes": 0}}
    ar_calls = 2 * cfg.n_layer + 1
    ar_bytes = num_tokens * cfg.d_model * dtype_bytes                    # (T, d) each call
    ag_bytes = num_logit_rows * math.ceil(cfg.vocab_size / tp) * dtype_bytes  # (rows, V/tp)
    return {"all_reduce": {"calls": ar_calls, "bytes": int(ar_calls * ar_bytes)},
            "all_gather": {"calls": 1, "bytes": int(ag_bytes)}}


_KINDS = ("all_reduce", "all_gather", "send")


def ring_wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends on the wire for a collective it hands `nbytes`, over `n` ranks.

    all_reduce: 2(n-1)/n * nbytes (reduce-scatter then all-gather of n chunks);
    all_gather: (n-1) * nbytes, `nbytes` being this rank's shard, i.e. (n-1)/n of the result;
    send: nbytes (point to point, as between pipeline stages).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
    check_real("nbytes", nbytes, low=0)
    check_int("n", n, low=1)
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all_gather":
        return (n - 1) * nbytes
    return float(nbytes)


@dataclass(frozen=True)
class Link:
    """One interconnect: bandwidth in bytes/s each way per GPU, latency (alpha) per step."""

    name: str
    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self):
        check_real("bandwidth_Bps", self.bandwidth_Bps, low=0, low_open=True)
        check_real("latency_s", self.latency_s, low=0)


_G = 1e9
LINK_PRESETS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 (H100 SXM)", 450 * _G, 2e-6),
    "nvlink3": Link("NVLink 3 (A100 SXM)", 300 * _G, 2e-6),
    "pcie4-x16": Link("PCIe 4.0 x16", 25 * _G, 5e-6),
    "400gbe": Link("400 GbE / IB NDR (RDMA)", 50 * _G, 5e-6),
    "100gbe": Link("100 GbE", 12.5 * _G, 10e-6),
    "25gbe": Link("25 GbE", 3.125 * _G, 20e-6),
    "10gbe": Link("10 GbE (TCP)", 1.25 * _G, 30e-6),
}


def get_link(name) -> Link:
    """A preset by name (case-insensitive), or a `Link` passed through."""
    if isinstance(name, Link):
        return name
    if not isinstance(name, str) or name.lower() not in LINK_PRESETS:
        raise ValueError(f"link must be a Link or one of {sorted(LINK_PRESETS)}, got {name!r}")
    return LINK_PRESETS[name.lower()]


def allreduce_time(nbytes: float, n: int, link) -> float:
    """Ring all-reduce of `nbytes` per rank over n ranks: 2(n-1) steps of alpha + wire / beta."""
    link = get_link(link)
    wire = ring_wire_bytes("all_reduce", nbytes, n)
    return 2 * (n - 1) * link.latency_s + wire / link.bandwidth_Bps


def allgather_time(nbytes: float, n: int, link) -> float:
    """Ring all-gather of an `nbytes` shard per rank over n ranks: (n-1) steps."""
    link = get_link(link)
    wire = ring_wire_bytes("all_gather", nbytes, n)
    return (n - 1) * link.latency_s + wire / link.bandwidth_Bps


def tp_comm_time(cfg: ModelConfig, tp: int, num_tokens: int, link, dtype_bytes: float = 2,
                 num_logit_rows: int | None = None) -> float:
    """Seconds one TP forward spends in its collectives (no overlap): 2L+1 all-reduces of
    (T, d) and one all-gather of the logits shard. `num_logit_rows` defaults to num_tokens."""
    rows = num_tokens if num_logit_rows is None else num_logit_rows
    counts = tp_collectives(cfg, tp, num_tokens, rows, dtype_bytes)
    ar, ag = counts["all_reduce"], counts["all_gather"]
    t = 0.0
    if ar["calls"]:
        t += ar["calls"] * allreduce_time(ar["bytes"] / ar["calls"], tp, link)
    if ag["calls"]:
        t += allgather_time(ag["bytes"], tp, link)
    return t


@dataclass(frozen=True)
class TPSplit:
    """One decode step under TP: roofline compute time on 1/tp of the work, plus collectives."""

    model: str
    chip: str
    link: str
    tp: int
    batch: int
    compute_s: float
    comm_s: float
    fits: bool            # do 1/tp of the weights fit in one chip's memory?

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.total_s


def tp_decode_split(cfg: ModelConfig, tp: int, batch: int, link, chip: str = "h100-sxm",
                    dtype="bf16", context_len: int = 0) -> TPSplit:
    """Decode step time with TP: chapter 1's roofline step time (memory-bound at small batch:
    the weight read) divided by tp, plus `tp_comm_time` for one token per sequence."""
    _check_cfg(cfg)
    check_int("tp", tp, low=1)
    check_int("batch", batch, low=1)
    link = get_link(link)
    hw = get_hardware(chip)
    compute = step_time(decode_costs(cfg, batch, context_len, dtype), hw, dtype) / tp
    comm = tp_comm_time(cfg, tp, batch, link, bytes_per_element(dtype), num_logit_rows=batch)
    fits = weight_bytes(cfg, dtype) / tp <= hw.mem_bytes
    return TPSplit(cfg.name, hw.name, link.name, tp, batch, compute, comm, fits)


def bubble_fraction(p: int, m: int) -> float:
    """GPipe's idle fraction of a p-stage pipeline fed m equal micro-batches: (p-1)/(m+p-1)."""
    check_int("pipeline_parallel_size", p, low=1)
    check_int("num_microbatches", m, low=1)
    return (p - 1) / (m + p - 1)


def pp_p2p_bytes(cfg: ModelConfig, num_tokens: int, pipeline_parallel_size: int,
                 num_logit_rows: int = 0, dtype_bytes: float = 4) -> dict[str, int]:
    """Point-to-point bytes of one pipelined forward: the (T, d) activations cross each of the
    p-1 stage boundaries once; with `num_logit_rows`, the last stage sends (rows, V) logits back
    to the driver (p > 1)."""
    _check_cfg(cfg)
    check_int("num_tokens", num_tokens, low=1)
    p = check_int("pipeline_parallel_size", pipeline_parallel_size, low=1)
    check_int("num_logit_rows", num_logit_rows, low=0)
    check_real("dtype_bytes", dtype_bytes, low=0, low_open=True)
    acts = (p - 1) * num_tokens * cfg.d_model * dtype_bytes
    logits = num_logit_rows * cfg.vocab_size * dtype_bytes if p > 1 else 0
    return {"activations": int(acts), "logits": int(logits)}
