""""Busy" is other work now (minillm/kernels/load_now.py): its arithmetic on counters played back,
and on this machine's real counters the two things it must get right: a process burning CPU
now is counted, and this process's own work (or an excluded process's) is not. The real checks
bound only what other work can add to, so a loaded test machine cannot make them fail."""
import subprocess
import sys
import time

import pytest
import torch

from fake_load import fake_load
from minillm.kernels import load_now as ln


def test_slack_and_the_two_verdicts():
    assert ln.slack(2) == 0.25 and ln.slack(16) == 1.6
    two = lambda others: ln.LoadNow(others, 0.0, 1.0, 2, 1.0)   # noqa: E731
    assert not two(1.2).busy(1) and two(1.3).busy(1)          # one timing thread beside 1.3 cores
    assert not two(0.2).busy(2) and two(0.3).busy(2)
    assert two(0.25).quiet() and not two(0.3).quiet()
    assert "other work used 1.30 of 2 cores" in two(1.3).describe()
    assert "stolen by the host" in ln.LoadNow(1.0, 0.5, 0.0, 2, 1.0).describe()


def test_a_watch_counts_other_work_and_leaves_out_its_own(monkeypatch):
    state = fake_load(monkeypatch, others=0.7, cores=4, own=2.0, steal=0.2)
    w = ln.Watch()
    now = w.read()
    assert now.others == pytest.approx(0.7) and now.own == pytest.approx(2.0)
    assert now.steal == pytest.approx(0.2) and now.cores == 4
    state["others"] = 0.0                                     # the other work ended
    w.restart()
    assert w.read().others == 0.0 and ln.load_now(0.25).quiet()


def _burner(seconds: float):
    code = f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_process_burning_now_is_other_work_unless_excluded():
    child = _burner(3.0)
    try:
        time.sleep(0.3)                                       # started
        counted, excluded = ln.Watch(), ln.Watch(exclude=[child.pid])
        time.sleep(1.0)
        a, b = counted.read(), excluded.read()
    finally:
        child.kill()
        child.wait()
    assert a.window_s >= 0.9
    assert a.others - b.others >= 0.1     # the child's share of a core, seen in one and not the other


def test_this_process_own_work_is_never_other_work(one_thread):
    w = ln.Watch()
    x = torch.randn(256, 256)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        x = torch.tanh(x @ x)
    now = w.read()
    assert now.own >= 0.1                              # this process's CPU time, measured as its own
    assert now.others <= now.cores - now.own + 0.05    # and not also counted as other work


def test_a_window_too_short_to_measure_says_nothing():
    now = ln.Watch().read()
    assert now.window_s < ln.MIN_WINDOW_S and now.others == 0.0


@pytest.mark.parametrize("bad", [-1.0, 0.0])
def test_load_now_waits_at_least_the_shortest_window(monkeypatch, bad):
    slept = []
    monkeypatch.setattr(ln, "_sleep", slept.append)
    ln.load_now(bad)
    assert slept == [ln.MIN_WINDOW_S]
