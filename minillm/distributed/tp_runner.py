"""The tensor-parallel model runner: the engine's `ModelRunner`, with the model split over processes.

    engine (rank 0) ── StepPlan ──> worker ranks 1..n-1 (minillm/distributed/tp_worker.py)
        every rank: its shard's forward over its own KV heads, 2 all-reduces per layer + 1
        (embedding), 1 all-gather of the logits; the driver samples from them

`LLM(..., tensor_parallel_size=n)` passes `TensorParallelRunner` to `LLMEngine(runner=...)`: the
engine's interface (`execute`, `execute_with_hidden`, `cache`), rank 0's shard and pool, the other
ranks as a `WorkerGroup`, and one `StepPlan` per step. One block manager serves every rank (each
pool holds Hkv/n heads of the same blocks). A dead worker makes the next step raise `WorkerDied`
naming it; `shutdown()` leaves no process behind. More ranks x threads than cores only warns (and
runs slower).

Left out on purpose: speculative decoding, trained drafters, compiled steps and the host KV tier
with n > 1 (`EngineConfig` refuses them), pipeline parallelism, several engines sharing workers.
"""
import multiprocessing.connection
import os
import time
import warnings
import weakref

import torch

from minillm.distributed.group import WorkerDied, WorkerGroup
from minillm.distributed.tensor_parallel import (build_shard, check_tensor_parallel_size,
                                                 shard_config, shard_state_dict)
from minillm.distributed.tp_worker import StepPlan, run_step, tp_worker
from minillm.engine.model_runner import ModelRunner, prompt_rows
from minillm.paging.paged_cache import CacheSpec


