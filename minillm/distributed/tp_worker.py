"""One step of a tensor-parallel engine, as every rank runs it, and the worker's loop.

Letters: M tokens in the flattened batch, K logits rows, V vocab, C model width; n ranks.

The driver (rank 0) decides everything. Per step it broadcasts a `StepPlan` (block moves, token
ids, positions, the paged-attention lengths and block tables, the logits rows) and every rank
calls `run_step`: move blocks in its own pool, run its shard's forward, and hold the same logits
(1, K, V). Each rank's pool holds only its Hkv/n KV heads, in the blocks the driver names.

    driver:  plan = runner.prepare(out) ─ broadcast_object(plan) ─ run_step ─ logits -> sampler
    worker:                     plan = broadcast_object()       ─ run_step ─ (logits dropped)

`tp_worker(rank, world_size, comm, ...)` is the worker's whole life: build its shard and pool,
then run plans until one says stop.

Left out on purpose: overlapping the next plan's broadcast with this step's compute, sending only
the changes of the block tables, and gathering the logits to rank 0 only.
"""
from dataclasses import dataclass, field

import torch

from minillm.attention.metadata import long_tensor
from minillm.distributed.tensor_parallel import build_shard, shard_config
from minillm.paging.paged_cache import CacheSpec, PagedKVCache


@dataclass
class StepPlan:
    """What every rank does this step: the driver's `ModelRunner.prepare`, as plain ints.
    `swap_out` / `swap_in` name each sequence by seq_id: every rank keeps its own CPU copy."""

    stop: bool = False
    swap_out: list = field(default_factory=list)          # [(seq_id, blocks)]
    copies: list = field(default_factory=list)            # [(src block, dst block)]
    swap_in: list = field(default_factory=list)           # [(seq_id, blocks, first)]
    input_ids: list = field(default_factory=list)         # (M,)
    positions: list = field(default_factory=list)         # (M,)
    query_lens: list = field(default_factory=list)        # per sequence (and padding row)
    context_lens: list = field(default_factory=list)
    block_tables: list = field(default_factory=list)
    logits_index: list | None = None                      # (K,) or None: every row
    return_hidden: bool = False

    @property
    def has_forward(self) -> bool:
        return bool(self.query_lens)


@torch.inference_mode()
def run_step(model, cache: PagedKVCache, plan: StepPlan, swapped: dict, prepared: bool = False):
    """Run `plan` on this rank -> (logits (1, K, V), hidden (1, M, C) or None), or (None, None)
    for a plan that only moves blocks. `prepared`: the cache's metadata is already this step's."""
    cache.move_blocks(plan.swap_out, plan.copies, plan.swap_in, swapped)
    if not plan.has_forward:
        return None, None
    if not prepared:
        cache.prepare(plan.query_lens, plan.context_lens, plan.block_tables)
    device = cache.k.device
    input_ids = long_tensor(plan.input_ids, device)[None]                      # (1, M)
    positions = long_tensor(plan.positions, device)                            # (M,)
    index = None if plan.logits_index is None else long_tensor(plan.logits_index, device)
    if plan.return_hidden:
        return model(input_ids, positions=positions, cache=cache, logits_index=index,
                     return_hidden=True)                                       # (1, K, V), (1, M, C)
    return model(input_ids, positions=positions, cache=cache, logits_index=index), None


def tp_worker(rank: int, world_size: int, comm, shards: dict, cfg, spec: CacheSpec) -> None:
    """A worker rank: its shard (`shards[rank]`, a state dict) and pool, then plans until stop."""
    sd = {k: v.to(comm.device) for k, v in shards[rank].items()}
    del shards                                    # the other ranks' tensors are not ours to hold
    model = build_shard(sd, cfg, rank, world_size, comm)
    cache = spec.make(shard_config(cfg, world_size), comm.device)
    swapped: dict = {}
    while True:
        try:
            plan = comm.broadcast_object(None, src=0)
        except RuntimeError:                      # the driver is gone: nothing left to serve
            return
        if plan.stop:
            return
        run_step(model, cache, plan, swapped)
