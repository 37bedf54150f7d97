"""Which fast route each quantized projection takes on this machine, timed and cached.

Letters: R rows (tokens) in one call.

int8 has two fast routes (`Int8Linear.ROUTES`): weight-only `_weight_int8pack_mm` and W8A8
(w8a8.py). `choose_routes(model)` times both at R = 1 and 8 on every weight of each shape, in
interleaved rounds, and gives each shape the route with the least t(1) + t(8); int4 has one
route and is not timed. W8A8 is opt-in (`allow_w8a8=True`): 8-bit activations cost SmolLM2 far
more accuracy than 8-bit weights. Timings are cached beside the fp32 route table
(`kernels/tuning_cache.py`, keyed by `cpu_tuning.cache_key` plus this table's version); a table
timed on a busy machine is kept for this process only.

Left out on purpose: timing a whole forward pass, more row counts (a verify step's 9 or 64 rows),
GPU routes.
"""
import json
import time

import torch

from minillm.kernels.cpu_tuning import cache_key as linear_cache_key
from minillm.kernels.load_now import Watch
from minillm.kernels.tuning_cache import read_tuned, running_tuners, tuning_file, write_tuned
from minillm.quant.qbase import _QuantLinear

TABLE_VERSION = 1
ROWS = (1, 8)
_PROCESS: dict = {}       # (cache key, group) -> timings of a busy machine, this process only


def cache_key() -> dict:
    key = {k: v for k, v in linear_cache_key().items() if k not in ("buckets", "candidates")}
    return {**key, "table": "quant_routes", "version": TABLE_VERSION, "rows": list(ROWS)}


def cache_path(cache_dir=None):
    return tuning_file("quant", cache_key(), cache_dir)


def groups(model) -> dict:
    """"int8:NxKxC" (C modules of format int8 with an (N, K) weight) -> the modules, for the
    formats with more than one fast route."""
    out: dict = {}
    for m in model.modules():
        if isinstance(m, _QuantLinear) and len(m.ROUTES) > 1 and m.path != "reference":
            out.setdefault((m.format, m.out_features, m.in_features), []).append(m)
    return {f"{f}:{n}x{k}x{len(ms)}": ms for (f, n, k), ms in out.items()}


@torch.inference_mode()
def time_routes(modules: list, rounds: int = 5) -> dict:
    """{route: {R: ms}} for one pass over `modules` (same format and shape) with R rows, the
    fastest of `rounds` interleaved rounds; routes without a working kernel are left out."""
    device = modules[0].qweight.device
    kernels = {r: [m.kernel_as(r, device) for m in modules] for r in modules[0].ROUTES}
    kernels = {r: ks for r, ks in kernels.items() if all(k is not None for k in ks)}
    gen = torch.Generator().manual_seed(0)
    xs = {R: torch.randn(R, modules[0].in_features, generator=gen).to(device) for R in ROWS}
    best = {r: {R: float("inf") for R in ROWS} for r in kernels}
    for r, ks in kernels.items():                               # warm-up
        for m, k in zip(modules, ks):
            m._fast(xs[1], k)
    for _ in range(rounds):
        for R in ROWS:
            for r, ks in kernels.items():
                t0 = time.perf_counter()
                for m, k in zip(modules, ks):
                    m._fast(xs[R], k)
                best[r][R] = min(best[r][R], 1e3 * (time.perf_counter() - t0))
    return {r: {R: round(t, 4) for R, t in ts.items()} for r, ts in best.items()}


def pick(times: dict, allowed=None) -> str | None:
    """The route (among `allowed`, default all) with the least t(1) + t(8); None when none
    worked."""
    times = {r: t for r, t in times.items() if allowed is None or r in allowed}
    return min(times, key=lambda r: sum(times[r].values())) if times else None


def choose_routes(model, cache_dir=None, retune: bool = False, allow_w8a8: bool = False) -> dict:
    """Give every multi-route quantized projection of `model` this machine's fastest route
    (from the cached table where it has the shape, timed otherwise); returns {group: {"route":
    ..., "times": {route: {R: ms}}, "source": "cache" | "timed" | "default"}}. Without
    `allow_w8a8` int8 takes its weight-only route, untimed (see the module's text)."""
    if not allow_w8a8:
        chosen = {}
        for name, mods in groups(model).items():
            for m in mods:
                if m.route != m.ROUTES[0]:
                    m.set_route(m.ROUTES[0])
            chosen[name] = {"route": mods[0].route, "times": {}, "source": "default"}
        return chosen
    key, path = cache_key(), cache_path(cache_dir)
    data = None if retune else read_tuned(path, key)
    table = dict(data["groups"]) if data and not data.get("busy") else {}
    chosen, new = {}, {}
    watch = Watch(exclude=running_tuners())                  # other work while this times
    for name, mods in groups(model).items():
        memo = (json.dumps(key, sort_keys=True), name)
        times, source = table.get(name) or _PROCESS.get(memo), "cache"
        if times is None or retune:
            times, source = time_routes(mods), "timed"
            new[name] = times
            _PROCESS[memo] = times
        route = pick(times)
        if route is not None:
            for m in mods:
                if m.route != route:
                    m.set_route(route)
        chosen[name] = {"route": route or mods[0].route, "times": times, "source": source}
    if new:
        if not watch.read().busy(torch.get_num_threads()):
            write_tuned(path, key, {"groups": {**table, **new}, "busy": None})
    return chosen