def num_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(n: int) -> int:
    """Torch threads for each worker rank: an even share of the cores, at least 1."""
    return max(1, num_cores() // n)


class TensorParallelRunner(ModelRunner):
    """`ModelRunner`'s interface over `config.tensor_parallel_size` ranks: this process is rank 0
    (`model`, `cache` are its shard and pool); `group` holds the workers (`pids`, `comm`).
    `LLM(..., tensor_parallel_size=n)` passes it to `LLMEngine` as its `runner`."""

    def __init__(self, model, config, num_blocks: int, block_manager, num_host_blocks: int = 0):
        """`ModelRunner`'s arguments; `num_host_blocks` is 0 (EngineConfig refuses a host tier)."""
        cfg = model.config
        n = check_tensor_parallel_size(cfg, config.tensor_parallel_size)
        param = next(model.parameters())
        device, spec = param.device, CacheSpec.for_engine(config, num_blocks, param.dtype)
        sd = model.state_dict()
        threads = worker_threads(n)
        self._warn_if_oversubscribed(n, threads)
        shards = {r: {k: v.to("cpu") for k, v in shard_state_dict(sd, cfg, r, n).items()}
                  for r in range(1, n)}
        backend = "gloo" if device.type == "cpu" else "nccl"
        self.group = WorkerGroup.start(n, tp_worker, args=(shards, cfg, spec), backend=backend,
                                       threads=threads if device.type == "cpu" else None)
        del shards                                       # the workers hold them now
        self.comm, self.n, self.closed = self.group.comm, n, False
        try:
            shard = build_shard(shard_state_dict(sd, cfg, 0, n), cfg, 0, n, self.comm)
            self.attach(shard, spec.make(shard_config(cfg, n), device), block_manager)
        except BaseException:                            # no engine: no workers either
            self.group.shutdown(timeout_s=0.5)
            raise
        self.swapped: dict = {}                          # seq_id -> this rank's swapped blocks
        # shutdown(), garbage collection or exit, whichever comes first: the stop plan, then join
        self._stop = weakref.finalize(self, stop_workers, self.comm, self.group)

    @staticmethod
    def _warn_if_oversubscribed(n: int, threads: int) -> None:
        cores = num_cores()
        total = torch.get_num_threads() + (n - 1) * threads
        if total > cores:
            warnings.warn(
                f"tensor_parallel_size={n}: {n} ranks run {total} torch threads on {cores} cores. "
                f"It runs, but the ranks take turns on the cores and every layer's two all-reduces "
                f"wait for the slowest rank, so each step is slower than tensor_parallel_size=1 "
                f"here; tensor parallelism pays off with one device (or core set) per rank.",
                stacklevel=3)                 # the engine line that makes the runner

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    def move_blocks(self, out) -> None:
        """Moves only go into the step's plan (`execute_with_hidden`); every rank makes them."""

    def _plan(self, out, return_hidden: bool):
        """`out` as a StepPlan, and what `execute_with_hidden` returns besides the logits."""
        plan = StepPlan(copies=list(out.copies), return_hidden=return_hidden)
        for seq, blocks in out.swap_out:
            plan.swap_out.append((seq.seq_id, list(blocks)))
            seq.swapped_kv = ("rank-local", seq.seq_id)  # each rank keeps its own copy
        for seq, blocks, first in out.swap_in:
            plan.swap_in.append((seq.seq_id, list(blocks), first))
            seq.swapped_kv = None
        if out.is_empty:
            return plan, []
        input_ids, positions, logits_index, sampling = self.prepare(out)   # rank 0's metadata
        plan.input_ids, plan.positions = input_ids[0].tolist(), positions.tolist()
        plan.query_lens, plan.context_lens, plan.block_tables = self.attn_lists
        plan.logits_index = None if logits_index is None else logits_index.tolist()
        return plan, sampling

    def execute_with_hidden(self, out, return_hidden: bool = True):
        if self.closed:
            raise RuntimeError("this tensor-parallel runner was shut down")
        try:
            self.group.check_alive()
        except WorkerDied as died:
            self._name_the_dead(died)
        plan, sampling = self._plan(out, return_hidden)
        if not plan.has_forward and not (plan.swap_out or plan.copies or plan.swap_in):
            return [], None, None
        try:
            self.comm.broadcast_object(plan)
            logits, hidden = run_step(self.model, self.cache, plan, self.swapped, prepared=True)
        except Exception as e:                           # gloo names no rank: find the dead one
            self._name_the_dead(e)
            raise
        if not plan.has_forward:
            return [], None, None
        rows = logits[0] if sampling or prompt_rows(out) else None
        return sampling, rows, (hidden[0] if hidden is not None else None)

    def _name_the_dead(self, error: Exception, wait_s: float = 5.0) -> None:
        """Raise `WorkerDied` naming every rank that has exited (one death can take another
        down with it: a rank left mid-collective reads garbage), or return if none has within
        `wait_s` (a killed process with many threads takes a moment to be reaped)."""
        procs, deadline = self.group.processes, time.monotonic() + wait_s
        while True:
            dead = [(r, p) for r, p in enumerate(procs, start=1) if not p.is_alive()]
            if dead and (len(dead) == len(procs) or self._settled(procs)):
                raise WorkerDied("; ".join(f"worker rank {r} (pid {p.pid}) exited with code "
                                           f"{p.exitcode}" for r, p in dead)
                                 + "; this tensor-parallel group can no longer run steps") from error
            if time.monotonic() > deadline:
                return
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.05)

    @staticmethod
    def _settled(procs) -> bool:
        """True once no other rank exits within 0.2 s."""
        alive = [p for p in procs if p.is_alive()]
        return not multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.2)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Send the stop plan (if every worker still listens), then stop the workers. Idempotent."""
        self.closed = True
        if self._stop.alive:
            self._stop.detach()
            stop_workers(self.comm, self.group, timeout_s)


def stop_workers(comm, group: WorkerGroup, timeout_s: float = 2.0) -> None:
    """The stop plan to every worker of a healthy group, then `group.shutdown`: a dead or stuck
    group is terminated at once instead."""
    if group.closed:
        return
    try:
        group.check_alive()
        comm.broadcast_object(StepPlan(stop=True))
    except Exception:
        timeout_s = 0.5
    group.shutdown(timeout_s=timeout_s)
