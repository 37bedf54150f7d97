"""Pipeline parallelism: a model's layers split over p processes, micro-batches flowing through.

Letters: B batch, T tokens per sequence, C model width, V vocab, p stages, m micro-batches.

    driver (rank 0) = stage 0          worker rank s = stage s              last stage
    for each micro-batch i:            for each micro-batch i:
      h = stage0(ids_i)                  h = recv(from s-1); h = stage_s(h)
      send(h, to 1)                      send(h, to s+1)   |  keep logits_i
    recv(logits_i from p-1) for all i                      |  send(logits_i, to 0) for all i

GPipe's forward (fill, steady state, drain). Each step starts with the driver broadcasting a
small plan (micro-batch shapes, "caches", or "stop"); activations travel by `send`/`recv` over
the group's `Comm`; the busy intervals come back as a `PipelineTimeline`.
`PipelineParallel.generate` is greedy decoding with a contiguous KV cache per stage and
micro-batch (`use_cache=False`: the reference that re-runs the context).

Left out on purpose: the backward pass and 1F1B, interleaved stages, and overlapping one step's
drain with the next step's fill (as many batches in flight as there are stages).
"""
import os
import time
import warnings

import torch

from minillm._validate import check_int
from minillm.distributed.group import WorkerGroup
from minillm.distributed.pipeline_stage import (PipelineStage, PipelineTimeline, split_layers,
                                                stage_state_dict)


def _run_stage(stage, comm, plan, src: int, dst: int, is_last: bool, caches):
    """One stage's share of a forward (micro-batch i uses caches[i] if there are caches);
    returns its busy intervals."""
    C, dtype = stage.config.d_model, stage.dtype
    intervals, kept = [], []
    for i, (b, t) in enumerate(plan["shapes"]):
        h = comm.recv(torch.empty(b, t, C, dtype=dtype), src)          # (b, T, C)
        t0 = time.perf_counter()
        out = stage(h, last_only=plan["last_only"], cache=caches[i] if caches else None,
                    start=plan["start"])
        intervals.append((i, t0, time.perf_counter()))
        if is_last:
            kept.append(out)                                           # (b, T or 1, V)
        else:
            comm.send(out, dst)
    for out in kept:
        comm.send(out, 0)
    return intervals


def _stage_worker(rank, world_size, comm, cfg, layers, state):
    """A worker's loop: build stage `rank`, then run plans until the driver says stop."""
    stage = PipelineStage(cfg, layers, first=False, last=rank == world_size - 1, state=state)
    del state
    caches = None
    while True:
        plan = comm.broadcast_object()
        if plan["op"] == "stop":
            return
        if plan["op"] == "caches":                   # one KV cache per micro-batch, or none
            caches = [stage.new_cache(b, plan["max_seq_len"]) for b in plan["batch_sizes"]]
            continue
        intervals = _run_stage(stage, comm, plan, rank - 1, rank + 1, rank == world_size - 1,
                               caches)
        for src in range(1, world_size):
            comm.broadcast_object(intervals if src == rank else None, src=src)


