"""Tuning the CPU matmul routes of `cpu_kernels` on the machine that runs them, and applying them.

`tune(model)` times every candidate route per weight shape and row bucket on the model's own
weights and caches the timings (tuning_cache.py) per CPU, instruction set, torch version and thread
count; it takes minutes, so it runs only when asked (`python -m minillm.kernels`,
`accelerate(model, tune=True)`, chapter 1). `decide(times)` is a pure function from timings to a
plan. `accelerate(model)` applies one in place (the front door calls it on a CPU): the cached
table when a quiet one exists, else a quick probe of a few seconds, or on a busy machine the
committed priors (route_priors.py); `plain(model)` undoes it. Busy means other work now
(load_now.py); a tuning timed under load is saved marked "busy" and never used. A bad cache file
is ignored with one line. Every candidate is checked against float64 first and all compute
x @ W^T, so a wrong table costs speed, never correctness.

Left out on purpose: switching a running process to a newer table, timing under a server's load.
"""
import json
import math
import time

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from minillm.kernels.cpu_kernels import (BUCKETS, LAYOUT_OF, TABLE_VERSION, RoutedLinear, check_route,
                                         cpu_name, kernel_isa, relayout)
from minillm.kernels.flat_forward import flatten, unflatten
from minillm.kernels.load_now import Watch, load_now
from minillm.kernels.route_priors import prior_plan
# settled, time_rows, CANDIDATES: also importable from here
from minillm.kernels.route_timing import (CANDIDATES, _time_shape, race, settled, time_rows,  # noqa: F401
                                          time_shape)
# the cache helpers: also importable from here
from minillm.kernels.tuning_cache import (_MEMORY, notice, read_tuned, read_tuned_why,  # noqa: F401
                                          running_tuners, tuning_file, write_tuned)

QUICK_CANDIDATES = ("F.linear", "nsplit", "x@W", "ksplit", "onednn", "onednn_io")   # no copies
UNSETTLED_OK = 0.25     # a tuning with more of its winning times unsettled than this is noise
QUICK_BUDGET_S = 5.0    # a first start's probe stops timing new weight shapes after this long
TUNE_HINT = "`python -m minillm.kernels` times every route here (minutes) and later runs use its table"
_QUICK: dict = {}       # (cache key, weight groups) -> (plan, what it did): one probe per process


def cache_key() -> dict:
    return {"cpu": cpu_name(), "isa": kernel_isa(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "version": TABLE_VERSION, "buckets": list(BUCKETS),
            "candidates": list(CANDIDATES)}


def cache_path(cache_dir=None):
    return tuning_file("linear", cache_key(), cache_dir)


def linears(model: nn.Module) -> dict:
    """Eligible projections grouped by weight: "OxIxN" (N weights of shape (O, I)) -> modules."""
    groups: dict = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == torch.float32 \
                and m.weight.device.type == "cpu":
            groups.setdefault(tuple(m.weight.shape), []).append(m)
    return {f"{o}x{i}x{len(ms)}": ms for (o, i), ms in groups.items()}


def decide(times: dict, allow_copies: bool = False, margin: float = 0.9) -> dict:
    """A plan from timings: one layout per shape (the one whose best route is closest to the
    best overall, summed over buckets), then the fastest route on it per bucket; "prepacked" only
    with `allow_copies` and only where it beats that by `margin`."""
    single = {r: t for r, t in times.items() if r != "prepacked"}
    if not single:
        return {"layout": "out_in", "routes": {}}
    buckets = sorted({int(b) for t in single.values() for b in t})
    best = {b: min(t[str(b)] for t in single.values()) for b in buckets}

    def score(layout):
        rs = [t for r, t in single.items() if LAYOUT_OF[r] == layout]
        return sum(min(t[str(b)] for t in rs) / best[b] for b in buckets) if rs else float("inf")

    layout = min(("out_in", "in_out"), key=score)             # ties keep nn.Linear's own layout
    routes = {}
    for b in buckets:
        on = {r: t[str(b)] for r, t in single.items() if LAYOUT_OF[r] == layout}
        route = min(on, key=on.get)
        if allow_copies and "prepacked" in times and times["prepacked"][str(b)] < margin * on[route]:
            route = "prepacked"
        routes[b] = route
    return {"layout": layout, "routes": routes}


def _shapes(data: dict) -> dict | None:
    """The timings of a saved table, or None when they are not what `tune` writes (a file edited
    or cut short): {weights: {route: {bucket: ms > 0}}} over every bucket, routes we know."""
    shapes = data.get("shapes")
    if not isinstance(shapes, dict):
        return None
    want = {str(b) for b in BUCKETS}
    for times in shapes.values():
        if not isinstance(times, dict) or not times or not set(times) <= set(CANDIDATES) \
                or set(times) == {"prepacked"}:
            return None
        for t in times.values():
            if not isinstance(t, dict) or set(t) != want or not all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in t.values()):
                return None
    return shapes


