"""Moving a prefilled request from one engine to another: the prompt's KV blocks and its first token.

    prefill engine: add_request -> step() (prefill + first token) -> export_prompt_kv
                    -> abort_request
    decode engine:  can_import(h) -> import_prefilled(h) -> step() ... (decodes from token 2 on)

Letters: L layers, P block size, Hkv kv heads, D head dim, S prompt tokens, n_i tokens in block i.

`export_prompt_kv` reads the request's blocks in order, each a (2, L, n_i, Hkv, D) tensor (K then
V) of the slots the prompt fills: exactly `kv_math.kv_cache_bytes(cfg, S, dtype)` bytes.
`import_prefilled` allocates blocks in the decode engine's own `BlockManager` (block sizes may
differ), writes the rows, marks the prompt computed and puts the `Sequence` in the running queue
with its first token appended, so the next `step()` decodes it. `can_import` says whether there
is room now; with prefix caching the blocks the decode side holds are reused.

Left out on purpose: a quantized KV cache (int8 / fp8 pools: refused), n > 1 and best_of (they
fork after the prefill: refused), prompt logprobs (never sent), speculative decoding state.
"""
from dataclasses import dataclass, field

import torch

from minillm.engine.requests import request_state
from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Request, RequestMetrics, RequestOutput, Sequence
from minillm.paging.block_manager import NoFreeBlocksError


@dataclass
class Handoff:
    """A prefilled request on its way from a prefill engine to a decode engine."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    params: SamplingParams
    blocks: list[torch.Tensor] = field(default_factory=list)  # each (2, L, n_i, Hkv, D), block order
    first_logprobs: dict | None = None   # {token id: Logprob} of the first token, when asked for
    prompt: str | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        """KV payload bytes: 2 * L * S * Hkv * D * element size."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    def header(self) -> dict:
        """Everything but the tensors, with each block's shape and dtype: what a transport sends
        first, so the receiver can allocate the blocks before they arrive."""
        return {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "first_token": self.first_token, "params": self.params,
                "first_logprobs": self.first_logprobs, "prompt": self.prompt,
                "shapes": [tuple(b.shape) for b in self.blocks],
                "dtype": str(self.blocks[0].dtype).removeprefix("torch.") if self.blocks else "float32"}

    @classmethod
    def from_header(cls, header: dict, blocks: list[torch.Tensor]) -> "Handoff":
        keys = ("request_id", "prompt_token_ids", "first_token", "params", "first_logprobs", "prompt")
        return cls(**{k: header[k] for k in keys}, blocks=blocks)


def _check_pool(engine) -> None:
    if engine.cache.kv_cache_dtype != "auto":
        raise ValueError(f"KV transfer needs kv_cache_dtype='auto', got "
                         f"{engine.cache.kv_cache_dtype!r} (quantized pools are not sent)")


def export_prompt_kv(engine, request_id: str) -> Handoff:
    """The prompt KV and first token of a request that `engine` has just prefilled (it holds one
    output token and its blocks). The request stays in `engine`: abort it once sent."""
    _check_pool(engine)
    req = engine.requests.get(str(request_id))
    if req is None:
        raise ValueError(f"unknown request_id {request_id!r}")
    if req.num_seqs != 1:
        raise ValueError(f"request {request_id!r} samples n={req.num_seqs} completions; KV "
                         f"transfer handles n=1 only")
    seq = req.seqs[0]
    S = len(seq.prompt_token_ids)
    if len(seq.output_token_ids) != 1 or seq.num_computed_tokens < S or seq.is_finished:
        raise ValueError(f"request {request_id!r} is not freshly prefilled: it holds "
                         f"{len(seq.output_token_ids)} output tokens (need 1), "
                         f"{seq.num_computed_tokens}/{S} prompt tokens computed, "
                         f"status {seq.status.value}")
    bm, P = engine.block_manager, engine.block_manager.block_size
    table = bm.block_table(seq.seq_id)[:bm.blocks_needed(S)]
    blocks = []
    for i, b in enumerate(table):
        n = min(P, S - i * P)                                   # tokens held by block i
        kv = torch.stack([engine.cache.k[:, b, :n], engine.cache.v[:, b, :n]])   # (2, L, n, Hkv, D)
        blocks.append(kv.to("cpu", copy=True))
    lps = seq.logprobs[0] if seq.logprobs else None
    return Handoff(req.request_id, list(seq.prompt_token_ids), seq.output_token_ids[0],
                   req.params, blocks, lps, req.prompt)


