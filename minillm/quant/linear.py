"""Quantized drop-ins for a bias-free `nn.Linear`: `Int8Linear` and `Int4Linear`.

Letters: M rows (tokens) in one call, K in_features, N out_features, G group size.

Each module stores its weight in the format of `formats.py` as buffers (not Parameters: nothing
here trains), so `.to(device)`, `state_dict` and `nbytes` see exactly the stored bytes. Two ways
to multiply by it, kept side by side:

- **reference**: dequantize to the activation dtype, then `F.linear`. Plain and exact: its result
  is the float model's with the dequantized weight. It reads more bytes than the fp32 model does
  (the codes, then a full float weight it writes and reads again), so it is never the fast one.
- **fast**: torch's fused weight-only kernels, which read the small weight once and dequantize in
  registers: on CPU `torch._weight_int8pack_mm` and `torch._weight_int4pack_mm_for_cpu`, on CUDA
  `torch._weight_int4pack_mm`. They take bf16 activations (cast in, cast back out) and compute
  the int4 weight as `(q - 8) * scale + zero`, so Q4_1's `d * q + m` maps to `scale = d`,
  `zero = m + 8 d`, both rounded to bf16: the fast path agrees with the reference to bf16
  rounding, not bit for bit. The int4 kernel wants its own copy of the codes (a tiled layout),
  the same size as the stored one, made once per device and kept beside it: `kernel_nbytes`
  counts it, and `quantized_bytes` reports it as "fast_path_copies" (memory held, not read).

`path="auto"` takes the fast path where the kernel exists and, probed once per device on a small
input, agrees with the reference; anywhere else the reference. Nothing is timed to decide it.

Left out on purpose: biases, autograd, activation quantization (W8A8 lives with the outlier
study), int4 kernels on platforms other than CPU and CUDA.
"""
import abc

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.quant.formats import Int4Weight, Int8Weight, pack_int4, unpack_int4

PATHS = ("reference", "fast", "auto")
INT4_KERNEL_GROUPS = (32, 64, 128, 256)      # the group sizes torch's int4 kernels accept


def check_path(path) -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return path


