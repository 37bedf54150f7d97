"""Tuning the CPU matmul routes of `cpu_kernels` on the machine that runs them.

`tune(model)` times every candidate route for each weight shape of the model and each row bucket,
on the model's own weights (all layers of that shape in turn, so the working set is a real
step's share, not one warm weight), and caches the timings as JSON under
`$MINILLM_CACHE/kernels/` (default ~/.cache/minillm/kernels/), one file per
(CPU model, instruction set the kernels may use, torch version, thread count). `decide(times)`
turns timings into a plan, a pure function: the same file gives the same routes on every run.
`accelerate(model)` applies a plan.

A corrupt or foreign cache file is ignored and re-tuned; a folder that cannot be written keeps
the table in memory for this process. Every candidate is checked against float64 before it is
timed, so a route that is missing or wrong on this platform is dropped, never chosen.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from minillm.kernels.cpu_kernels import (BUCKETS, LAYOUT_OF, PREPACK_OK, TABLE_VERSION, RoutedLinear,
                          check_route, cpu_name, kernel_isa, matmul, pack, probe_rows, relayout)

CANDIDATES = ("F.linear", "nsplit", "x@W", "ksplit", "onednn", "onednn_io", "prepacked")
_MEMORY: dict = {}                       # cache file -> saved data, when the folder is not writable


def cache_key() -> dict:
    return {"cpu": cpu_name(), "isa": kernel_isa(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "version": TABLE_VERSION, "buckets": list(BUCKETS), "candidates": list(CANDIDATES)}


def tuning_file(prefix: str, key: dict, cache_dir=None) -> Path:
    """The cache file of one tuning result: `<prefix>_<hash of key>.json` under `cache_dir`, by
    default `$MINILLM_CACHE/kernels/` (~/.cache/minillm/kernels/). Shared by every tuner."""
    base = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm")) / "kernels"
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return base / f"{prefix}_{digest}.json"


def read_tuned(path: Path, key: dict) -> dict | None:
    """The saved result at `path` if it was tuned under `key` (this process's copy first, when
    the folder was not writable); None when missing, corrupt or foreign: tune again."""
    if path in _MEMORY:
        return _MEMORY[path]
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and data.get("key") == key else None
    except (OSError, ValueError):
        return None


def write_tuned(path: Path, key: dict, body: dict) -> None:
    """Save {"key": key, **body} atomically; a folder that cannot be written keeps it in memory."""
    data = {"key": key, **body}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        _MEMORY.pop(path, None)
    except OSError:
        _MEMORY[path] = data             # not writable: keep it for this process


def cache_path(cache_dir=None) -> Path:
    return tuning_file("linear", cache_key(), cache_dir)


def _read(path: Path) -> dict:
    data = read_tuned(path, cache_key())
    return data["shapes"] if data is not None and isinstance(data.get("shapes"), dict) else {}


def _write(path: Path, shapes: dict) -> None:
    write_tuned(path, cache_key(), {"shapes": shapes})


def linears(model: nn.Module) -> dict:
    """Eligible projections grouped by weight: "OxIxN" (N weights of shape (O, I)) -> modules."""
    groups: dict = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == torch.float32 \
                and m.weight.device.type == "cpu":
            groups.setdefault(tuple(m.weight.shape), []).append(m)
    return {f"{o}x{i}x{len(ms)}": ms for (o, i), ms in groups.items()}


def _works(route, w, splits, packed) -> bool:
    """The route gives x @ W^T on this platform (float64 reference, 3 rows)."""
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device)
    try:
        y = matmul(x, w, route, splits, packed).double()
    except RuntimeError:
        return False
    ref = x.double() @ w.double().t()
    return y.shape == ref.shape and bool(torch.allclose(y, ref, rtol=1e-4, atol=1e-4))


def settled(samples: list, tol: float = 0.1) -> bool:
    """The two fastest samples agree within `tol`: their minimum is a time the machine can
    repeat, not one lucky or one disturbed run (other work on a machine only ever adds time)."""
    if len(samples) < 2:
        return False
    a, b = sorted(samples)[:2]
    return b <= a * (1 + tol)


SUBSET_ROWS = 16      # from this many rows a product is compute-bound: time a quarter of a group
PRUNE = 1.5           # after the first rounds, a route this much slower than the best stops


@torch.inference_mode()
def time_rows(weights: list, rows, rounds: int = 3, candidates=CANDIDATES,
              max_rounds: int | None = None, tol: float = 0.1) -> dict:
    """{route: {R: ms}}: one pass over `weights` (each (O, I), laid out as the route wants) with
    R rows, the fastest of at least `rounds` interleaved rounds. On a busy machine the rounds go
    on (up to `max_rounds`, default 3x `rounds`) until every case still in the race has
    `settled`: a table tuned while other work ran would otherwise be kept for good. Routes that
    fail or give a wrong product on this platform are left out.

    Two shortcuts keep a first tuning of a 135M model to about a minute on a 2-core machine.
    After the first `rounds`, a route more than PRUNE times slower than the best single-copy
    route at that row count leaves the race (its fastest time so far is kept: it cannot win).
    "prepacked" is never the yardstick and always races: it needs a copy, so by default it is not
    chosen, and a copy much faster than every route must not end the race among the others.
    From SUBSET_ROWS rows on, the product is bound by arithmetic, not by reading the weights, so a
    quarter of the group is timed and the time scaled to the whole group; fewer rows always
    stream every weight of the group. On a CPU with a large last-level cache the smaller groups
    fit in it (30 weights of 576x576 are 40 MB; a 2-core Xeon slice reports a 105 MiB L3). On
    that Xeon, reading 256 MB before every sample to empty the cache moved SmolLM2's 1- and 2-row
    times by under 10%, reordered only routes within that of each other and did not change
    which layout wins, so the samples are not preceded by such a read."""
    splits = torch.get_num_threads()
    max_rounds = max(rounds, 3 * rounds if max_rounds is None else max_rounds)
    layouts = {"out_in": [w.contiguous() for w in weights],
               "in_out": [w.t().contiguous().t() for w in weights]}
    packs = [None] * len(weights)
    if "prepacked" in candidates and PREPACK_OK and not weights[0].is_cuda:
        try:
            packs = [pack(w) for w in weights]
        except RuntimeError:
            pass
    runnable = []
    for route in candidates:
        ws = layouts.get(LAYOUT_OF[route], layouts["out_in"])
        if (route in ("ksplit", "nsplit") and splits < 2) or (route == "prepacked" and packs[0] is None):
            continue
        if _works(route, ws[0], splits, packs[0]):
            runnable.append((route, ws))
    n = len(weights)
    part = {r: (n if r < SUBSET_ROWS else max(1, -(-n // 4))) for r in rows}   # weights timed
    samples = {(route, r): [] for route, _ in runnable for r in rows}
    racing = set(samples)
    xs = {r: torch.randn(r, weights[0].shape[1], device=weights[0].device) for r in rows}
    sync = torch.cuda.synchronize if weights[0].is_cuda else (lambda: None)
    single = [route for route, _ in runnable if route != "prepacked"]
    for done in range(1, max_rounds + 1):
        for r in rows:
            for route, ws in runnable:
                if (route, r) not in racing:
                    continue
                sync()
                t0 = time.perf_counter()
                for w, p in zip(ws[:part[r]], packs[:part[r]]):
                    matmul(xs[r], w, route, splits, p)
                sync()
                samples[(route, r)].append(1e3 * (time.perf_counter() - t0) * n / part[r])
        if done == rounds and single:                # the clear losers leave the race
            for r in rows:
                best = min(min(samples[(route, r)]) for route in single)
                racing -= {(route, r) for route in single if min(samples[(route, r)]) > PRUNE * best}
        if done >= rounds and all(settled(samples[c], tol) for c in racing):
            break
    return {route: {r: min(samples[(route, r)]) for r in rows} for route, _ in runnable}


def time_shape(weights: list, buckets=BUCKETS, rounds: int = 3, candidates=CANDIDATES) -> dict:
    """{route: {bucket: ms}} for a tuning table: each bucket timed at both its ends, summed."""
    times = time_rows(weights, sorted({r for b in buckets for r in probe_rows(b)}), rounds,
                      candidates)
    return {route: {str(b): round(sum(t[r] for r in probe_rows(b)), 4) for b in buckets}
            for route, t in times.items()}


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


def tune(model: nn.Module, cache_dir=None, retune: bool = False, rounds: int = 3) -> dict:
    """Timings for every weight group of `model` on this machine: from the cache, else measured
    now (about a minute for a 135M model on a 2-core machine) and saved."""
    path = cache_path(cache_dir)
    table = {} if retune else dict(_read(path))
    missing = {k: ms for k, ms in linears(model).items() if k not in table}
    for key, mods in missing.items():
        table[key] = time_shape([m.weight.detach() for m in mods], rounds=rounds)
    if missing:
        _write(path, table)
    return {k: table[k] for k in linears(model)}


def accelerate(model: nn.Module, route: str = "auto", allow_copies: bool = False,
               cache_dir=None, retune: bool = False) -> nn.Module:
    """Turn every fp32 CPU `nn.Linear` of `model` into a `RoutedLinear` and a minillm
    `Transformer` into a `FlatTransformer` (in place; returns the model). route="auto" follows
    this machine's tuned table; any other route pins that one."""
    check_route(route)
    groups = linears(model)
    if not groups:
        return model                                           # GPU, other dtype: F.linear
    times = tune(model, cache_dir, retune) if route == "auto" else {}
    plan = {}
    for key, mods in groups.items():
        if route == "auto":
            p = decide(times[key], allow_copies)
        else:
            p = {"layout": LAYOUT_OF.get(route, "out_in"), "routes": {b: route for b in BUCKETS}}
        plan[key] = p
        for m in mods:
            if "prepacked" not in p["routes"].values():
                m.__dict__.pop("_packed_copy", None)            # free a copy no route needs
            relayout(m.weight, "in_out" if p["layout"] == "in_out" else "out_in")
            m.__class__ = RoutedLinear
            m.routes, m.splits = dict(p["routes"]), torch.get_num_threads()
    model.linear_plan = plan
    from minillm.kernels.flat_forward import flatten
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
    from minillm.kernels.flat_forward import unflatten
    return unflatten(model)


