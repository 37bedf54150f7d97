"""What `Int8Linear` and `Int4Linear` share (see `linear.py`): the checks, the path and route
choice, the kernel copy per device, the probe against the reference, the one-line fallback
warning, and forward's reshape. A format says how it stores its weight, reads it back and runs
its kernels.

Letters: M rows (tokens) in one call, K in_features, N out_features.
"""
import abc
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

PATHS = ("reference", "fast", "auto")
INT4_KERNEL_GROUPS = (32, 64, 128, 256)      # the group sizes torch's int4 kernels accept


def check_path(path) -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return path


def _probe_ok(fast, out_features: int, rows: torch.Tensor, weight: torch.Tensor,
              tol: float = 0.03) -> bool:
    """Does `fast(x)` agree, on the output columns `rows`, with x @ weight^T (those rows of the
    dequantized weight, fp32), for a 1-row and a 5-row input? A wrong layout or zero convention
    is off by the weight's own size, far beyond bf16's 2**-8 (or W8A8's 8-bit activations: `tol`). (A spread of 64 rows keeps the
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
        if (y - ref).abs().max() > tol * ref.abs().max() + 1e-4:
            return False
    return True


class _QuantLinear(nn.Module, abc.ABC):
    """What both formats share: the checks, the path choice, the kernel copy per device, forward's
    reshape. A format says how it stores its weight, reads it back and runs its kernel."""
    format = ""
    weight_type: type = object            # the formats.py class this module holds
    ROUTES: tuple = ()                    # the fast routes; the first is the default

    def __init__(self, weight, path: str = "auto", route: str | None = None):
        if not isinstance(weight, self.weight_type):
            raise TypeError(f"weight must be an {self.weight_type.__name__}, got {type(weight).__name__}")
        super().__init__()
        self.out_features, self.in_features = weight.q.shape                # (N, K)
        self.path = check_path(path)
        self.route = self._check_route(route)
        self._kernels: dict = {}          # device -> the fast path's tensors, or None: no fast path
        self._fallback_seen: set = set()  # (format, device) told already; quantize shares one per model
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
        """The fused kernel: x (M, K), any float dtype -> (M, N)."""

    def _check_route(self, route):
        if route is None:
            return self.ROUTES[0]
        if route not in self.ROUTES:
            raise ValueError(f"route must be one of {self.ROUTES} for {self.format}, got {route!r}")
        return route

    def set_route(self, route: str) -> None:
        """Use fast route `route` (one of ROUTES) from now on; the kernel copies are remade."""
        self.route, self._kernels = self._check_route(route), {}
        self._kernel_for(self.qweight.device)

    def kernel_as(self, route: str, device):
        """Route `route`'s kernel for `device` if it exists and passes the probe, else None; the
        module keeps its own route (for the route timing in `routes.py`)."""
        saved, self.route = self.route, self._check_route(route)
        try:
            kernel = self._prepare(torch.device(device))
            return kernel if kernel is not None and self._probe(kernel, device) else None
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return None
        finally:
            self.route = saved

    def read_nbytes(self, device=None) -> int:
        """Bytes one call reads from memory on `device`: what the active kernel reads (its own
        packed copy where it has one), or the stored weight on the reference path."""
        device = torch.device(device) if device is not None else self.qweight.device
        kernel = self._kernel_for(device)
        return self.nbytes if kernel is None else self._kernel_read_nbytes(kernel)

    def _kernel_read_nbytes(self, kernel) -> int:
        return sum(t.numel() * t.element_size() for t in kernel if isinstance(t, torch.Tensor))

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
        if kernel is None and self.path == "auto" and (self.format, key) not in self._fallback_seen:
            self._fallback_seen.add((self.format, key))
            warnings.warn(f"no fast {self.format} kernel for this model on {key}: using the "
                          f"dequantize-then-matmul reference path (slower)", stacklevel=3)
        if kernel is None and self.path == "fast":
            raise ValueError(f"path='fast': no working fused {self.format} kernel for a "
                             f"{self.out_features}x{self.in_features} weight on {device} "
                             f"(use path='auto' or 'reference')")
        return kernel

    def _probe(self, kernel, device) -> bool:
        rows = torch.linspace(0, self.out_features - 1, min(64, self.out_features)).long().unique()
        return _probe_ok(lambda x: self._fast(x, kernel), self.out_features, rows.to(device),
                         self.weight_format(rows).dequantize().to(device),
                         0.06 if self.route == "w8a8" else 0.03)

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
            y = self._fast(x2, kernel).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)                      # (..., N)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if hasattr(self, "group_size") else ""
        active = self.active_path() if self.path == "auto" else self.path
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format}{group}, path={self.path}, route={self.route}"
                + (f" ({active})" if self.path == "auto" else ""))