def _probe_ok(fast, out_features: int, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `fast(x)` agree, on the output columns `rows`, with x @ weight^T (those rows of the
    dequantized weight, fp32), for a 1-row and a 5-row input? A wrong layout or zero convention
    is off by the weight's own size, far beyond bf16's 2**-8. (A spread of 64 rows keeps the
    probe cheap next to dequantizing the whole weight.)"""
    gen = torch.Generator().manual_seed(0)
    for m in (1, 5):
        x = torch.randn(m, weight.shape[1], generator=gen).to(weight.device, torch.bfloat16)
        try:
            y = fast(x).float()                                             # (M, N)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False
        if y.shape != (m, out_features) or not torch.isfinite(y).all():
            return False
        y, ref = y[:, rows], x.float() @ weight.t()                          # (M, R) each
        if (y - ref).abs().max() > 0.03 * ref.abs().max() + 1e-4:
            return False
    return True


class _QuantLinear(nn.Module, abc.ABC):
    """What both formats share: the checks, the path choice, the kernel copy per device, forward's
    reshape. A format says how it stores its weight, reads it back and runs its kernel."""
    format = ""
    weight_type: type = object            # the formats.py class this module holds

    def __init__(self, weight, path: str = "auto"):
        if not isinstance(weight, self.weight_type):
            raise TypeError(f"weight must be an {self.weight_type.__name__}, got {type(weight).__name__}")
        super().__init__()
        self.out_features, self.in_features = weight.q.shape                # (N, K)
        self.path = check_path(path)
        self._kernels: dict = {}          # device -> the fast path's tensors, or None: no fast path
        self._store(weight)
        self._kernel_for(self.qweight.device)          # probe now: path="fast" fails here if it must

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight_format().dequantize(dtype)                       # (N, K)

    @abc.abstractmethod
    def _store(self, weight) -> None:
        """Register the weight's tensors as buffers (`qweight` and its scales)."""

    @abc.abstractmethod
    def weight_format(self, rows: torch.Tensor | None = None):
        """The stored weight as an Int8Weight / Int4Weight (only `rows`, if given)."""

    @abc.abstractmethod
    def _prepare(self, device):
        """The kernel's tensors for `device`, or None where it has no fused kernel."""

    @abc.abstractmethod
    def _fast(self, x, kernel):
        """The fused kernel: x bf16 (M, K) -> (M, N)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (its buffers; the kernel's copy is not counted)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def kernel_nbytes(self) -> int:
        """Extra bytes the fast path keeps beside the stored weight (its own copy of the codes and
        scales, per device it ran on); 0 on the reference path. Not read by a decode step, but
        held in memory: int4's tiled copy is as large as the stored codes."""
        own = {b.untyped_storage().data_ptr() for b in self.buffers()}
        extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for kernel in self._kernels.values() if kernel is not None
                 for t in kernel if isinstance(t, torch.Tensor)}
        return sum(n for ptr, n in extra.items() if ptr not in own)

    def _kernel_for(self, device: torch.device):
        key = str(device)
        if key not in self._kernels:
            kernel = None
            if self.path != "reference":
                try:
                    kernel = self._prepare(device)
                except (RuntimeError, NotImplementedError, TypeError, ValueError):
                    kernel = None
                if kernel is not None and not self._probe(kernel, device):
                    kernel = None
            self._kernels[key] = kernel
        kernel = self._kernels[key]
        if kernel is None and self.path == "fast":
            raise ValueError(f"path='fast': no working fused {self.format} kernel for a "
                             f"{self.out_features}x{self.in_features} weight on {device} "
                             f"(use path='auto' or 'reference')")
        return kernel

    def _probe(self, kernel, device) -> bool:
        rows = torch.linspace(0, self.out_features - 1, min(64, self.out_features)).long().unique()
        return _probe_ok(lambda x: self._fast(x, kernel), self.out_features, rows.to(device),
                         self.weight_format(rows).dequantize().to(device))

    def set_path(self, path: str) -> None:
        """Switch between "reference", "fast" and "auto" (probing again); "fast" may refuse."""
        self.path, self._kernels = check_path(path), {}
        self._kernel_for(self.qweight.device)

    def active_path(self, device=None) -> str:
        """"fast" or "reference": what a call on `device` (default: the buffers') runs."""
        device = torch.device(device) if device is not None else self.qweight.device
        return "fast" if self._kernel_for(device) is not None else "reference"

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the buffers; a dtype cast (`model.to(torch.bfloat16)`) leaves the
        stored format as it is (only the activations change dtype). Kernel copies are remade."""
        dtypes = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        out = super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            if self._buffers[name].dtype != dtype:
                self._buffers[name] = self._buffers[name].to(dtype)
        self._kernels = {}
        return out

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))                         # (M, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must end in in_features={self.in_features}, got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)                                 # (M, K)
        kernel = self._kernel_for(x.device)
        if kernel is None:
            y = self._reference(x2)
        else:
            y = self._fast(x2.to(torch.bfloat16).contiguous(), kernel).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)                      # (..., N)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if hasattr(self, "group_size") else ""
        active = self.active_path() if self.path == "auto" else self.path
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format}{group}, path={self.path}"
                + (f" ({active})" if self.path == "auto" else ""))


class Int8Linear(_QuantLinear):
    """int8 codes (N, K) and one fp32 scale per output row (see `Int8Weight`)."""
    format, weight_type = "int8", Int8Weight

    def _store(self, weight: Int8Weight) -> None:
        self.register_buffer("qweight", weight.q.contiguous())               # (N, K) int8
        self.register_buffer("scales", weight.scale.float().contiguous())    # (N,)

    def weight_format(self, rows=None) -> Int8Weight:
        if rows is None:
            return Int8Weight(self.qweight, self.scales)
        rows = rows.to(self.qweight.device)
        return Int8Weight(self.qweight[rows], self.scales[rows])

    def _prepare(self, device):
        if not hasattr(torch, "_weight_int8pack_mm"):
            return None
        return self.qweight.to(device), self.scales.to(device, torch.bfloat16)

    def _fast(self, x, kernel):
        q, scales = kernel
        return torch._weight_int8pack_mm(x, q, scales)                        # (M, N)


class Int4Linear(_QuantLinear):
    """int4 codes packed two per byte (N, K/2), fp16 scale and minimum per group (see `Int4Weight`)."""
    format, weight_type = "int4", Int4Weight

    def _store(self, weight: Int4Weight) -> None:
        self.group_size = weight.group_size
        self.register_buffer("qweight", pack_int4(weight.q))                 # (N, K/2) uint8
        self.register_buffer("scales", weight.scale.contiguous())            # (N, K/G)
        self.register_buffer("minimums", weight.minimum.contiguous())        # (N, K/G)

    def weight_format(self, rows=None) -> Int4Weight:
        if rows is None:
            return Int4Weight(unpack_int4(self.qweight), self.scales, self.minimums, self.group_size)
        rows = rows.to(self.qweight.device)
        return Int4Weight(unpack_int4(self.qweight[rows]), self.scales[rows], self.minimums[rows],
                          self.group_size)

    def _prepare(self, device):
        K, N, G = self.in_features, self.out_features, self.group_size
        tiles = next((t for t in (8, 4, 2) if K % (16 * t) == 0), None)
        if G not in INT4_KERNEL_GROUPS or tiles is None or K % G:
            return None
        d, m = self.scales.float(), self.minimums.float()                    # (N, K/G)
        # the kernels' rule is (q - 8) * scale + zero: zero = m + 8 d gives back d * q + m
        scale_zero = torch.stack([d, m + 8 * d], dim=-1)                      # (N, K/G, 2)
        scale_zero = scale_zero.transpose(0, 1).contiguous().to(device, torch.bfloat16)  # (K/G, N, 2)
        codes = unpack_int4(self.qweight)                                     # (N, K)
        if device.type == "cpu" and hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), tiles)
        elif device.type == "cuda" and hasattr(torch, "_convert_weight_to_int4pack"):
            # CUDA's converter takes two codes per byte, the even column in the high nibble
            hi_first = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)  # (N, K/2)
            packed = torch._convert_weight_to_int4pack(hi_first, tiles)
        else:
            return None
        return device.type, packed, scale_zero

    def _fast(self, x, kernel):
        kind, packed, scale_zero = kernel
        mm = torch._weight_int4pack_mm_for_cpu if kind == "cpu" else torch._weight_int4pack_mm
        return mm(x, packed, self.group_size, scale_zero)                    # (M, N)