def kernel_report(model: nn.Module) -> dict:
    """The plan `accelerate` applied, per weight group, with the extra bytes of packed copies."""
    plan = getattr(model, "linear_plan", {})
    extra = sum(m.extra_bytes() for m in model.modules() if isinstance(m, RoutedLinear))
    return {"key": cache_key(), "plan": {k: {"layout": p["layout"],
                                             "routes": {str(b): r for b, r in p["routes"].items()}}
                                         for k, p in plan.items()},
            "extra_bytes": extra}


def format_plan(report: dict) -> str:
    """`kernel_report` as a table: one row per weight group, one column per row bucket."""
    key = report["key"]
    lines = [f"{key['cpu']}, torch {key['torch']}, {key['threads']} thread(s); "
             f"extra bytes {report['extra_bytes']}",
             f"{'weights (out x in x count)':>27} layout  rows<=" + "".join(f"{b:>10}" for b in BUCKETS)]
    for group, p in report["plan"].items():
        lines.append(f"{group:>27} {p['layout']:7s}       " + "".join(f"{r:>10}" for r in p["routes"].values()))
    return "\n".join(lines)


def main(argv=None) -> None:
    """`python -m minillm.kernels.cpu_tuning [--retune] [--threads N] [--allow-copies]`: this machine's
    route table for the real model (timed now if the cache has none)."""
    import argparse
    from minillm.model.loading import load_model
    p = argparse.ArgumentParser(prog="python -m minillm.kernels.cpu_tuning")
    p.add_argument("--retune", action="store_true", help="time again and overwrite the cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--allow-copies", action="store_true", help="let prepacked copies win")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model, _ = load_model(device="cpu", kernels="plain")
    accelerate(model, allow_copies=args.allow_copies, retune=args.retune)
    print(format_plan(kernel_report(model)))
    print(f"cache: {cache_path()}")


if __name__ == "__main__":
    main()
