"""Quantized drop-ins for a bias-free `nn.Linear`: `Int8Linear` and `Int4Linear`.

Letters: M rows (tokens) in one call, K in_features, N out_features, G group size.

Each stores its weight in a `formats.py` format as buffers (nothing trains), so `.to(device)`,
`state_dict` and `nbytes` see the stored bytes. Two ways to multiply, side by side:
- **reference**: dequantize, then `F.linear`: exactly the float model with the dequantized weight.
- **fast**: torch's fused weight-only kernels (`_weight_int8pack_mm`,
  `_weight_int4pack_mm_for_cpu`, CUDA's `_weight_int4pack_mm`) with bf16 activations: they agree
  with the reference to bf16 rounding. The int4 kernel keeps its own tiled copy of the codes per
  device (`kernel_nbytes`; "fast_path_copies" in `quantized_bytes`).
int8 also has `route="w8a8"` (w8a8.py); `routes.py` picks the faster route per machine.
`path="auto"` takes the fast path where the kernel exists and agrees with the reference on a
small probe input, else the reference with one warning per model and format; nothing is timed.

Left out on purpose: biases, autograd, static activation scales, int4 kernels on platforms other
than CPU and CUDA.
"""
import torch

from minillm.quant import w8a8
from minillm.quant.formats import Int4Weight, Int8Weight, pack_int4, unpack_int4
from minillm.quant.qbase import INT4_KERNEL_GROUPS, PATHS, _QuantLinear, check_path  # noqa: F401


class Int8Linear(_QuantLinear):
    """int8 codes (N, K) and one fp32 scale per output row (see `Int8Weight`)."""
    format, weight_type, ROUTES = "int8", Int8Weight, ("int8pack", "w8a8")

    def _store(self, weight: Int8Weight) -> None:
        self.register_buffer("qweight", weight.q.contiguous())               # (N, K) int8
        self.register_buffer("scales", weight.scale.float().contiguous())    # (N,)

    def weight_format(self, rows=None) -> Int8Weight:
        if rows is None:
            return Int8Weight(self.qweight, self.scales)
        rows = rows.to(self.qweight.device)
        return Int8Weight(self.qweight[rows], self.scales[rows])

    def _prepare(self, device):
        if self.route == "w8a8":
            if device.type != "cpu" or not w8a8.available():
                return None
            return "w8a8", w8a8.prepack(self.qweight, self.scales)
        if not hasattr(torch, "_weight_int8pack_mm"):
            return None
        return "int8pack", self.qweight.to(device), self.scales.to(device, torch.bfloat16)

    def _fast(self, x, kernel):
        if kernel[0] == "w8a8":
            return w8a8.linear_w8a8(x, kernel[1])                             # (M, N) fp32
        _, q, scales = kernel
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scales)  # (M, N)

    def _kernel_read_nbytes(self, kernel) -> int:
        if kernel[0] == "w8a8":
            return w8a8.packed_nbytes(self.out_features, self.in_features)
        return super()._kernel_read_nbytes(kernel)

    @property
    def kernel_nbytes(self) -> int:
        """As the base class, plus the W8A8 route's prepacked copy (an opaque object)."""
        return super().kernel_nbytes + sum(
            w8a8.packed_nbytes(self.out_features, self.in_features)
            for k in self._kernels.values() if k is not None and k[0] == "w8a8")


class Int4Linear(_QuantLinear):
    """int4 codes packed two per byte (N, K/2), fp16 scale and minimum per group (see `Int4Weight`)."""
    format, weight_type, ROUTES = "int4", Int4Weight, ("int4pack",)

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
        return mm(x.to(torch.bfloat16).contiguous(), packed, self.group_size, scale_zero)  # (M, N)
