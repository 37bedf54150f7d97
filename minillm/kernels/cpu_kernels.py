"""CPU matmul routes for `nn.Linear`, chosen by timing them on the machine that runs them.

Letters: R rows (tokens) in one call, I in_features, O out_features, s splits (= threads).

How close a few-row matmul gets to one read of the weight depends on the CPU, its BLAS and the
weight's layout, so `cpu_tuning` times the routes below per weight shape and row bucket and
`accelerate(model)` makes every `nn.Linear` a `RoutedLinear` that follows the table (pin one
with `accelerate(model, route=...)` or `with linear_route(...)`). Routes, all x @ W^T:
`F.linear` (the reference), `x@W` (W^T contiguous), `ksplit` / `nsplit` (s slices of I or O in one
bmm, to keep s cores busy on one row), `onednn` / `onednn_io` (oneDNN on either layout),
`prepacked` (oneDNN's blocked copy, only with `allow_copies=True`), `skinny` ((W @ x^T)^T, kept for
older code). Layouts "out_in" or "in_out" store each weight once either way.

Left out on purpose: GPUs (cuda keeps F.linear), dtypes other than fp32, biases, autograd (a call
that needs a gradient takes F.linear).
"""
import contextvars
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTES = ("auto", "F.linear", "x@W", "ksplit", "nsplit", "prepacked", "skinny", "onednn",
          "onednn_io")
BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 256)   # a call with R rows uses the first bucket >= R
LAYOUT_OF = {"F.linear": "out_in", "nsplit": "out_in", "skinny": "out_in", "x@W": "in_out",
             "ksplit": "in_out", "prepacked": "packed", "onednn": "out_in", "onednn_io": "in_out"}
PACK_HINT = 64                            # the row count oneDNN lays its packed weight out for
TABLE_VERSION = 3                         # 3: tables record the load they were timed under
_PINNED = contextvars.ContextVar("minillm_linear_route", default="auto")
PREPACK_OK = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def check_route(route) -> str:
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return route


@contextmanager
def linear_route(route: str = "auto"):
    """Send every `RoutedLinear` through one route for a block of code (to time or pin it);
    "auto" follows each module's tuned table. Thread- and task-local; restored on exit."""
    token = _PINNED.set(check_route(route))
    try:
        yield
    finally:
        _PINNED.reset(token)


def skinny_route(on: bool):
    """`linear_route("skinny")` if on, else `linear_route("F.linear")` (an earlier version's name)."""
    return linear_route("skinny" if on else "F.linear")


def bucket_of(rows: int) -> int:
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


def probe_rows(bucket: int) -> tuple:
    """The row counts a bucket is timed at: both its ends (BLAS speed can jump inside a bucket)."""
    i = BUCKETS.index(bucket)
    low = BUCKETS[i - 1] + 1 if i else 1
    return (low, bucket) if low < bucket else (bucket,)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a (O, I) weight (raises where this torch has no such op)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT)


def matmul(x: torch.Tensor, weight: torch.Tensor, route: str, splits: int = 2,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x (R, I) @ weight (O, I)^T -> (R, O) through one route; any route works on either layout."""
    R, I = x.shape
    O = weight.shape[0]
    if route == "x@W":
        return x @ weight.t()                                      # (R, I) @ (I, O)
    if route == "ksplit" and splits > 1 and I % splits == 0:
        xs = x.view(R, splits, I // splits).transpose(0, 1)        # (s, R, I/s)
        ws = weight.t().view(splits, I // splits, O)               # (s, I/s, O), a view
        return torch.bmm(xs, ws).sum(0)                            # (R, O)
    if route == "nsplit" and splits > 1 and O % splits == 0:
        ws = weight.view(splits, O // splits, I).transpose(1, 2)   # (s, I, O/s), a view
        y = torch.bmm(x.expand(splits, R, I), ws)                  # (s, R, O/s)
        return y.transpose(0, 1).reshape(R, O)
    if route == "prepacked" and packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if route in ("onednn", "onednn_io") and PREPACK_OK:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    if route == "skinny":
        return torch.mm(weight, x.t()).t()                         # (O, R) -> (R, O)
    return F.linear(x, weight)


class RoutedLinear(nn.Linear):
    """nn.Linear whose CPU fp32 inference calls follow a route table (see the module docstring).

    `routes` maps a row bucket to a route; empty means F.linear. The weight, state_dict keys and
    gradients are nn.Linear's; a packed copy, when a route needs one, lives on the module (not
    in state_dict) and is remade whenever the weight changes (another tensor or an in-place write).
    """
    routes: dict = {}
    splits: int = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
                or self.bias is not None or x.numel() == 0
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        rows = x.numel() // x.shape[-1]
        route = _PINNED.get()
        if route == "auto":
            route = self.routes.get(bucket_of(rows), "F.linear")
        packed = self._packed() if route == "prepacked" else None
        y = matmul(x.reshape(rows, -1), w, route, self.splits, packed)   # (R, O)
        return y.view(*x.shape[:-1], -1)

    def _packed(self) -> torch.Tensor | None:
        w = self.weight
        if not PREPACK_OK or w.is_inference():
            return None
        key = (w.data_ptr(), w._version, tuple(w.shape))
        cached = self.__dict__.get("_packed_copy")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_packed_copy"] = (key, pack(w))
        return cached[1]

    def extra_bytes(self) -> int:
        """Bytes of the packed copy this module holds (0 without one)."""
        cached = self.__dict__.get("_packed_copy")
        return 0 if cached is None else cached[1].numel() * cached[1].element_size()


def cpu_name() -> str:
    """The CPU model string (Linux /proc/cpuinfo, else what platform reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# documented switches that make oneDNN, MKL or ATen run other kernels on the same CPU
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
           "ATEN_CPU_CAPABILITY")


def kernel_isa() -> dict:
    """The instruction set the kernels use: ATen's CPU capability and those of ISA_ENV that are
    set. A table timed with AMX must not be reused by a process held to AVX2 on the same CPU."""
    try:
        aten = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        aten = "unknown"
    return {"aten": aten, **{k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}}


def relayout(weight: nn.Parameter, layout: str) -> None:
    """Re-lay a (O, I) weight's bytes in place: "in_out" makes it a view of an (I, O) tensor."""
    is_in_out = weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
    if layout == "in_out" and not is_in_out:
        weight.data = weight.data.t().contiguous().t()
    elif layout != "in_out" and not weight.is_contiguous():
        weight.data = weight.data.contiguous()

