"""Timing the CPU matmul routes of `cpu_kernels` on a group of the model's own weights.

Letters: R rows (tokens) in one call; a "case" is one (route, R).

`race(weights, rows)` times every candidate route with R rows over all the weights of one shape
(each pass reads them all, as a real step does), in interleaved rounds until each case's two
fastest samples agree (`settled`), and says which cases never did: the tuner (`cpu_tuning.py`)
counts those as noise. `time_shape` sums a row bucket's two ends into a tuning table's entry.

Left out on purpose: timing a whole forward pass (benchmarks/decode.py does), GPUs' own routes.
"""
import time

import torch

from minillm.kernels.cpu_kernels import BUCKETS, LAYOUT_OF, PREPACK_OK, matmul, pack, probe_rows

CANDIDATES = ("F.linear", "nsplit", "x@W", "ksplit", "onednn", "onednn_io", "prepacked")


class Interrupted(Exception):
    """`race`'s `interrupt` said stop: other work began, and what was timed so far is dropped."""


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


def time_rows(weights: list, rows, rounds: int = 3, candidates=CANDIDATES,
              max_rounds: int | None = None, tol: float = 0.1) -> dict:
    """{route: {R: ms}}: `race`'s timings without its list of unsettled cases."""
    return race(weights, rows, rounds, candidates, max_rounds, tol)[0]


@torch.inference_mode()
def race(weights: list, rows, rounds: int = 3, candidates=CANDIDATES,
         max_rounds: int | None = None, tol: float = 0.1, interrupt=None) -> tuple[dict, set]:
    """({route: {R: ms}}, {(route, R) still racing whose samples never settled}): one pass over `weights` (each (O, I), laid out as the route wants) with
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
    which layout wins, so the samples are not preceded by such a read.

    `interrupt`, when given, is called before every sample; when it returns True the race stops
    and raises `Interrupted` (the background tuner's way of giving the cores back at once)."""
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
                if interrupt is not None and interrupt():
                    raise Interrupted
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
    times = {route: {r: min(samples[(route, r)]) for r in rows} for route, _ in runnable}
    return times, {c for c in racing if not settled(samples[c], tol)}


def time_shape(weights: list, buckets=BUCKETS, rounds: int = 3, candidates=CANDIDATES) -> dict:
    """{route: {bucket: ms}} for a tuning table: each bucket timed at both its ends, summed."""
    return _time_shape(weights, buckets, rounds, candidates)[0]


def _time_shape(weights, buckets=BUCKETS, rounds=3, candidates=CANDIDATES,
                interrupt=None) -> tuple[dict, int, int]:
    """(time_shape's table, row counts whose fastest single-copy time never settled, row counts)."""
    rows = sorted({r for b in buckets for r in probe_rows(b)})
    times, unsettled = race(weights, rows, rounds, candidates, interrupt=interrupt)
    single = [route for route in times if route != "prepacked"] or list(times)
    bad = sum((min(single, key=lambda route: times[route][r]), r) in unsettled for r in rows)
    table = {route: {str(b): round(sum(t[r] for r in probe_rows(b)), 4) for b in buckets}
             for route, t in times.items()}
    return table, bad, len(rows)
