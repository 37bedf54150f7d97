"""Chapter 1, measured: this machine's ceilings and real operating points on its roofline.

`measure_hardware` times a large-buffer read (bandwidth) and square matmuls (peak FLOP/s per
dtype) and returns a `Hardware` like the datasheet presets. `matmul_points` times the
(B, d) @ (d, n) matmuls a decode step issues at batch B (and prefill-sized ones), and
`decode_breakdown` splits a measured decode step into weight reads, KV reads and the rest.

Letters: B batch, S context, d model width, n output width.
Timings are medians after a warm-up; on CUDA the device is synchronized around them.
Left out on purpose: clock/power control and cache flushing. Instead, memory-bound points
cycle through enough distinct weight copies that they cannot sit in the CPU's last-level cache,
as a real step's hundreds of MB of weights cannot.
"""
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minillm._validate import check_int
from minillm.lab.common import time_fn
from minillm.model.loading import default_device
from minillm.model.config import ModelConfig
from minillm.analysis.roofline import (Hardware, OpCost, decode_costs, dtype_bytes, dtype_name,
                                       op_time, step_time, torch_dtype, total_cost)



def _device(device) -> torch.device:
    return default_device() if device is None else torch.device(device)


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache as the OS reports it (Linux sysfs, macOS sysctl), or None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
        except (OSError, ValueError, IndexError):
            pass
    if not sizes and sys.platform == "darwin":
        for key in ("hw.l3cachesize", "hw.l2cachesize"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
                sizes.append(int(out.stdout.strip()))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
    return max(sizes) if sizes else None


def bandwidth_buffer_bytes() -> int:
    """A buffer no cache holds: 4x the last-level cache, at least 256 MiB, at most 1/8 of RAM."""
    llc = last_level_cache_bytes() or 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(max(256 * 2**20, min(4 * llc, ram // 8)))


def measure_bandwidth(device=None, nbytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: sum a fp32 buffer far larger than any cache (on a CPU by
    default 4x its last-level cache, `bandwidth_buffer_bytes`; 1 GiB on a GPU)."""
    device = _device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else bandwidth_buffer_bytes()
    x = torch.ones(int(nbytes) // 4, dtype=torch.float32, device=device)
    return x.numel() * 4 / time_fn(lambda: x.sum(), device, repeat=repeats)


def measure_matmul_flops(device=None, dtype="fp32", n: int = 1024, repeats: int = 3) -> float:
    """Achieved FLOP/s of an (n, n) @ (n, n) matmul: 2 n^3 FLOPs."""
    device = _device(device)
    a = torch.randn(n, n, device=device).to(torch_dtype(dtype))
    b = torch.randn(n, n, device=device).to(a.dtype)
    return 2.0 * n**3 / time_fn(lambda: a @ b, device, repeat=repeats)


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_hardware(device=None, quick: bool = False, dtypes=None,
                     progress: bool = True) -> Hardware:
    """This machine's roofline: measured bandwidth and matmul FLOP/s per dtype.

    quick=True uses small buffers/matmuls (about a second on a laptop CPU; lower numbers).
    """
    device = _device(device)
    if dtypes is None:
        dtypes = ("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    big = device.type == "cuda"
    nbytes = (2**30 if big else bandwidth_buffer_bytes()) // (2 if quick else 1)
    steps = tqdm(["bandwidth", *dtypes], desc="measuring", disable=not progress)
    peak, bw = {}, 0.0
    for step in steps:
        steps.set_postfix_str(step)
        if step == "bandwidth":
            bw = measure_bandwidth(device, nbytes, repeats=3 if quick else 7)
            continue
        # CPUs without bf16/fp16 matmul units run them tens of times slower: smaller n.
        n = 8192 if big else (1536 if dtype_name(step) in ("fp32", "fp64") else 512)
        peak[dtype_name(step)] = measure_matmul_flops(device, step, n // (2 if quick else 1),
                                                      2 if quick else 4)
    name = torch.cuda.get_device_name(device) if big else "this CPU"
    return Hardware(f"{name} (measured)", peak, bw, _memory_bytes(device))


@dataclass(frozen=True)
class MeasuredPoint:
    """One timed op beside its roofline prediction."""

    label: str
    flops: float
    bytes: float
    seconds: float
    predicted_s: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def achieved(self) -> float:
        """Achieved FLOP/s."""
        return self.flops / self.seconds

    @property
    def ratio(self) -> float:
        """Measured time / roofline lower bound (>= 1 when the roofline holds)."""
        return self.seconds / self.predicted_s


def time_matmul(hw: Hardware, m: int, k: int, n: int, dtype="fp32", device=None,
                repeats: int = 3, min_weight_bytes: float = 128 * 2**20,
                max_flops: float = 2e9, label: str | None = None) -> MeasuredPoint:
    """Time (m, k) @ (k, n), cycling through enough weight copies to defeat the caches."""
    device = _device(device)
    tdt, w = torch_dtype(dtype), dtype_bytes(dtype)
    cost = OpCost(label or f"{m}x{k}x{n}", 2.0 * m * k * n, (k * n + m * k + m * n) * w)
    copies = max(1, min(math.ceil(min_weight_bytes / (k * n * w)), int(max_flops // cost.flops)))
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(tdt)              # (m, k)
    ws = [torch.randn(k, n, generator=g, device=device).to(tdt) for _ in range(copies)]

    def run():
        for wt in ws:
            x @ wt                                                          # (m, k) @ (k, n)
    seconds = time_fn(run, device, repeat=repeats) / copies
    return MeasuredPoint(cost.name, cost.flops, cost.bytes, seconds, op_time(cost, hw, dtype))


def matmul_points(hw: Hardware, k: int, n: int, batches=(1, 4, 16, 64, 256),
                  prefill_tokens=(1024,), dtype="fp32", device=None, quick: bool = False,
                  progress: bool = True) -> list[MeasuredPoint]:
    """Decode-shaped (B, k) @ (k, n) for each B, then prefill-shaped (T, k) @ (k, n)."""
    shapes = [(b, f"matmul B={b}") for b in batches] + [(t, f"matmul T={t}")
                                                        for t in prefill_tokens]
    mb = (32 if quick else 128) * 2**20
    return [time_matmul(hw, m, k, n, dtype, device, repeats=2 if quick else 3,
                        min_weight_bytes=mb, max_flops=(5e8 if quick else 2e9), label=lab)
            for m, lab in tqdm(shapes, desc="matmuls", disable=not progress)]


def skinny_matmul_times(hw: Hardware, k: int, n: int, rows=(1, 2, 3, 4, 8, 16), device=None,
                        repeats: int = 3, min_weight_bytes: float = 128 * 2**20,
                        routes=None) -> dict:
    """Seconds of (rows, k) @ W^T for a weight W (n, k), through each CPU route of
    `minillm.kernels.cpu_kernels` (F.linear is what nn.Linear calls; see that module for the others),
    cycling through enough weight copies to defeat the caches, plus the bandwidth bound: one read
    of the weight. Returns {route: [seconds per row count]}; "bound" last."""
    from minillm.kernels.cpu_tuning import CANDIDATES, time_rows
    device = _device(device)
    copies = max(1, math.ceil(min_weight_bytes / (k * n * 4)))
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(n, k, generator=g, device=device) for _ in range(copies)]
    if device.type != "cpu":
        routes = ("F.linear",)
    ms = time_rows(weights, list(rows), rounds=repeats, candidates=routes or CANDIDATES)
    out = {route: [t[m] / 1e3 / copies for m in rows] for route, t in ms.items()}
    out["bound"] = [k * n * 4 / hw.mem_bandwidth for _ in rows]
    return out


def decode_weight_bytes(cfg: ModelConfig, dtype="fp32") -> float:
    """Bytes of the weights a decode step streams: every linear layer and lm_head."""
    d, D, L = cfg.d_model, cfg.head_dim, cfg.n_layer
    per_layer = d * (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D * d + 3 * d * cfg.d_ff
    return (L * per_layer + d * cfg.vocab_size) * dtype_bytes(dtype)


def decode_breakdown(cfg: ModelConfig, hw: Hardware, batch_size: int, context_len: int,
                     measured_s: float, dtype="fp32", matmul_s: float | None = None) -> dict[str, float]:
    """Split a measured decode step: weight reads, KV reads, activations, and the rest.

    The first three are bytes / bandwidth (the step is memory-bound, so its compute hides
    under them); "overhead" is what the roofline does not explain: kernel launches, Python,
    the elementwise ops left out of the count, and bandwidth not reached.
    With `matmul_s` (the step's projections timed alone, `measure_decode_matmuls`) the overhead
    is split in two: "matmul_below_roof_s", the matmuls' time beyond reading their weights at
    the measured bandwidth, and "other_s", everything else (Python, launches, norms, RoPE, ...).
    """
    if measured_s <= 0:
        raise ValueError(f"measured_s must be > 0, got {measured_s}")
    if matmul_s is not None and not matmul_s > 0:
        raise ValueError(f"matmul_s must be > 0 seconds or None, got {matmul_s}")
    costs = decode_costs(cfg, batch_size, context_len, dtype)
    total = total_cost(costs)
    weights = decode_weight_bytes(cfg, dtype)
    kv = 2 * cfg.n_layer * batch_size * (context_len + 1) * cfg.n_kv_head * cfg.head_dim \
        * dtype_bytes(dtype)
    bw = hw.mem_bandwidth
    out = {"weights_s": weights / bw, "kv_s": kv / bw,
           "activations_s": (total.bytes - weights - kv) / bw,
           "compute_s": total.flops / hw.peak(dtype),
           "predicted_s": step_time(costs, hw, dtype), "measured_s": measured_s}
    out["overhead_s"] = max(0.0, measured_s - out["weights_s"] - out["kv_s"]
                            - out["activations_s"])
    if matmul_s is not None:
        out["matmul_s"] = matmul_s
        out["matmul_below_roof_s"] = max(0.0, matmul_s - out["weights_s"])
        out["other_s"] = max(0.0, out["overhead_s"] - out["matmul_below_roof_s"])
    return out


def decode_matmuls(model, batch: int = 1, seed: int = 0):
    """A function that runs the matmuls of one decode step of `model` at batch B, and nothing else.

    Every `nn.Linear` of `model` (q/k/v, o, gate/up, down per layer, then lm_head) runs once, in
    the model's order, on a (B, in_features) input, called as the flat loop calls it
    (`kernels/flat_forward.py`: the route of its tuned table, or the pinned one, looked up once per
    pass); a Linear of another class (a quantized one) runs its own forward. Its weights stream
    from memory as in a real step, so no step through these kernels can take less time.
    """
    from minillm.kernels.flat_forward import _LINEARS, _linear, _router   # the step's own calls
    check_int("batch", batch, 1)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not lins:
        raise ValueError("model has no nn.Linear modules to time")
    g = torch.Generator().manual_seed(seed)
    xs = {n: torch.randn(batch, n, generator=g).to(model.device, model.dtype)   # (B, in)
          for n in sorted({m.in_features for m in lins})}
    calls = [(m, xs[m.in_features], type(m) in _LINEARS and m.bias is None) for m in lins]

    @torch.inference_mode()
    def run():
        route = _router(batch, model.dtype)
        for m, x, plain in calls:
            _linear(x, m, route) if plain else m(x)                  # (B, out)
    return run


def measure_decode_matmuls(model, batch_sizes=(1,), repeats: int = 3, seed: int = 0) -> list[float]:
    """Median seconds of all of a decode step's projections alone (`decode_matmuls`), at each B."""
    out = []
    for i, b in enumerate(batch_sizes):
        check_int(f"batch_sizes[{i}]", b, 1)
        out.append(time_fn(decode_matmuls(model, b, seed), model.device, repeat=repeats))
    return out


def measure_decode_steps(model, batch_sizes=(1, 4, 16, 64), context_len: int = 128,
                         repeats: int = 3, seed: int = 0, progress: bool = True) -> list[float]:
    """Median seconds of one real decode step of `model`: input (B, 1) with S cached tokens.

    The cache is filled with random K/V instead of a prefill (the step's time does not depend
    on the values), and every repeat writes the same slot, so each sees the same S.
    """
    from minillm.model.kv_cache import KVCache
    cfg = model.config
    for i, b in enumerate(batch_sizes):
        check_int(f"batch_sizes[{i}]", b, 1)
    check_int("context_len", context_len, 1)
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in tqdm(batch_sizes, desc="decode steps", disable=not progress):
        cache = KVCache(cfg, b, context_len + 1, device=model.device, dtype=model.dtype)
        cache.k.normal_(generator=None)   # stand-in for a prefilled context
        cache.v.normal_(generator=None)
        ids = torch.randint(0, cfg.vocab_size, (b, 1), generator=g).to(model.device)  # (B, 1)
        position = torch.tensor([context_len], device=model.device)  # each repeat: the same slot

        def step():
            model(ids, position, cache)                               # (B, 1, V)
        with torch.inference_mode():
            out.append(time_fn(step, model.device, repeat=repeats))
        del cache
    return out