def tune(model: nn.Module, cache_dir=None, retune: bool = False, rounds: int = 3,
         progress: bool = False) -> dict:
    """Timings for every weight group of `model` on this machine: from the cache file when it
    holds them (a quiet table), else measured now (minutes for a 135M model on a 2-core machine;
    `progress` shows a bar) and saved with the other work measured while it timed. A busy
    machine (other work wanting the cores the timing threads ran on, or over UNSETTLED_OK of the
    winning times unsettled) saves the table marked "busy": `accelerate` does not use it, and
    the next `tune` times it all again."""
    path, key = cache_path(cache_dir), cache_key()
    data = None if retune else read_tuned(path, key)
    table = dict(_shapes(data) or {}) if data is not None and not data.get("busy") else {}
    groups = linears(model)
    missing = {k: ms for k, ms in groups.items() if k not in table}
    if missing:
        watch, bad, total = Watch(exclude=running_tuners(cache_dir)), 0, 0
        for group, mods in tqdm(missing.items(), desc="timing matmul routes", unit="weight shape",
                                disable=not progress):
            table[group], b, n = _time_shape([m.weight.detach() for m in mods], rounds=rounds)
            bad, total = bad + b, total + n
        busy = save_table(path, key, table, watch.read(), bad, total)
        if busy:
            notice(f"the machine was busy while timing ({'; '.join(busy)}): the table is saved "
                   f"marked busy and not used; time again on a quiet machine")
    return {k: table[k] for k in groups}


def save_table(path, key: dict, table: dict, during, bad: int, total: int) -> list[str]:
    """Write a tuning's table with `during` (a `LoadNow` over the timing) beside it, marked busy
    when other work wanted the timing threads' cores or too many winning times never settled;
    returns the reasons it is busy ([] for a quiet table)."""
    threads = torch.get_num_threads()
    busy = []
    if during.busy(threads):
        busy.append(f"{during.describe()}, beside {threads} timing thread(s)")
    if bad > UNSETTLED_OK * total:
        busy.append(f"{bad} of {total} winning times never settled")
    write_tuned(path, key, {"shapes": table, "busy": "; ".join(busy) or None,
                            "load": during.as_record()})
    return busy


def read_table(model: nn.Module, cache_dir=None) -> tuple[dict | None, str]:
    """(timings for every weight group of `model` from a quiet cached table, "") or (None, why
    there is none: no table yet, unreadable, foreign, malformed, timed on a busy machine, or
    missing one of these weight shapes). Never times anything."""
    path = cache_path(cache_dir)
    data, why = read_tuned_why(path, cache_key())
    if data is None:
        return None, why
    if data.get("busy"):
        return None, f"the tuned table was timed on a busy machine ({data['busy']})"
    shapes = _shapes(data)
    if shapes is None:
        return None, f"the table file {path} is malformed, ignored"
    missing = [k for k in linears(model) if k not in shapes]
    if missing:
        return None, f"the tuned table has no timings for weights {', '.join(missing)}"
    return {k: shapes[k] for k in linears(model)}, ""


