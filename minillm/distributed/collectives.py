"""Collectives measured on this machine, and the alpha-beta model fitted to them.

`measure_collectives(world_size, sizes, repeats)` starts a `WorkerGroup` and times, on the
driver, all-reduce and all-gather of each payload size (bytes one rank hands the collective,
fp32 elements), and a point-to-point send as half a ping-pong. Before every timed call a
barrier lines the ranks up, so a timing is the collective's own, not one rank waiting for
another to arrive. The median of `repeats` calls is kept.

`fit_alpha_beta` fits t = alpha + beta * nbytes per kind by least squares: alpha is the fixed
cost of a call (for gloo on one machine: Python, the TCP loopback and the scheduler, tens of
microseconds to a millisecond), beta the seconds per byte. `as_link` turns a fit into the `Link`
that `minillm.analysis.parallel_math`'s ring formulas need, so the same formulas that predict
NVLink and Ethernet predict this machine: one all-reduce fit at n ranks gives latency_s =
alpha / (2(n-1)) per ring step and bandwidth = 2(n-1)/n / beta.

Timing decides nothing here: the numbers are printed beside the machine's load, never cached.
Left out on purpose: NCCL's tree and low-latency protocols (one GPU per group here), broadcast
and reduce-scatter timings, overlap with compute.
"""
import statistics
import time
from dataclasses import dataclass

import torch

from minillm._validate import check_int
from minillm.analysis.parallel_math import Link
from minillm.distributed.group import WorkerGroup

KINDS = ("all_reduce", "all_gather", "send")
DEFAULT_SIZES = (2304, 2304 * 16, 1 << 18, 1 << 21)   # one SmolLM2 token's hidden (576 fp32) up


@dataclass(frozen=True)
class CollectiveTiming:
    """Median seconds of one collective kind at one payload size (bytes per rank)."""

    kind: str
    nbytes: int
    world_size: int
    seconds_median: float
    seconds_min: float
    repeats: int


def _one(comm, kind: str, nbytes: int) -> None:
    """Run one collective of `kind` (every rank makes the same call)."""
    t = torch.ones(nbytes // 4)
    if kind == "all_reduce":
        comm.all_reduce(t)
    elif kind == "all_gather":
        comm.all_gather(t)
    elif comm.rank == 0:                                   # ping-pong between ranks 0 and 1
        comm.send(t, 1)
        comm.recv(t, 1)
    elif comm.rank == 1:
        comm.recv(t, 0)
        comm.send(t, 0)


def _schedule(sizes, repeats):
    return [(kind, n) for kind in KINDS for n in sizes for _ in range(repeats)]


def _bench_worker(rank, world_size, comm, sizes, repeats):
    for kind, n in _schedule(sizes, repeats):
        comm.barrier()
        _one(comm, kind, n)
    comm.barrier()


def measure_collectives(world_size: int = 2, sizes=DEFAULT_SIZES, repeats: int = 20,
                        threads: int = 1, timeout_s: float = 120.0) -> list[CollectiveTiming]:
    """Time each kind at each size over `world_size` processes (gloo); returns one
    `CollectiveTiming` per (kind, size). A send's time is half a round trip."""
    check_int("world_size", world_size, low=2)
    check_int("repeats", repeats, low=1)
    sizes = tuple(sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 4 or n % 4
                        for n in sizes):
        raise ValueError(f"sizes must be byte counts, multiples of 4 and >= 4, got {sizes!r}")
    group = WorkerGroup.start(world_size, _bench_worker, args=(sizes, repeats),
                              backend="gloo", timeout_s=timeout_s, threads=threads)
    times: dict = {}
    try:
        for kind, n in _schedule(sizes, repeats):
            group.comm.barrier()
            t0 = time.perf_counter()
            _one(group.comm, kind, n)
            dt = time.perf_counter() - t0
            times.setdefault((kind, n), []).append(dt / 2 if kind == "send" else dt)
        group.comm.barrier()
    finally:
        group.shutdown()
    return [CollectiveTiming(kind, n, world_size, statistics.median(ts), min(ts), len(ts))
            for (kind, n), ts in times.items()]


@dataclass(frozen=True)
class AlphaBeta:
    """t = latency_s + seconds_per_byte * nbytes, fitted for one kind at one world size."""

    kind: str
    world_size: int
    latency_s: float
    seconds_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + self.seconds_per_byte * nbytes

    def as_link(self, name: str = "this machine (gloo)") -> Link:
        """The `Link` whose ring formula reproduces this fit (all_reduce, all_gather or send)."""
        n = self.world_size
        steps, wire = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                       "all_gather": (n - 1, n - 1), "send": (1, 1)}[self.kind]
        bandwidth = wire / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")
        return Link(name, bandwidth, self.latency_s / steps)


def fit_alpha_beta(timings: list[CollectiveTiming]) -> dict[str, AlphaBeta]:
    """Least-squares alpha + beta * nbytes on the medians, per kind, in relative error (alpha
    and beta kept >= 0). Each kind needs timings at two sizes at least; with exactly two the
    line goes through both points."""
    fits = {}
    for kind in sorted({t.kind for t in timings}):
        pts = [(t.nbytes, t.seconds_median, t.world_size) for t in timings if t.kind == kind]
        if len({x for x, _, _ in pts}) < 2:
            raise ValueError(f"timings of {kind!r} need at least two sizes to fit, got {len(pts)}")
        xs = torch.tensor([x for x, _, _ in pts], dtype=torch.float64)
        ys = torch.tensor([y for _, y, _ in pts], dtype=torch.float64)
        # rows divided by t: relative errors, so the small sizes (where alpha lives) count
        # as much as the large ones (where beta does)
        A = torch.stack([torch.ones_like(xs), xs], dim=1) / ys[:, None]   # (K, 2)
        alpha, beta = torch.linalg.lstsq(A, torch.ones_like(ys)[:, None]).solution[:, 0].tolist()
        fits[kind] = AlphaBeta(kind, pts[0][2], max(alpha, 0.0), max(beta, 0.0))
    return fits
