"""int8 weights times int8 activations (W8A8) on CPU, with one activation scale per token.

Letters: M rows (tokens) in one call, K in_features, N out_features.

torch ships a tuned x86 kernel for this, `torch.ops.quantized.linear_dynamic` (fbgemm, or
oneDNN): it takes fp32 activations, quantizes them to 8 bits on the fly, multiplies in integers
against a prepacked int8 weight (`linear_prepack`, one scale per output row: our `Int8Weight`
as it is) and scales back to fp32. At a handful of rows it reads the int8 weight about as fast as
the machine streams bytes, where the weight-only `_weight_int8pack_mm` spends more time
dequantizing than reading.

Its one catch: it quantizes the activation with ONE scale for the whole (M, K) tensor, so a
token's result would depend on which other tokens share its batch. `linear_w8a8` makes the
scale per token and the result batch-invariant:

1. divide each row by its own abs-max `a` (every row now lies in [-1, 1]);
2. append one constant row [+1, -1, -1, ...]: the tensor's range is now exactly [-1, 1] whatever
   the batch holds, so the kernel's per-tensor scale is the same in every call: 2 / 255, or
   2 / 127 with `reduce_range`, which keeps the products inside int16 on CPUs without VNNI
   (their 8-bit multiply-add saturates at 16 bits; VNNI's adds in 32 bits, so it needs no
   halving: `REDUCE_RANGE` says which this CPU gets);
3. run the kernel, drop the constant row, multiply each output row by its `a`.

Each row is quantized by the same rule whatever its companions; the integer product is exact, so
a row's output is the same alone and inside a batch. The activation's rounding is at most one
step of 2 / 127 times `a` per element (half that with VNNI) (a clamp at the top of the range included): a result is
off from the dequantized weight's product by at most `a * 2/127 * sum_k |w[n, k]|`.

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
