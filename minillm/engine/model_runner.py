"""The model runner: turns one scheduler decision into tensors and runs the model.

Letters: M tokens in the flattened batch, M' padded, K logits rows this step, V vocab, C width.

It only runs. Given a `SchedulerOutput` it moves blocks first (host-tier offloads, swap-outs,
copy-on-write copies, swap-ins, restores, in that order), flattens every scheduled token into
input_ids (1, M), positions (M,) and one attention metadata for all layers, and runs the model
with logits only where a sequence samples (its chunk's end, each draft; a token tree's nodes
attend to their ancestors only). `execute_with_hidden` also returns the final norm's output, the
features trained drafters read; `prompt_rows` adds rows for `prompt_logprobs`. With compiled
steps or CUDA graphs (kernels/compiled_steps.py, cuda_graph_steps.py) `prepare` pads a step to the
next kept size M' with rows in the scratch block. Sampling is sampler.py's job, applying results
the engine's. It makes its own pool from the engine's config (paging's `CacheSpec`) and its
compiled steps (compile_steps.py); `LLMEngine(runner=...)` takes another runner in its place
(the tensor-parallel one: distributed/tp_runner.py).

Left out on purpose: overlapping CPU scheduling with GPU work.
"""
from dataclasses import dataclass

import torch

from minillm.paging.block_manager import BlockManager
from minillm.attention.metadata import long_tensor
from minillm.paging.host_pool import HostKVPool
from minillm.paging.paged_cache import CacheSpec, PagedKVCache
from minillm.engine.compile_steps import compiled_steps
from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sequence import Sequence


@dataclass
class PromptRows:
    """`count` logits rows that score prompt tokens first..first + count - 1 of `seq`."""

    seq: Sequence
    first: int
    count: int


def depths(parents: list[int]) -> list[int]:
    """Each node's depth in a token tree (root 0): its RoPE position is the root's + depth."""
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def prompt_rows(out: SchedulerOutput) -> list[PromptRows]:
    """The prompt-logprob rows a step computes, in order: for each scheduled chunk of a request
    that asks for prompt logprobs and has no output yet, its positions that predict a prompt
    token (a resumed sequence has them already)."""
    rows = []
    for seq, n in out.scheduled:
        if seq.params.prompt_logprobs is None or seq.output_token_ids:
            continue
        start, end = seq.num_computed_tokens, min(seq.num_computed_tokens + n,
                                                  len(seq.prompt_token_ids) - 1)
        if start < end:
            rows.append(PromptRows(seq, start + 1, end - start))
    return rows


class SwappedOnSeqs:
    """`PagedKVCache.move_blocks`' store of swapped blocks, kept on each `Sequence` (its
    `swapped_kv`), where the scheduler looks for them (to undo a step, or to free an abort's)."""

    def __setitem__(self, seq: Sequence, kv) -> None:
        seq.swapped_kv = kv

    def pop(self, seq: Sequence):
        kv, seq.swapped_kv = seq.swapped_kv, None
        return kv


