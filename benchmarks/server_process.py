"""Start an HTTP server as a subprocess on a free loopback port, wait until it is healthy, stop it.

`server_process(argv, health_url, log_path)` is a context manager: it starts `argv` in its own
session (so a Ctrl-C in the terminal reaches us first), polls `health_url` until it answers 200
(failing early, with the log's tail, if the process exits), and on the way out sends SIGTERM,
waits, then kills. The child gets HF_HUB_OFFLINE=1 and, first on PYTHONPATH, the folder holding
the `minillm` package this process imported, so `python -m minillm serve` runs this checkout; and,
unless they are set already, OMP_NUM_THREADS and MKL_NUM_THREADS = this process's torch threads
(`python -m benchmarks --threads`, one by default), so a server that picks its own thread count
(`transformers serve`) runs under the same thread policy as the record says.

Left out on purpose: restarting crashed servers, ports other than loopback.
"""
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import minillm


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict:
    import torch
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(torch.get_num_threads()))
    root = str(Path(minillm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_healthy(proc, health_url: str, log_path: Path, timeout_s: float) -> float:
    """Seconds until `health_url` answered 200; RuntimeError if the process died or time ran out."""
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}; log tail:\n{_tail(log_path)}")
        try:
            if httpx.get(health_url, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f}s; log tail:\n{_tail(log_path)}")


def stop(proc, grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def server_process(argv: list[str], health_url: str, log_path, timeout_s: float = 600.0):
    """Yield (process, startup seconds) with the server healthy; always stopped on exit."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            yield proc, wait_healthy(proc, health_url, log_path, timeout_s)
        finally:
            stop(proc)
