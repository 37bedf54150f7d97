"""Measured collectives (minillm/distributed/collectives.py): the measurement's structure (never its
speed), the alpha-beta fit against a line known exactly, and the fit read back through
parallel_math's ring formulas."""
import multiprocessing

import pytest

from minillm.analysis.parallel_math import allgather_time, allreduce_time
from minillm.distributed.collectives import (KINDS, AlphaBeta, CollectiveTiming, fit_alpha_beta,
                                             measure_collectives)


def test_measure_gives_one_timing_per_kind_and_size_and_leaves_no_process():
    before = {p.pid for p in multiprocessing.active_children()}
    got = measure_collectives(2, sizes=(16, 4096), repeats=2)
    assert {(t.kind, t.nbytes) for t in got} == {(k, n) for k in KINDS for n in (16, 4096)}
    assert all(t.world_size == 2 and t.repeats == 2 for t in got)
    assert all(0 < t.seconds_min <= t.seconds_median for t in got)
    assert {p.pid for p in multiprocessing.active_children()} == before


def _line(kind, n, alpha, beta, sizes=(1000, 10_000, 100_000)):
    return [CollectiveTiming(kind, x, n, alpha + beta * x, alpha + beta * x, 1) for x in sizes]


def test_fit_recovers_a_known_line():
    fits = fit_alpha_beta(_line("all_reduce", 3, 1e-4, 2e-9) + _line("send", 2, 5e-5, 1e-10))
    assert fits["all_reduce"].latency_s == pytest.approx(1e-4)
    assert fits["all_reduce"].seconds_per_byte == pytest.approx(2e-9)
    assert fits["send"].seconds(1e6) == pytest.approx(5e-5 + 1e-4)


@pytest.mark.parametrize("kind, n, formula", [("all_reduce", 3, allreduce_time),
                                              ("all_reduce", 2, allreduce_time),
                                              ("all_gather", 4, allgather_time)])
def test_as_link_reproduces_the_fit_through_the_ring_formula(kind, n, formula):
    fit = AlphaBeta(kind, n, latency_s=1e-4, seconds_per_byte=2e-9)
    for nbytes in (0, 4096, 1 << 20):
        assert formula(nbytes, n, fit.as_link()) == pytest.approx(fit.seconds(nbytes))


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        measure_collectives(1)
    with pytest.raises(ValueError, match="sizes"):
        measure_collectives(2, sizes=(6,))
    with pytest.raises(ValueError, match="repeats"):
        measure_collectives(2, repeats=0)
    with pytest.raises(ValueError, match="two sizes"):
        fit_alpha_beta(_line("send", 2, 1e-5, 1e-9, sizes=(64,)))
