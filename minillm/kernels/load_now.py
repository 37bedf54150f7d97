"""How busy the machine is now, not a minute ago: other work's share of the cores over a window.

The 1-minute load average lags (a build that ended twenty seconds ago, or this process's own
loading, still counts), so tuners ask instead how many cores' worth of CPU everything else used
while they timed. `Watch()` reads the per-core busy counters (steal included) and this process's
CPU time; `.read()` gives a `LoadNow` for the window since it started:

    others = (busy time of the cores - own CPU time - excluded processes' CPU time) / seconds

`load_now(window_s)` is a Watch over a short sleep. Two verdicts: `busy(own_threads)` (others +
own threads > cores + slack: foreground tuning refuses) and `quiet()` (others <= slack: only then
does the background tuner run). `slack(cores)` is a tenth of the cores, at least a quarter of one.
Counters come from psutil and tick in hundredths of a second, so very short windows say little.

Left out on purpose: cgroup CPU quotas, and the run queue (it counts this process's own threads).
"""
import os
import time
from dataclasses import dataclass

import psutil

# psutil's fields already counted in user/nice (Linux), and those that are not busy time
_NOT_BUSY = ("idle", "iowait", "guest", "guest_nice")


def cores() -> list[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(psutil.cpu_count() or 1))


def slack(n_cores: int) -> float:
    """Other work that does not make a machine busy: a tenth of the cores, at least a quarter
    of one."""
    return max(0.25, n_cores / 10)


def _proc_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process (this one when pid is None); 0.0 once it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return 0.0
    return t.user + t.system


def counters(exclude=()) -> tuple[float, float, float, float, float]:
    """(busy seconds of this process's cores, their steal seconds, this process's CPU seconds,
    the excluded processes' CPU seconds, a monotonic clock): one reading of what `Watch` diffs."""
    per = psutil.cpu_times(percpu=True)
    mine = [per[i] for i in cores() if i < len(per)] or per
    busy = sum(sum(v for k, v in t._asdict().items() if k not in _NOT_BUSY) for t in mine)
    steal = sum(getattr(t, "steal", 0.0) for t in mine)
    return (busy, steal, _proc_seconds(None), sum(_proc_seconds(p) for p in exclude),
            time.monotonic())


@dataclass(frozen=True)
class LoadNow:
    """Other work during one window, in cores' worth (1.0 = one core busy all the time)."""
    others: float        # everything but this process (and the excluded ones), steal included
    steal: float         # of which the hypervisor took
    own: float           # this process's own use, for the record
    cores: int           # the cores this process may run on
    window_s: float

    def busy(self, own_threads: int = 0) -> bool:
        """Other work plus `own_threads` timing threads want more than the cores (with slack)."""
        return self.others + own_threads > self.cores + slack(self.cores)

    def quiet(self) -> bool:
        """Nothing but housekeeping ran beside this process."""
        return self.others <= slack(self.cores)

    def describe(self) -> str:
        steal = f", {self.steal:.2f} of it stolen by the host" if self.steal >= 0.05 else ""
        return (f"other work used {self.others:.2f} of {self.cores} cores over the last "
                f"{self.window_s:.1f} s{steal}")

    def as_record(self) -> dict:
        return {"others": round(self.others, 2), "steal": round(self.steal, 2),
                "own": round(self.own, 2), "cores": self.cores, "window_s": round(self.window_s, 2)}


MIN_WINDOW_S = 0.1        # below this the counters' ticks (0.01 s) say little
_sleep = time.sleep       # tests replace it (and `counters`) to play a machine's counters back


class Watch:
    """Reads the counters now; `.read()` says what other work did since then (or since the last
    `.restart()`). `exclude`: pids whose CPU time is not "other work" (see the module text)."""

    def __init__(self, exclude=()):
        self.exclude = tuple(exclude)
        self.restart()

    def restart(self) -> None:
        self._start = counters(self.exclude)

    def elapsed(self) -> float:
        return time.monotonic() - self._start[4]

    def read(self) -> LoadNow:
        busy0, steal0, own0, ex0, t0 = self._start
        busy1, steal1, own1, ex1, t1 = counters(self.exclude)
        dt = t1 - t0
        n = len(cores())
        if dt < MIN_WINDOW_S:
            return LoadNow(0.0, 0.0, 0.0, n, dt)
        own = max(0.0, own1 - own0)
        others = max(0.0, (busy1 - busy0) - own - max(0.0, ex1 - ex0)) / dt
        return LoadNow(min(others, float(n)), max(0.0, steal1 - steal0) / dt, own / dt, n, dt)


def load_now(window_s: float = 0.25, exclude=()) -> LoadNow:
    """Other work over the next `window_s` seconds (this process sleeps meanwhile)."""
    w = Watch(exclude)
    _sleep(max(window_s, MIN_WINDOW_S))
    return w.read()