def _pinned(route: str) -> dict:
    return {"layout": LAYOUT_OF.get(route, "out_in"), "routes": {b: route for b in BUCKETS}}


def _with_prior(best: str, prior: dict) -> dict:
    """A group's plan: `best` at one row; more rows take the prior's routes when the prior lays
    the weight out as `best` does, F.linear otherwise."""
    layout = LAYOUT_OF[best]
    same = prior["layout"] == layout
    return {"layout": layout, "routes": {b: best if b == 1 else prior["routes"][b] if same else "F.linear"
                                         for b in BUCKETS}}


def quick_plan(model: nn.Module, rounds: int = 3, budget_s: float = QUICK_BUDGET_S) -> tuple[dict, str]:
    """({weights: plan}, what was done, in words): the choice for a first start, in seconds.

    First a quarter of a second of watching what other work does (`load_now`). On a busy machine
    (other work wanting the cores the timing threads need) nothing is timed: every group takes
    the untimed prior (`route_priors.prior_plan`: the routes that won most often on this CPU's
    vendor and instruction set in the committed records). Otherwise each group's single-copy
    routes are timed at one row (batch-1 decode, the case a first start meets; `rounds` rounds,
    no more: about two seconds for a 135M model on a quiet 2-core machine): the fastest takes
    bucket 1, and more rows follow the prior where it uses the same layout (F.linear where not).
    A group whose winner never settled, or that the probe did not reach within `budget_s`, takes
    the prior. Made once per process, never saved."""
    groups = linears(model)
    memo = (json.dumps(cache_key(), sort_keys=True), tuple(groups))
    if memo in _QUICK:                                      # this process probed already
        return _QUICK[memo]
    threads = torch.get_num_threads()
    prior, whence = prior_plan(threads)
    now = load_now(exclude=running_tuners())
    if now.busy(threads):
        return ({g: prior for g in groups},
                f"other work keeps the cores busy ({now.describe()}; {threads} thread(s) to time "
                f"with), so nothing was timed: {whence}")
    t0, plan, fallback = time.perf_counter(), {}, 0
    for group, mods in groups.items():
        best = None
        if time.perf_counter() - t0 < budget_s:
            times, unsettled = race([m.weight.detach() for m in mods], [1], rounds,
                                    QUICK_CANDIDATES, max_rounds=rounds)
            best = min(times, key=lambda r: times[r][1])
            best = None if (best, 1) in unsettled else best
        if best is None:
            fallback += 1
        plan[group] = prior if best is None else _with_prior(best, prior)
    chosen = sorted({p["routes"][1] for p in plan.values()})
    more = sorted({r for p in plan.values() for b, r in p["routes"].items() if b > 1})
    what = (f"a {time.perf_counter() - t0:.1f} s probe at 1 row chose {', '.join(chosen)} "
            f"({', '.join(more)} for more rows"
            f"{f'; {fallback} weight shapes unsettled or past the time budget took the prior' if fallback else ''})")
    _QUICK[memo] = plan, what
    return _QUICK[memo]


def _full_tuning(model, cache_dir, retune) -> None:
    tune(model, cache_dir, retune, progress=True)


