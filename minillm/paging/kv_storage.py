"""KV storage formats of the paged cache: K and V kept in one byte per element, dequantized
when attention gathers them.

Letters: L layers, N blocks, P block size, Hkv kv heads, D head dim, M tokens written.

One token's K (or V) vector of one kv head, x (D,), is stored as:
- **int8**: `q = round(x / s)`, `s = max_d |x_d| / 127`, one fp16 scale per token per kv head:
  D + 2 bytes;
- **fp8** (`torch.float8_e4m3fn`, largest value 448): the value cast (clamped), no scale: D bytes,
  kept as raw uint8 bytes; `quantize_kv(..., scaled=True)` keeps the scaled variant to compare.
Against 2 D bytes (bf16/fp16) or 4 D (fp32). Codes are written once and dequantized on every read,
so attention runs in the model's dtype: memory and bandwidth are saved, not FLOPs.

`KVSlots` is one layer's quantized pool as slot rows (N*P, Hkv*D) with the two methods paged
attention calls (`index_copy_` quantizes, `index_select` dequantizes); `kv_pools` builds every
layer's pools for `PagedKVCache`.

Left out on purpose: per-tensor (static, calibrated) scales as vLLM's fp8 KV uses, fp8 e5m2,
int4 KV, and attention kernels that read the codes directly (we dequantize a padded copy).
"""
import torch

from minillm._validate import ArgumentTypeError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.float16                      # int8's scales (and fp8's, if scaled)
INT8_MAX, FP8_MAX = 127.0, 448.0


def check_kv_cache_dtype(kv_cache_dtype, device=None) -> str:
    """`kv_cache_dtype` if it is one of KV_CACHE_DTYPES (and, for "fp8" with a device given, the
    device can cast to and from float8_e4m3fn: probed, not assumed), else ValueError."""
    if not isinstance(kv_cache_dtype, str):
        raise ArgumentTypeError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                                f"{type(kv_cache_dtype).__name__} {kv_cache_dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and device is not None:
        _probe_fp8(torch.device(device))
    return kv_cache_dtype


def _probe_fp8(device: torch.device) -> None:
    """Cast a few values to fp8 and back on `device`, through the byte view the cache stores."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    try:
        if fp8 is None:
            raise RuntimeError("this torch has no torch.float8_e4m3fn")
        x = torch.tensor([1.5, -0.3125, 448.0, 2.0 ** -6], device=device)
        y = x.to(fp8).view(torch.uint8).view(fp8).to(torch.float32)
        if not torch.equal(x, y):            # all four are exact in e4m3
            raise RuntimeError(f"round trip gave {y.tolist()}")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"kv_cache_dtype='fp8' needs float8_e4m3fn casts on {device}, which "
                         f"this platform lacks ({e}); use kv_cache_dtype='int8' or 'auto'") from None


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str, scaled: bool | None = None):
    """x (..., D) -> (codes (..., D), scales (...,) fp16, or None for unscaled fp8).

    int8 codes are int8 (always scaled); fp8 codes are the uint8 bytes of float8_e4m3fn values,
    unscaled unless `scaled=True` (None: the format's default, see the module docstring)."""
    kind = check_kv_cache_dtype(kv_cache_dtype)
    if kind == "auto":
        raise ValueError("quantize_kv needs kv_cache_dtype 'int8' or 'fp8' ('auto' stores x as is)")
    if scaled is None:
        scaled = kind == "int8"
    if kind == "int8" and not scaled:
        raise ValueError("int8 KV needs its scales (scaled=True or None)")
    xf = x.to(torch.promote_types(x.dtype, torch.float32))     # bf16/fp16 -> fp32 math
    top = INT8_MAX if kind == "int8" else FP8_MAX
    scale = None
    if scaled:
        fmt = torch.finfo(SCALE_DTYPE)
        # the scale is rounded to fp16 first and the codes use that rounded scale, so codes *
        # stored scale is the best the codes can do; an all-zero vector gets the smallest normal
        # scale (codes 0), never a division by zero
        scale = (xf.abs().amax(dim=-1) / top).clamp(fmt.tiny, fmt.max).to(SCALE_DTYPE)  # (...,)
        xf = xf / scale.to(xf.dtype)[..., None]                                       # (..., D)
    y = xf.clamp(-top, top)
    if kind == "int8":
        return y.round().to(torch.int8), scale
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor | None, out_dtype=torch.float32):
    """codes (..., D) (int8, or uint8 bytes of fp8), scales (...,) or None -> (..., D) out_dtype."""
    if codes.dtype == torch.int8:
        vals = codes.to(out_dtype)
    elif codes.dtype in (torch.uint8, getattr(torch, "float8_e4m3fn", None)):
        vals = codes.view(torch.float8_e4m3fn).to(out_dtype)
    else:
        raise TypeError(f"codes must be int8 or uint8 (fp8 bytes), got {codes.dtype}")
    return vals if scales is None else vals * scales.to(out_dtype)[..., None]         # (..., D)


