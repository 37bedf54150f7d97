"""Tuning in the background: the first quiet moment times every route and saves the table.

A first start takes the quick probe (`cpu_tuning.quick_plan`, seconds); the full table (every
route at every row bucket) makes prefill, batches and verify steps fast too. The front door
(`minillm.load_model`, and so `LLM`, `python -m minillm serve`) starts one background process,

    python -m minillm.kernels --background --model NAME --threads N

which holds a lock file beside the table (`tuning_cache.tuner_lock`), runs at nice 19, waits for
a quiet moment (`LoadNow.quiet`), times one weight shape at a time through
`race(..., interrupt=...)` (stopping soon after other work starts, retrying later), then saves
the table and exits, or gives up after `deadline_s` saving nothing.
`start_background_tuning(name, threads)` starts it unless a tuner runs for that table or
MINILLM_BACKGROUND_TUNING=0 (the test suite sets it). Events go to `kernels/background.log`.

Left out on purpose: tuning a model passed in as an object (the child loads the same weights by
name), and switching a running process to the new table (later processes use it).
"""
import os
import random
import subprocess
import sys
import time

import torch

from minillm.kernels.cpu_tuning import UNSETTLED_OK, cache_key, cache_path, linears, read_table, save_table
from minillm.kernels.load_now import LoadNow, Watch, load_now
from minillm.kernels.route_timing import Interrupted, _time_shape
from minillm.kernels.tuning_cache import _alive, tuner_lock
from minillm.model import loading

ENV = "MINILLM_BACKGROUND_TUNING"      # "0" switches the background tuner off
DEADLINE_S = 1200.0                    # a tuner that found no quiet moment by then gives up
QUIET_S = 1.0                          # how long the machine must be quiet before each shape
CHECK_S = 0.1                          # how often a running shape looks for other work
TRIES = 5                              # unsettled timings of one shape before the tuner gives up


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def running_pid(cache_dir=None) -> int | None:
    """The pid of the tuner that holds this table's lock, if it is alive."""
    try:
        pid = int(tuner_lock(cache_key(), cache_dir).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _alive(pid) else None


def start_background_tuning(name_or_path, threads: int | None = None, cache_dir=None) -> tuple[int | None, str]:
    """(pid, what happened in words): start the background tuner for the model `name_or_path`
    at `threads` torch threads (default: this process's), or say why not."""
    if not enabled():
        return None, f"background tuning is off ({ENV}=0)"
    threads = torch.get_num_threads() if threads is None else threads
    pid = running_pid(cache_dir)
    if pid is not None:
        return pid, f"a background tuner (pid {pid}) already times every route at the first quiet moment"
    log = cache_path(cache_dir).parent / "background.log"
    cmd = [sys.executable, "-m", "minillm.kernels", "--background", "--model", str(name_or_path),
           "--threads", str(threads)] + (["--cache-dir", str(cache_dir)] if cache_dir is not None else [])
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    except OSError as err:
        return None, f"could not start a background tuner ({err})"
    return child.pid, (f"a background tuner (pid {child.pid}) times every route at the first quiet "
                       f"moment and saves the table for later runs (log: {log})")


def _say(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {line}", flush=True)


def _take(lock) -> bool:
    """Create the lock file with this pid; a lock whose process is gone is taken over."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pid = None
            if pid is not None and _alive(pid):
                return False
            lock.unlink(missing_ok=True)                      # a stale lock
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return True
    return False


def _wait_quiet(deadline: float, quiet_s: float = QUIET_S) -> bool:
    """Wait until a window of about `quiet_s` was quiet (its length varies a little, so two
    tuners of different tables that interrupted each other do not start again together)."""
    while time.monotonic() < deadline:
        if load_now(quiet_s * random.uniform(1.0, 1.5)).quiet():
            return True
    return False


class _Lookout:
    """`race`'s interrupt: every CHECK_S, whether anything but this process ran meanwhile."""

    def __init__(self):
        self.watch, self.seen = Watch(), []

    def __call__(self) -> bool:
        if self.watch.elapsed() < CHECK_S:
            return False
        now = self.watch.read()
        self.watch.restart()
        self.seen.append(now)
        return not now.quiet()


def _during(lookouts: list) -> LoadNow:
    """Other work over every shape's timing, as one window."""
    seen = [n for lk in lookouts for n in lk.seen] or [load_now(0.1)]
    total = sum(n.window_s for n in seen)
    avg = lambda f: sum(getattr(n, f) * n.window_s for n in seen) / total   # noqa: E731
    return LoadNow(avg("others"), avg("steal"), avg("own"), seen[0].cores, total)


def run_background(name_or_path, threads: int, cache_dir=None, deadline_s: float = DEADLINE_S) -> str:
    """The child's work (see the module text); returns how it ended, in words."""
    torch.set_num_threads(threads)
    lock = tuner_lock(cache_key(), cache_dir)
    if not _take(lock):
        return "another background tuner holds this table's lock"
    try:
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass
        deadline = time.monotonic() + deadline_s
        if not _wait_quiet(deadline):
            return f"no quiet moment within {deadline_s:.0f} s: nothing saved"
        model, _ = loading.load_model(name_or_path, device="cpu")
        if read_table(model, cache_dir)[0] is not None:
            return "a quiet table already exists"
        table, lookouts, bad, total = {}, [], 0, 0
        for group, mods in linears(model).items():
            unsettled = 0                      # other work interrupting is bounded by the deadline
            while group not in table:
                if not _wait_quiet(deadline):
                    return f"no quiet moment within {deadline_s:.0f} s: nothing saved"
                look = _Lookout()
                try:
                    times, b, n = _time_shape([m.weight.detach() for m in mods], interrupt=look)
                except Interrupted:
                    _say(f"{group}: other work started, timing again later")
                    continue
                if b > UNSETTLED_OK * n:
                    unsettled += 1
                    _say(f"{group}: {b} of {n} winning times never settled")
                    if unsettled == TRIES:
                        return f"{group} never settled in {TRIES} tries: nothing saved"
                    continue
                table[group], bad, total = times, bad + b, total + n
                lookouts.append(look)
                _say(f"{group}: timed")
        busy = save_table(cache_path(cache_dir), cache_key(), table, _during(lookouts), bad, total)
        return "saved a table marked busy: " + "; ".join(busy) if busy else \
            f"saved the tuned table to {cache_path(cache_dir)}"
    finally:
        try:
            if lock.read_text().split()[0] == str(os.getpid()):
                lock.unlink()
        except (OSError, IndexError):
            pass
