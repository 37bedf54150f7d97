"""int8 weights times int8 activations (W8A8) on CPU, with one activation scale per token.

Letters: M rows (tokens) in one call, K in_features, N out_features.

torch's x86 kernel `torch.ops.quantized.linear_dynamic` quantizes fp32 activations on the fly
and multiplies in integers against a prepacked int8 weight (one scale per output row: our
`Int8Weight`), but with ONE activation scale for the whole (M, K) tensor. `linear_w8a8` makes it
per token and batch-invariant: divide each row by its own abs-max `a`; append one constant row
[+1, -1, -1, ...] so the range is exactly [-1, 1] in every call (the kernel's scale is then
2 / 255, or 2 / 127 with `reduce_range`, which CPUs without VNNI need: `REDUCE_RANGE`); run the
kernel, drop that row, multiply each output row by its `a`. A row's output is then the same alone
and in a batch, off from the dequantized weight's product by at most `a * 2/127 * sum_k |w[n, k]|`.

Left out on purpose: static (calibrated) activation scales, per-group weight scales, outlier
handling (SmoothQuant lives in the outlier study).
"""
import warnings

import torch


def available() -> bool:
    """The quantized CPU ops exist and an x86 engine (fbgemm / oneDNN) is the active one."""
    ops = getattr(torch.ops, "quantized", None)
    try:
        return ops is not None and hasattr(ops, "linear_dynamic") and \
            torch.backends.quantized.engine in ("x86", "fbgemm", "onednn")
    except RuntimeError:
        return False


def _has_vnni() -> bool:
    """Does this CPU say it has VNNI (Linux's flags; anywhere else: assume not, the safe side)?"""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


REDUCE_RANGE = not _has_vnni()     # 7-bit activations only where 8-bit products could saturate


def prepack(q: torch.Tensor, scale: torch.Tensor):
    """The kernel's packed copy of int8 codes q (N, K) with one fp32 scale per row (N,)."""
    N = q.shape[0]
    with warnings.catch_warnings():      # torch marks the quantized-tensor constructors deprecated
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            q.cpu().contiguous(), scale.detach().cpu().double(), torch.zeros(N, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def packed_nbytes(N: int, K: int) -> int:
    """Bytes the kernel reads per call: its int8 copy of the codes, a scale and an int32 column
    offset per output row."""
    return N * K + 8 * N


_ANCHORS: dict = {}       # K -> the constant row [+1, -1, -1, ...]
TINY = torch.finfo(torch.float32).tiny


def _anchor(K: int) -> torch.Tensor:
    if K not in _ANCHORS:
        row = torch.full((K,), -1.0)
        row[0] = 1.0
        _ANCHORS[K] = row                                                   # (K,)
    return _ANCHORS[K]


def linear_w8a8(x: torch.Tensor, packed) -> torch.Tensor:
    """x (M, K) float -> (M, N) fp32, activations quantized per token (see the module's text).
    Few small ops on purpose: at one row each costs about what the kernel does."""
    x = x.detach().float()                               # no autograd through int8 kernels
    M, K = x.shape
    a = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)     # (M, 1) abs-max
    a.clamp_min_(TINY)                                   # an all-zero row stays all zero
    xs = torch.empty(M + 1, K)
    torch.div(x, a, out=xs[:M])                                             # rows in [-1, 1]
    xs[M].copy_(_anchor(K))                                                 # range exactly [-1, 1]
    y = torch.ops.quantized.linear_dynamic(xs, packed, REDUCE_RANGE)                # (M + 1, N)
    return y[:M].mul_(a)                                                    # (M, N)
