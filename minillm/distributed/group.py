"""Process groups: the driver and its worker processes, talking over torch.distributed.

    driver (rank 0, this process) --TCPStore rendezvous on 127.0.0.1--> workers 1..N-1 (spawned)
    every rank: one ProcessGroupGloo (NCCL on CUDA) = `Comm`, with counters

`WorkerGroup.start(world_size, target, args)` spawns ranks 1..N-1 running
`target(rank, world_size, comm, *args)`; the caller is rank 0. No default process group is
made, so one notebook can hold several groups. `Comm` counts each operation's calls, seconds and
bytes (the payload this rank hands the collective, what `analysis.parallel_math` predicts). A
dead worker surfaces in the next collective or as a timeout; `check_alive()` raises `WorkerDied`
naming rank, pid and exit code. Workers die with the driver, and `shutdown()` (also at exit)
joins, terminates, then kills: no process is left behind.

Left out on purpose: multi-node rendezvous (torchrun, Ray), sub-groups, asynchronous collectives.
"""
import atexit
import ctypes
import datetime
import os
import pickle
import signal
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


class WorkerDied(RuntimeError):
    """A worker process of a group exited while the driver still needed it."""


def pick_backend(backend: str = "auto") -> str:
    """"gloo" (CPU) or "nccl" (CUDA); "auto" picks NCCL only when CUDA is present."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


class Comm:
    """One rank's handle on its group: a few collectives, each counted in `stats`."""

    def __init__(self, pg, rank: int, world_size: int, device: torch.device):
        self.pg, self.rank, self.world_size, self.device = pg, rank, world_size, device
        self.stats: dict[str, dict] = {}

    def reset_stats(self) -> None:
        self.stats = {}

    def _count(self, kind: str, nbytes: int, t0: float) -> None:
        s = self.stats.setdefault(kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
        s["calls"] += 1
        s["bytes"] += int(nbytes)
        s["seconds"] += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place (returns it)."""
        t0 = time.perf_counter()
        self.pg.allreduce([t]).wait()
        self._count("all_reduce", t.numel() * t.element_size(), t0)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on each), concatenated along `dim` in rank order."""
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([parts], [t]).wait()
        self._count("all_gather", t.numel() * t.element_size(), t0)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj=None, src: int = 0):
        """`obj` from rank `src` to every rank (pickled: a length, then the bytes)."""
        t0 = time.perf_counter()
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast([size], _root(src)).wait()
        if self.rank != src:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.pg.broadcast([data], _root(src)).wait()
        self._count("broadcast", 8 + data.numel(), t0)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def send(self, t: torch.Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        self.pg.send([t.contiguous()], dst, 0).wait()
        self._count("send", t.numel() * t.element_size(), t0)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `t` (its shape and dtype must match what `src` sends); returns it."""
        t0 = time.perf_counter()
        self.pg.recv([t], src, 0).wait()
        self._count("recv", t.numel() * t.element_size(), t0)
        return t

    def barrier(self) -> None:
        self.pg.barrier().wait()


def _root(src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return opts


def make_process_group(store, rank: int, world_size: int, backend: str, timeout_s: float):
    """One rank's own process group over `store` (no default group): gloo, or NCCL on CUDA."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (elsewhere: nothing, best effort)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker_main(rank, world_size, port, backend, timeout_s, threads, target, args):
    die_with_parent()
    if threads:
        torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, world_size, False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    store.set(f"up/{rank}", "1")
    pg = make_process_group(store, rank, world_size, backend, timeout_s)
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    target(rank, world_size, Comm(pg, rank, world_size, device), *args)


class WorkerGroup:
    """The driver's view of a group: its own `comm` (rank 0) and the worker processes."""

    def __init__(self, comm: Comm, processes: list, store):
        self.comm, self.processes, self._store = comm, processes, store
        self.closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown(timeout_s=2))

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @classmethod
    def start(cls, world_size: int, target, args: tuple = (), backend: str = "auto",
              timeout_s: float = 60.0, threads: int | None = None) -> "WorkerGroup":
        """Spawn ranks 1..world_size-1 running `target(rank, world_size, comm, *args)` (a
        top-level function) and join as rank 0. `threads`: torch threads per worker."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        backend = pick_backend(backend)
        store = dist.TCPStore(HOST, 0, world_size, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        procs = []
        try:
            for rank in range(1, world_size):
                p = ctx.Process(target=_worker_main, daemon=True, name=f"minillm-rank{rank}",
                                args=(rank, world_size, store.port, backend, timeout_s, threads,
                                      target, tuple(args)))
                p.start()
                procs.append(p)
            _wait_until_up(store, procs, timeout_s)
            pg = make_process_group(store, 0, world_size, backend, timeout_s)
        except BaseException:
            _stop(procs, 2.0)
            raise
        device = torch.device("cuda:0" if backend == "nccl" else "cpu")
        return cls(Comm(pg, 0, world_size, device), procs, store)

    def check_alive(self) -> None:
        """Raise `WorkerDied` if any worker has exited."""
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise WorkerDied(f"worker rank {rank} (pid {p.pid}) exited with code "
                                 f"{p.exitcode}; its group can no longer run steps")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the workers to exit (send them your stop message first),
        then terminate and kill what is left. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _stop(self.processes, timeout_s)


def _wait_until_up(store, procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    keys = [f"up/{rank}" for rank in range(1, len(procs) + 1)]
    while not (store.check(keys) if keys else True):
        for rank, p in enumerate(procs, start=1):
            if not p.is_alive():
                raise WorkerDied(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                                 f"while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not start within {timeout_s} s")
        time.sleep(0.02)


def _stop(procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(2.0)