class ModelRunner:
    """`LLMEngine`'s default runner: one process, its own pool of `num_blocks` blocks (the
    engine's `config` read by attribute) and, with `compilation_config`, the compiled steps."""

    def __init__(self, model, config, num_blocks: int, block_manager: BlockManager,
                 num_host_blocks: int = 0):
        n = config.tensor_parallel_size
        if n > 1:
            raise ValueError(f"tensor_parallel_size={n} needs worker processes, which the "
                             f"default ModelRunner does not start: use LLM(..., "
                             f"tensor_parallel_size={n}), or LLMEngine(..., runner="
                             f"TensorParallelRunner) from minillm.distributed.tp_runner")
        param = next(model.parameters())
        spec = CacheSpec.for_engine(config, num_blocks, param.dtype)
        compiled = (None if config.compilation_config is None      # eager: no compile wing
                    else compiled_steps(model, config, spec, param.device))
        self.attach(model, spec.make(model.config, param.device), block_manager, num_host_blocks,
                    compiled)

    def attach(self, model, cache: PagedKVCache, block_manager: BlockManager,
               num_host_blocks: int = 0, compiled=None) -> None:
        """Run `model` on `cache` (a subclass that makes its own model or pool calls this)."""
        self.model, self.cache, self.bm = model, cache, block_manager
        # CompiledSteps or CudaGraphSteps (per padded size), None: eager; a BackgroundSteps
        # still compiling waits in `pending` and is adopted at the first step after it is ready
        self.compiled, self.pending = (None, compiled) if getattr(compiled, "background", False) \
            else (compiled, None)
        self.rows = 0                # this step's rows before compiled-size padding
        self.padded_to = None        # the compiled size this step runs at, or None (eager)
        self.device = cache.k.device
        # the host tier's slots (paging/host_pool.py; pinned on CUDA), or None without a tier
        self.host = HostKVPool(cache, num_host_blocks) if num_host_blocks else None

    def shutdown(self) -> None:
        """Nothing to stop in one process (the tensor-parallel runner stops its workers)."""

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """K/V of slots src -> dst in every layer (token trees' accepted paths, llm_engine.py)."""
        self.cache.move_slots(src, dst)

    def move_blocks(self, out: SchedulerOutput) -> None:
        if out.offload:       # first: the blocks they read may be written by anything below
            self.host.store(self.cache, out.offload)
        # swap-outs (each (2, L, nb, P, Hkv, D) on CPU, + scales), copies, swap-ins
        self.cache.move_blocks(out.swap_out, out.copies, out.swap_in, SwappedOnSeqs())
        if out.restore:       # last: their blocks are fresh ones, maybe freed by a swap-out above
            self.host.restore(self.cache, out.restore)

    def prepare(self, out: SchedulerOutput):
        """Flatten the batch -> (input_ids (1, M), positions (M,), logits_index (K,), sampling seqs);
        logits_index is None when every token samples (a step of decodes only). The sampling
        rows come first, then the `prompt_rows(out)`."""
        ids, pos, qlens, ctxs, tables, last, sampling = [], [], [], [], [], [], []
        trees = []                                # per sequence: a token tree's parents, or None
        flat = {}                                 # seq -> index of its chunk's first token in ids
        for seq, n in out.scheduled:
            start, k = seq.num_computed_tokens, len(seq.draft_token_ids)
            flat[seq.seq_id] = len(ids)
            ids += seq.token_ids_from(start)[:n]
            tree = seq.draft_parents if k and n == k + 1 else None
            trees.append(tree)
            pos += range(start, start + n) if tree is None else [start + d for d in depths(tree)]
            qlens.append(n)
            ctxs.append(start + n)
            tables.append(self.bm.block_table(seq.seq_id))
            if start + n == seq.num_tokens + k:   # the chunk reaches the end: sample after it
                last += range(len(ids) - 1 - k, len(ids))   # + every draft position to verify
                sampling.append(seq)
        n = len(ids) + len(out.padding)
        self.rows = n
        self.padded_to = self.compiled.padded(n) if self.compiled is not None else None
        # static batching: a finished member's row still costs compute; a compiled size: the rows
        # up to it
        for _ in range((self.padded_to or n) - len(ids)):
            ids.append(0)
            pos.append(0)
            qlens.append(1)
            ctxs.append(1)
            tables.append([self.cache.num_blocks - 1])   # the scratch block (see LLMEngine)
            trees.append(None)
        trees = trees if any(t is not None for t in trees) else None
        self.attn_lists = (qlens, ctxs, tables)  # what the cache's metadata is built from
        self.cache.prepare(qlens, ctxs, tables, trees)
        input_ids = long_tensor(ids, self.device)[None]                         # (1, M)
        positions = long_tensor(pos, self.device)                               # (M,)
        prows = prompt_rows(out)
        for r in prows:                           # position first - 1 + i predicts token first + i
            at = flat[r.seq.seq_id] + r.first - 1 - r.seq.num_computed_tokens
            last += range(at, at + r.count)
        if not prows and len(last) == len(ids):   # every token samples (all decodes): no gather
            logits_index = None
        else:
            logits_index = long_tensor(last or [len(ids) - 1], self.device)    # (K,)
        return input_ids, positions, logits_index, sampling

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor | None]:
        """Move blocks, run the forward pass; return the sequences that sample and their logits
        (one row each, K + 1 rows for a sequence with K speculative drafts; then any prompt rows)."""
        seqs, logits, _ = self.execute_with_hidden(out, return_hidden=False)
        return seqs, logits

    @torch.inference_mode()
    def execute_with_hidden(self, out: SchedulerOutput, return_hidden: bool = True):
        """`execute`, plus the target's features: hidden (M, C), one row per scheduled token in
        the order of `out.scheduled` (what trained drafters read; spec/features.py), or None."""
        if self.pending is not None and self.pending.ready():
            steps, self.pending = self.pending.steps, None
            self.compiled = steps if steps is not None and steps.kept else None
        if self.pending is None:
            return self._execute(out, return_hidden)
        self.pending.clock.begin()            # a background compile times only between steps
        try:
            return self._execute(out, return_hidden)
        finally:
            self.pending.clock.end()

    def _execute(self, out: SchedulerOutput, return_hidden: bool):
        self.move_blocks(out)
        if out.is_empty:
            return [], None, None
        input_ids, positions, logits_index, sampling = self.prepare(out)
        hidden = None
        if self.padded_to is not None:        # a compiled size: the graph, then the real rows' logits
            logits, hidden = self.compiled.run(input_ids, positions, self.cache, self.rows,
                                               logits_index, return_hidden=True)
            hidden = hidden[0] if return_hidden else None                          # (M, C)
        elif return_hidden:
            logits, hidden = self.model(input_ids, positions=positions, cache=self.cache,
                                        logits_index=logits_index, return_hidden=True)
            hidden = hidden[0]                                                     # (M, C)
        else:
            logits = self.model(input_ids, positions=positions, cache=self.cache,
                                logits_index=logits_index)                        # (1, K, V)
        return sampling, (logits[0] if sampling or prompt_rows(out) else None), hidden