def _check_handoff(engine, h: Handoff) -> None:
    if not isinstance(h, Handoff):
        raise TypeError(f"handoff must be a Handoff, got {type(h).__name__}")
    _check_pool(engine)
    mc = engine.model.config
    S = len(h.prompt_token_ids)
    want = (2, mc.n_layer, mc.n_kv_head, mc.head_dim)
    got = [(b.shape[0], b.shape[1], b.shape[3], b.shape[4]) if b.dim() == 5 else tuple(b.shape)
           for b in h.blocks]
    if any(g != want for g in got) or sum(b.shape[2] for b in h.blocks) != S:
        raise ValueError(f"handoff {h.request_id!r}: blocks must be (2, L={mc.n_layer}, n_i, "
                         f"Hkv={mc.n_kv_head}, D={mc.head_dim}) holding S={S} tokens in all, got "
                         f"{[tuple(b.shape) for b in h.blocks]}")
    if (h.params.best_of or h.params.n) != 1:
        raise ValueError(f"handoff {h.request_id!r}: n and best_of must be 1 for KV transfer")


def can_import(engine, h: Handoff) -> bool:
    """Whether `engine` has room for the handoff now: a running slot and blocks for its prompt.
    (A prompt the whole pool could never hold raises ValueError instead.)"""
    room = len(engine.scheduler.running) < engine.config.max_num_seqs
    return room and engine.block_manager.can_allocate(list(h.prompt_token_ids))


def import_prefilled(engine, h: Handoff) -> RequestOutput:
    """Register `h` in `engine` as a running sequence whose prompt is computed and whose first
    token is out; returns the request's snapshot. Raises NoFreeBlocksError (nothing changed)
    when `can_import` is False, ValueError for a handoff this engine cannot take."""
    _check_handoff(engine, h)
    rid = str(h.request_id)
    if rid in engine.requests:
        raise ValueError(f"request_id {rid!r} is already in use")
    ids = engine._check_prompt(list(h.prompt_token_ids), h.params)
    if not can_import(engine, h):
        raise NoFreeBlocksError(f"no room for request {rid!r}: {engine.num_free_blocks} free "
                                f"blocks, {len(engine.scheduler.running)} running sequences")
    procs, grammar = request_state(h.params, engine.tokenizer, engine.model.config.vocab_size,
                                   engine.eos_token_id, engine.config.enable_prefix_caching)
    now = engine.clock()
    seq = Sequence(engine._new_seq_id(), rid, ids, h.params, now, procs=procs, grammar=grammar)
    bm, cache = engine.block_manager, engine.cache
    cached = bm.allocate(seq.seq_id, ids)               # prefix-cache hits are already written
    offload, restore = bm.take_kv_moves()               # host tier: copies first, then the rows
    engine.runner.move_blocks(SchedulerOutput(offload=offload, restore=restore))
    rows = torch.cat(list(h.blocks), dim=2).to(cache.k.device, cache.k.dtype)   # (2, L, S, Hkv, D)
    slots = torch.tensor(bm.slot_mapping(seq.seq_id, cached, len(ids)), device=cache.k.device)
    L, N, P, Hkv, D = cache.k.shape
    cache.k.view(L, N * P, Hkv, D)[:, slots] = rows[0, :, cached:]     # (L, S - cached, Hkv, D)
    cache.v.view(L, N * P, Hkv, D)[:, slots] = rows[1, :, cached:]
    seq.num_computed_tokens, seq.num_cached_tokens = len(ids), cached
    bm.mark_computed(seq.seq_id, len(ids))
    metrics = RequestMetrics(now, arrival_step=engine.step_count, first_scheduled_time=now,
                             num_cached_tokens=cached)
    engine.requests[rid] = Request(rid, ids, h.params, [seq], metrics, prompt=h.prompt)
    engine.scheduler.add_running(seq)
    engine._append(seq, [h.first_token], now, [h.first_logprobs] if h.first_logprobs else None)
    return engine._output(engine.requests[rid])