def accelerate(model: nn.Module, route: str = "auto", allow_copies: bool = False,
               cache_dir=None, retune: bool = False, tune: bool = False) -> nn.Module:
    """Make `model` fast on this CPU, in place (returns it), by two visible switches:
    every fp32 CPU bias-free `nn.Linear` becomes a `RoutedLinear` (class assignment: the same
    weight, state_dict and gradients; its CPU fp32 inference calls follow a route table), and a
    minillm `Transformer` becomes a `FlatTransformer` (flat_forward.py: the same forward as one
    loop, bit for bit). `plain(model)` undoes both; GPUs and other dtypes are left as they are.

    route="auto": this machine's tuned table when a quiet one is cached; otherwise `quick_plan`
    (a few seconds) and one line saying what it chose and how to tune. tune=True first times
    every route missing from the cache (minutes, a progress bar; what `python -m minillm.kernels`
    does); retune=True times them all again. Neither times anything on a machine already busy
    (`LoadNow.busy` with the timing threads): that table would be saved marked busy and never used, so
    one line says so and a quiet table already cached stays. Any other route pins that route
    everywhere."""
    check_route(route)
    groups = linears(model)
    if not groups:
        return model                                           # GPU, other dtype: F.linear
    if route != "auto":
        plan, source = {g: _pinned(route) for g in groups}, f"pinned {route}"
    else:
        if tune or retune:
            now = load_now(exclude=running_tuners(cache_dir))
            if now.busy(torch.get_num_threads()):                # its table would be marked busy
                notice(f"not timing the matmul routes: other work keeps the cores busy ({now.describe()}; "
                       f"{torch.get_num_threads()} thread(s) to time with), so a table timed now would "
                       f"be marked busy and not used; tune again on a quiet machine")
            else:
                _full_tuning(model, cache_dir, retune)
        times, why = read_table(model, cache_dir)
        if times is not None:
            plan, source = {g: decide(times[g], allow_copies) for g in groups}, "tuned"
        else:
            fresh = (json.dumps(cache_key(), sort_keys=True), tuple(groups)) not in _QUICK
            plan, what = quick_plan(model)
            source = f"quick: {why}; {what}"
            if fresh:
                notice(f"CPU matmul routes at {torch.get_num_threads()} thread(s): {why}; {what}. {TUNE_HINT}")
    for group, mods in groups.items():
        p = plan[group]
        for m in mods:
            if "prepacked" not in p["routes"].values():
                m.__dict__.pop("_packed_copy", None)            # free a copy no route needs
            relayout(m.weight, "in_out" if p["layout"] == "in_out" else "out_in")
            m.__class__ = RoutedLinear
            m.routes, m.splits = dict(p["routes"]), torch.get_num_threads()
    model.linear_plan, model.linear_plan_source = plan, source
    return flatten(model)                  # and one flat loop per forward pass (flat_forward.py)


def plain(model: nn.Module) -> nn.Module:
    """Undo `accelerate`: plain nn.Linear, weights contiguous (O, I), packed copies dropped, the
    reference forward."""
    for m in model.modules():
        if isinstance(m, RoutedLinear):
            m.__dict__.pop("_packed_copy", None)
            m.__dict__.pop("routes", None)
            m.__dict__.pop("splits", None)
            relayout(m.weight, "out_in")
            m.__class__ = nn.Linear
    model.__dict__.pop("linear_plan", None)
    model.__dict__.pop("linear_plan_source", None)
    return unflatten(model)


def kernel_report(model: nn.Module) -> dict:
    """The plan `accelerate` applied, per weight group, how it was chosen ("tuned", "quick: ...",
    "pinned ROUTE"), and the extra bytes of packed copies."""
    plan = model.__dict__.get("linear_plan", {})
    extra = sum(m.extra_bytes() for m in model.modules() if isinstance(m, RoutedLinear))
    return {"key": cache_key(), "source": model.__dict__.get("linear_plan_source", "plain"),
            "plan": {k: {"layout": p["layout"], "routes": {str(b): r for b, r in p["routes"].items()}}
                     for k, p in plan.items()},
            "extra_bytes": extra}


def format_plan(report: dict) -> str:
    """`kernel_report` as a table: one row per weight group, one column per row bucket."""
    key = report["key"]
    lines = [f"{key['cpu']}, torch {key['torch']}, {key['threads']} thread(s); "
             f"extra bytes {report['extra_bytes']}",
             f"routes: {report.get('source', 'tuned')}",
             f"{'weights (out x in x count)':>27} layout  rows<=" + "".join(f"{b:>10}" for b in BUCKETS)]
    for group, p in report["plan"].items():
        lines.append(f"{group:>27} {p['layout']:7s}       " + "".join(f"{r:>10}" for r in p["routes"].values()))
    return "\n".join(lines)


if __name__ == "__main__":                # the earlier spelling of `python -m minillm.kernels`
    import runpy
    runpy.run_module("minillm.kernels", run_name="__main__")