def kv_dtype_bytes(kv_cache_dtype: str, head_dim: int, dtype=torch.float32) -> float:
    """Bytes per cached K (or V) element, the scale's share included: "auto" -> dtype's size;
    "int8" -> 1 + 2 / head_dim (one fp16 scale per vector of head_dim codes); "fp8" -> 1."""
    kind = check_kv_cache_dtype(kv_cache_dtype)
    if kind == "auto":
        return torch.empty(0, dtype=dtype).element_size()
    if kind == "fp8":
        return 1
    return 1 + torch.empty(0, dtype=SCALE_DTYPE).element_size() / head_dim


def kv_pools(kv_cache_dtype: str, shape, device=None, out_dtype=torch.float32):
    """Zeroed codes (L, N, P, Hkv, D), scales (L, N, P, Hkv) (None for fp8) of K or V, and each
    layer's `KVSlots` over them (views: writing through one writes the pools)."""
    kind = check_kv_cache_dtype(kv_cache_dtype, device if device is not None else "cpu")
    if kind == "auto":
        raise ValueError("kv_pools is for kv_cache_dtype 'int8' or 'fp8'")
    L, N, P, Hkv, D = shape
    codes = torch.zeros(shape, dtype=torch.int8 if kind == "int8" else torch.uint8, device=device)
    rows = codes.view(L, N * P, Hkv * D)                                     # (L, N*P, Hkv*D)
    if kind == "fp8":
        return codes, None, [KVSlots(c, None, Hkv, kind, out_dtype) for c in rows]
    scales = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)       # (L, N, P, Hkv)
    slots = [KVSlots(c, s, Hkv, kind, out_dtype) for c, s in zip(rows, scales.view(L, N * P, Hkv))]
    return codes, scales, slots


class KVSlots:
    """One layer's quantized K (or V) pool as slot rows: codes (N*P, Hkv*D), scales (N*P, Hkv)
    or None.

    Paged attention calls only `index_copy_(0, slots, rows)` (write) and `index_select(0, slots)`
    (gather) on a pool; here the first quantizes the rows (M, Hkv*D) and the second returns the
    gathered rows dequantized to `out_dtype`."""

    def __init__(self, codes, scales, num_kv_heads: int, kv_cache_dtype: str, out_dtype):
        self.codes, self.scales, self.kind, self.out_dtype = codes, scales, kv_cache_dtype, out_dtype
        self.Hkv = num_kv_heads

    def index_copy_(self, dim: int, index, rows) -> None:
        M = rows.shape[0]
        codes, scales = quantize_kv(rows.view(M, self.Hkv, -1), self.kind)   # (M, Hkv, D), (M, Hkv)
        self.codes.index_copy_(0, index, codes.view(M, -1))                   # (M, Hkv*D)
        if scales is not None:
            self.scales.index_copy_(0, index, scales)

    def index_select(self, dim: int, index):
        n = index.shape[0]
        codes = self.codes.index_select(0, index).view(n, self.Hkv, -1)      # (n, Hkv, D)
        scales = None if self.scales is None else self.scales.index_select(0, index)  # (n, Hkv)
        return dequantize_kv(codes, scales, self.out_dtype).view(n, -1)      # (n, Hkv*D)