class PipelineParallel:
    """`model`'s layers over `pipeline_parallel_size` processes: stage 0 in this process, the
    others in workers. `forward(input_ids, num_microbatches)` -> (logits, timeline).

    Every stage computes with `threads` torch threads, stage 0 too (for the length of a forward:
    the driver's own setting comes back after it). Stages that oversubscribe the cores slow each
    other down far more than their share: OpenMP threads spin waiting for a descheduled sibling."""

    def __init__(self, model, pipeline_parallel_size: int = 2, partition: list[int] | None = None,
                 threads: int = 1, timeout_s: float = 120.0):
        cfg = model.config
        self.ranges = split_layers(cfg.n_layer, pipeline_parallel_size, partition)
        check_int("threads", threads, low=1)
        if model.device.type != "cpu":
            raise ValueError(f"model must be on the CPU (stages talk over gloo), got {model.device}")
        cores = os.cpu_count() or 1
        if pipeline_parallel_size * threads > cores:
            warnings.warn(f"pipeline_parallel_size={pipeline_parallel_size} stages x {threads} "
                          f"thread(s) > {cores} cores: stages will take turns on the cores, and "
                          f"the timeline's bubble will include that waiting", stacklevel=2)
        self.config, self.pipeline_parallel_size, self.threads = cfg, pipeline_parallel_size, threads
        state = model.state_dict()
        self.stage = PipelineStage(cfg, self.ranges[0], first=True,
                                   last=pipeline_parallel_size == 1, state=state)
        last = pipeline_parallel_size - 1
        args = []                       # stage s's weights, copied: the workers map the copies
        for s in range(1, pipeline_parallel_size):
            part = stage_state_dict(state, self.ranges[s], first=False, last=s == last)
            copy = {k: v.detach().clone(memory_format=torch.contiguous_format)
                    for k, v in part.items()}
            args.append((cfg, self.ranges[s], copy))
        self.last_stats: dict = {}
        self.last_timeline: PipelineTimeline | None = None
        self._caches: list | None = None            # stage 0's, during `generate` only
        self.group = WorkerGroup.start(pipeline_parallel_size, _dispatch, args=(args,),
                                       backend="gloo", timeout_s=timeout_s, threads=threads)

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids (stages 1..p-1)."""
        return self.group.pids

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_microbatches: int = 1, last_only: bool = False,
                start: int = 0):
        """input_ids (B, T) -> (logits (B, T, V) or (B, 1, V) with `last_only`, timeline).
        The batch is cut into `num_microbatches` (1..B) micro-batches along B. `start`: the
        position of the first token, for `generate`'s cached steps (0 without caches)."""
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
                or input_ids.dtype.is_floating_point or input_ids.numel() == 0):
            raise ValueError("input_ids must be a non-empty (B, T) tensor of token ids")
        V = self.config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:     # before any stage moves
            raise ValueError(f"input_ids must be token ids in [0, {V})")
        B = input_ids.shape[0]
        m = check_int("num_microbatches", num_microbatches, low=1, high=B)
        check_int("start", start, low=0)
        if start and not self._caches:
            raise ValueError("start > 0 needs KV caches (generate makes them); a forward without "
                             "caches sees only the tokens it is given, from position 0")
        if self.group.closed:
            raise RuntimeError("this PipelineParallel was shut down")
        self.group.check_alive()
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)         # stage 0 gets what every other stage gets
        try:
            return self._forward(input_ids, m, last_only, start)
        except BaseException:      # the stages are out of step now: no later forward can run
            self.group.shutdown(timeout_s=0)
            raise
        finally:
            torch.set_num_threads(before)

    def _forward(self, input_ids, m: int, last_only: bool, start: int):
        comm, p = self.group.comm, self.pipeline_parallel_size
        comm.reset_stats()
        chunks = torch.tensor_split(input_ids, m, dim=0)                # m x (b, T)
        timeline = PipelineTimeline(p, m)
        t_start = time.perf_counter()
        if p == 1:
            outs = []
            for i, ids in enumerate(chunks):
                t0 = time.perf_counter()
                outs.append(self.stage(ids, last_only, self._cache(i), start))
                timeline.intervals[(0, i)] = (t0 - t_start, time.perf_counter() - t_start)
            self.last_timeline = timeline
            return torch.cat(outs, dim=0), timeline
        comm.broadcast_object({"op": "forward", "shapes": [tuple(c.shape) for c in chunks],
                               "last_only": last_only, "start": start})
        for i, ids in enumerate(chunks):
            t0 = time.perf_counter()
            h = self.stage(ids, cache=self._cache(i), start=start)    # (b, T, C)
            timeline.intervals[(0, i)] = (t0 - t_start, time.perf_counter() - t_start)
            comm.send(h, 1)
        rows, V = (1 if last_only else input_ids.shape[1]), self.config.vocab_size
        outs = [comm.recv(torch.empty(c.shape[0], rows, V, dtype=self.stage.dtype), p - 1)
                for c in chunks]                                        # m x (b, T or 1, V)
        for src in range(1, p):
            for i, a, b in comm.broadcast_object(None, src=src):
                timeline.intervals[(src, i)] = (a - t_start, b - t_start)
        self.last_stats = {k: dict(v) for k, v in comm.stats.items()}
        self.last_timeline = timeline
        return torch.cat(outs, dim=0), timeline

    def _cache(self, i: int):
        return self._caches[i] if self._caches else None

    def _set_caches(self, batch_sizes: list[int], max_seq_len: int = 1) -> None:
        """Give every stage one KV cache per micro-batch (batch_sizes), or drop them ([])."""
        if self.pipeline_parallel_size > 1:
            self.group.comm.broadcast_object({"op": "caches", "batch_sizes": batch_sizes,
                                              "max_seq_len": max_seq_len})
        self._caches = [self.stage.new_cache(b, max_seq_len) for b in batch_sizes] or None

    def generate(self, input_ids, max_new_tokens: int, num_microbatches: int = 1,
                 use_cache: bool = True) -> list[list[int]]:
        """Greedy tokens for B equal-length prompts (B, T). With `use_cache` every stage keeps a
        KV cache of its layers per micro-batch: one prefill pass, then one token per pass, each
        pass its own fill and drain. Without, every new token re-runs the pipeline over the
        whole context (the reference)."""
        check_int("max_new_tokens", max_new_tokens, low=1)
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids                      # (B, T)
        B, T = ids.shape
        m = check_int("num_microbatches", num_microbatches, low=1, high=B)
        if T + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds the "
                             f"model's context of {self.config.max_seq_len} tokens")
        if not use_cache:
            out = []
            for _ in range(max_new_tokens):
                logits, _ = self.forward(ids, m, last_only=True)        # (B, 1, V)
                out.append(logits[:, -1].argmax(-1))                    # (B,)
                ids = torch.cat([ids, out[-1][:, None]], dim=1)         # (B, T + 1)
            return torch.stack(out, dim=1).tolist()                     # (B, max_new_tokens)
        self._set_caches([len(c) for c in torch.tensor_split(ids, m)], T + max_new_tokens)
        try:
            logits, _ = self.forward(ids, m, last_only=True)            # prefill: (B, 1, V)
            out = [logits[:, -1].argmax(-1)]                            # (B,)
            while len(out) < max_new_tokens:
                logits, _ = self.forward(out[-1][:, None], m, last_only=True,
                                         start=T + len(out) - 1)        # one token: (B, 1, V)
                out.append(logits[:, -1].argmax(-1))
        finally:
            if not self.group.closed:
                self._set_caches([])
        return torch.stack(out, dim=1).tolist()                         # (B, max_new_tokens)

    def shutdown(self) -> None:
        """Tell the workers to stop, then make sure they are gone. Idempotent."""
        if self.group.closed:
            return
        healthy = all(p.is_alive() for p in self.group.processes)
        try:
            if healthy:
                self.group.comm.broadcast_object({"op": "stop"})
        finally:       # with a rank dead the others wait on it forever: terminate them at once
            self.group.shutdown(timeout_s=5 if healthy else 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _dispatch(rank, world_size, comm, args):
    """Worker entry: pick this rank's stage arguments out of the list."""
    _stage_worker(rank, world_size, comm, *args[rank - 1])
