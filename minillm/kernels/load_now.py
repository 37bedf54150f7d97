"""How busy the machine is now, not a minute ago: other work's share of the cores over a window.

The 1-minute load average is a poor judge of whether timings can be trusted. It lags by about a
minute, so a build that ended twenty seconds ago still counts as running, and so does this
process's own model loading, or the chapter that ran just before. A machine judged busy that way
falls back to slow routes for no reason. So tuners ask a different question: during the window in
which they time (or a short one just before), how many cores' worth of CPU did *everything else*
use?

`Watch()` reads the machine's CPU counters (busy time of each core this process may run on,
the hypervisor's steal included) and this process's own CPU time; `.read()` gives a `LoadNow` for
the window since it started:

    others = (busy time of the cores - this process's CPU time - excluded processes' CPU time)
             / seconds elapsed

A process that finished before the window began adds nothing; this process's own threads never
count; nor do the processes named in `exclude` (a background tuner of minillm's own, which stops
the moment anything else runs). Steal time, a neighbour on the same host taking our cores, counts
as other work. `load_now(window_s)` is a Watch over a short sleep.

Two verdicts, one for each kind of timing:
- `busy(own_threads)`: others + own_threads > cores + slack. Timing threads that cannot each
  have a core measure the other work as much as the kernels. Foreground tuning refuses then.
- `quiet()`: others <= slack. Work that must never slow anybody down (the background tuner) runs
  only then.
The slack, `slack(cores)`, is a tenth of the cores and at least a quarter of one: an editor, a
browser tab or the OS housekeeping are not "other work".

The counters come from psutil (Linux /proc/stat, macOS and Windows' own calls); they tick in
hundredths of a second, so a window shorter than about 0.1 s says little, and `Watch.read`
returns others = 0 with `window_s` beside it for the caller to judge. Timing rounds that agree with
each other (`route_timing.settled`) stay the second check: a noisy neighbour that slips between
two counter reads still shows in the spread of the rounds.

Left out on purpose: cgroup CPU quotas (a container capped below its visible cores looks
quieter than it is), and reading the run queue, which counts this process's own waiting threads.
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
