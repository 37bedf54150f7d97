"""Weight number formats in plain PyTorch: what a quantized weight *is*, before any kernel.

Letters: N output features (rows of a Linear weight), K input features, G group size.

- **int8, per output channel, symmetric**: `w[n, k] ~ s[n] * q[n, k]` with `q` in [-127, 127] and
  `s[n] = max_k |w[n, k]| / 127` (fp32, one per row: 4 bytes per row are nothing next to K bytes).
- **int4, groups of G along K, asymmetric** (llama.cpp's Q4_1 rule): `w ~ d * q + m` with `q` in
  [0, 15], `m` the group's minimum and `d = (max - min) / 15`. `d` and `m` are stored in fp16, as
  Q4_1 stores them: they are not free (2 x 16 bits per group, one extra bit per weight at G = 32).

A dequantized weight is computed as `(d * q) + m` in fp32, one rounding per operation: the order
numpy uses when `gguf` dequantizes a Q4_1 file, so the weights of the shipped model come back bit
for bit. `Int4Weight.q` keeps one code per byte (easy to read); `pack_int4` halves it for storage
and `nbytes` counts the packed size.

Left out on purpose: symmetric int4, per-tensor scales, double quantization of the scales,
k-quants (Q4_K's super-blocks).
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int8Weight:
    """`q` int8 (N, K), `scale` fp32 (N,): w ~ scale[:, None] * q."""
    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.scale.to(dtype)[:, None] * self.q.to(dtype))          # (N, K)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True)
class Int4Weight:
    """`q` uint8 codes 0..15 (N, K), `scale` and `minimum` (N, K // G) in `scale.dtype` (fp16)."""
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.q.shape
        G = self.group_size
        d = self.scale.float()[:, :, None]                                  # (N, K/G, 1)
        m = self.minimum.float()[:, :, None]                                # (N, K/G, 1)
        w = d * self.q.view(N, K // G, G).float() + m                       # (N, K/G, G)
        return w.view(N, K).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes as stored: two codes per byte, plus the scales and minimums."""
        return self.q.numel() // 2 + (self.scale.numel() + self.minimum.numel()) * self.scale.element_size()


def _check_weight(w) -> None:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
        raise TypeError(f"w must be a floating 2-D tensor (N, K), got "
                        f"{type(w).__name__ if not isinstance(w, torch.Tensor) else (w.dtype, tuple(w.shape))}")


def check_group_size(group_size, in_features: int) -> None:
    """A clear error for a group size that is not a positive even int dividing the input width."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2 or group_size % 2 or in_features % group_size:
        raise ValueError(f"group_size must be an even int >= 2 that divides the input width "
                         f"{in_features}, got {group_size}")


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Round-to-nearest int8, one symmetric scale per output channel (row)."""
    _check_weight(w)
    w = w.float()
    amax = w.abs().amax(dim=1)                                              # (N,)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)     # (N, K)
    return Int8Weight(q, scale)


def int4_params(w_groups: torch.Tensor, scale_dtype: torch.dtype = torch.float16):
    """Q4_1's scale and minimum of each group: (..., G) -> d (...,), m (...,) in `scale_dtype`."""
    lo, hi = w_groups.amin(dim=-1), w_groups.amax(dim=-1)
    return ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)


def round_int4(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Nearest code 0..15 of `w` on the grid `scale * q + minimum` (all broadcastable); a group
    whose values are all equal (scale 0) gets code 0, so it dequantizes to its minimum."""
    d, m = scale.float(), minimum.float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round((w.float() - m) * inv).clamp_(0, 15).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int = 32,
                  scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    """Round-to-nearest int4 in groups of `group_size` along the input dimension."""
    _check_weight(w)
    N, K = w.shape
    check_group_size(group_size, K)
    groups = w.float().view(N, K // group_size, group_size)                 # (N, K/G, G)
    d, m = int4_params(groups, scale_dtype)                                 # (N, K/G) each
    q = round_int4(groups, d[..., None], m[..., None]).view(N, K)           # (N, K)
    return Int4Weight(q, d, m, group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (N, K) -> bytes (N, K/2): column 2j in the low nibble, 2j + 1 in the high one."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: bytes (N, K/2) -> codes (N, K)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).view(packed.shape[0], -1)
