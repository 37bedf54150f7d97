"""How the router gets its two workers: spawned as its own child processes, or dialing in from
terminals of their own (vLLM-style: `python -m minillm serve --disaggregated --role ...`).

    spawn_workers(spec, link_port)              -> {"prefill": Worker, "decode": Worker}, children
    accept_workers(address, authkey, link_port) -> the same, for workers that connect to `address`

A `Worker` is the router's handle on one worker: `inbox.put(msg)` sends a command, `outbox` is a
Connection the router reads (`multiprocessing.connection.wait`), `process` says whether it lives
(`is_alive`, `pid`, `exitcode`). A spawned worker has an mp.Queue inbox and its own pipe as
outbox; a remote one has one duplex socket for both, and is gone when it ends. `stop_workers`
sends each a stop, then terminates and kills the children it spawned (never another process).

Left out on purpose: workers on other machines (the KV link rendezvouses on 127.0.0.1), and a
worker that reconnects after it was lost.
"""
import dataclasses
import time
from multiprocessing.connection import Listener

import torch.multiprocessing as mp

from minillm.distributed.group import _stop
from minillm.serve.disagg_worker import decode_main, prefill_main
from minillm.serve.errors import WorkerUnavailable

ROLES = ("prefill", "decode")


@dataclasses.dataclass
class Worker:
    role: str
    process: object                     # mp.Process, or a `Remote` stand-in
    inbox: object                       # .put(msg)
    outbox: object                      # a Connection the router reads
    num_blocks: int = 0
    used_blocks: int = 0
    gone: str | None = None             # why it is unavailable, once it is

    def describe_exit(self) -> str:
        p = self.process
        how = (f"exited with code {p.exitcode}" if not isinstance(p, Remote) else "disconnected")
        return f"worker unavailable: the {self.role} worker (pid {p.pid}) {how}"


class Remote:
    """A worker process this router did not start: alive until its connection ends."""

    def __init__(self, pid: int):
        self.pid, self.exitcode, self.alive = pid, None, True

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        pass


class RemoteInbox:
    def __init__(self, conn):
        self.conn = conn

    def put(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            pass                        # gone: the router finds out from its outbox

    def close(self) -> None:
        self.conn.close()

    def cancel_join_thread(self) -> None:
        pass


def spawn_workers(spec: dict, link_port: int, timeout_s: float) -> dict[str, Worker]:
    """Both workers as daemon children of this process (torch.multiprocessing, spawn)."""
    ctx, workers = mp.get_context("spawn"), {}
    try:
        for role, target in zip(ROLES, (prefill_main, decode_main)):
            inbox, (reader, writer) = ctx.Queue(), ctx.Pipe(duplex=False)
            p = ctx.Process(target=target, args=(link_port, inbox, writer, spec), daemon=True,
                            name=f"minillm-{role}")
            p.start()
            writer.close()                            # the worker holds the only writing end
            workers[role] = Worker(role, p, inbox, reader)
        _await_ready(workers, timeout_s)
    except BaseException:
        _stop([w.process for w in workers.values()], 2.0)
        raise
    return workers


def accept_workers(address: tuple[str, int], authkey: bytes, link_port: int,
                   timeout_s: float | None = None, on_listen=None) -> dict[str, Worker]:
    """Wait at `address` for one prefill and one decode worker (`disagg_worker.run_remote`)."""
    workers = {}
    with Listener(address, authkey=authkey) as listener:
        if on_listen is not None:
            on_listen(listener.address)
        while len(workers) < len(ROLES):
            conn = listener.accept()
            hello = conn.recv()
            role = hello[1] if hello[0] == "hello" else None
            if role not in ROLES or role in workers:
                conn.send(("refused", f"this router wants one worker per role {ROLES}; got {role!r}"))
                conn.close()
                continue
            conn.send(("link", link_port))
            workers[role] = Worker(role, Remote(hello[2]), RemoteInbox(conn), conn)
    _await_ready(workers, timeout_s)
    return workers


def _await_ready(workers: dict[str, Worker], timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for w in workers.values():
        while not w.outbox.poll(0.05):
            if not w.process.is_alive():
                raise WorkerUnavailable(f"the {w.role} worker (pid {w.process.pid}) exited with "
                                        f"code {w.process.exitcode} while starting")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the {w.role} worker did not start within {timeout_s} s")
        try:
            msg = w.outbox.recv()
        except (EOFError, OSError):
            msg = ("gone", None, f"its pipe closed (exit code {w.process.exitcode})")
        if msg[0] != "ready":
            raise WorkerUnavailable(f"the {w.role} worker failed while starting: {msg[-1]}")
        w.num_blocks = msg[3]


def stop_workers(workers: dict[str, Worker], timeout_s: float) -> None:
    """A stop message to each worker still there; then the spawned ones are joined, terminated,
    killed (distributed/group.py's `_stop`); every channel is closed."""
    for w in workers.values():
        if w.gone is None and w.process.is_alive():
            w.inbox.put(("stop",))
    _stop([w.process for w in workers.values() if not isinstance(w.process, Remote)], timeout_s)
    for w in workers.values():
        w.outbox.close()
        w.inbox.close()
        w.inbox.cancel_join_thread()
