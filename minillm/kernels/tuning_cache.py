"""Where a tuner keeps what it measured, how busy the machine was, and how it tells the user.

Every tuner saves one JSON file per key under `$MINILLM_CACHE/kernels/` (~/.cache/minillm/...),
the key being what the timing depends on (CPU model, instruction set, torch version, threads).
`read_tuned` returns a file only if written under the same key; a missing, corrupt or foreign
file reads as None (with the reason), never an error. `write_tuned` writes atomically; an
unwritable folder keeps the result for this process and says so once. Tuners record how busy
the machine was (`load_now.py`) and distrust tables timed while busy. A background tuner holds a
lock file (`tuner_lock`); `running_tuners` lists them. `notice(line)` logs one line on the
"minillm.kernels" logger at INFO, and prints it to stderr when stderr is a terminal and no
handler would show it.

Left out on purpose: locking between processes (writes are atomic, the last one wins), expiry
by age (the key changes when anything the timing depends on changes).
"""
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from minillm.model.loading import cache_dir as minillm_cache_dir

log = logging.getLogger("minillm.kernels")
_MEMORY: dict = {}                       # cache file -> saved data, when the folder is not writable


def tuning_file(prefix: str, key: dict, cache_dir=None) -> Path:
    """The cache file of one tuning result: `<prefix>_<hash of key>.json` under `cache_dir`, by
    default `$MINILLM_CACHE/kernels/` (~/.cache/minillm/kernels/). Shared by every tuner."""
    base = Path(cache_dir) if cache_dir is not None else minillm_cache_dir() / "kernels"
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return base / f"{prefix}_{digest}.json"


def read_tuned_why(path: Path, key: dict) -> tuple[dict | None, str]:
    """(the saved data at `path` if it was tuned under `key`, else None; why not, in words).
    This process's copy comes first when the folder was not writable."""
    if path in _MEMORY:
        return _MEMORY[path], ""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "no tuned table yet"
    except (OSError, ValueError) as err:
        return None, f"the table file {path} is unreadable ({type(err).__name__}), ignored"
    if not isinstance(data, dict) or data.get("key") != key:
        return None, f"the table file {path} was written for another machine or version, ignored"
    return data, ""


def read_tuned(path: Path, key: dict) -> dict | None:
    """The saved result at `path` if it was tuned under `key`; None when missing, corrupt or
    foreign: tune again."""
    return read_tuned_why(path, key)[0]


def write_tuned(path: Path, key: dict, body: dict) -> bool:
    """Save {"key": key, **body} atomically; True when written. A folder that cannot be written
    keeps it in memory for this process (and says so in one line)."""
    data = {"key": key, **body}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        _MEMORY.pop(path, None)
        return True
    except OSError as err:
        if path not in _MEMORY:
            notice(f"cannot write the tuning cache {path} ({err.strerror or err}); "
                   f"this process keeps the table in memory (set MINILLM_CACHE to a writable folder)")
        _MEMORY[path] = data
        return False


def tuner_lock(key: dict, cache_dir=None) -> Path:
    """The file a background tuner of the table `key` holds while it runs (its pid inside)."""
    return tuning_file("linear", key, cache_dir).with_suffix(".tuning")


def running_tuners(cache_dir=None) -> list[int]:
    """The pids of minillm's background tuners alive now (any table under `cache_dir`): their
    work gives way to everything else, so a measurement of "other work" leaves them out."""
    base = Path(cache_dir) if cache_dir is not None else minillm_cache_dir() / "kernels"
    pids = []
    for lock in base.glob("*.tuning") if base.is_dir() else ():
        try:
            pid = int(lock.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if pid != os.getpid() and _alive(pid):
            pids.append(pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def notice(line: str) -> None:
    """Tell the user one line (see the module docstring for where it goes)."""
    log.info(line)
    shown = log.isEnabledFor(logging.INFO) and log.hasHandlers()
    stream = sys.stderr
    if not shown and stream is not None and getattr(stream, "isatty", lambda: False)():
        print(f"minillm: {line}", file=stream, flush=True)
