"""Flash-decoding: decode attention over the paged cache, split along the context and merged.

Letters: B sequences (one query each), H query heads, Hkv kv heads, G = H / Hkv queries per kv
head, D head dim, S_i context length of sequence i, Sg the longest, C chunk (keys per split),
nC = ceil(Sg / C) chunks, N*P slot rows of a layer's pool.

The context is cut into chunks of C keys; each gives a partial output o_c and its log-sum-exp
l_c, and `merge_partials` gives the exact answer o = sum_c exp(l_c - L) o_c, L = log sum_c
exp(l_c) (largest l_c subtracted first). Here the chunks of all sequences run in batched matmuls,
a tile of chunks at a time (`TILE_KEYS` slot rows), then one merge. A `DecodePlan`, built once
per step, holds per tile the gather index that puts head h of slot s at row s*Hkv + h of the pool
viewed as (N*P*Hkv, D), so a tile lands as (B, Hkv, n, C, D) and q as (B, Hkv, 1, G, D) meets
its kv head without a repeat; two tile buffers owned by the plan are reused by every layer.

Left out on purpose: prefill (T > 1 queries go through `paged.py`), a fused kernel (we
still copy each tile once, which a real kernel would not), and choosing C or the tile size by
timing them here (both are fixed round numbers).
"""
import math

import torch

from minillm._validate import check_int
from minillm.attention.metadata import PagedAttentionMetadata, long_tensor

# which steps come here is backends.py's choice (EngineConfig(attention_backend=...))
CHUNK = 256          # keys per split, the engine's choice: a fixed round number, not tuned here
TILE_KEYS = 2048     # slot rows gathered at once (~1.5 MiB of K for SmolLM2 fp32): a round
                     # number near a core's L2 size, not measured here


def merge_partials(outs, lses, dim: int = 0):
    """Merge softmax partials: outs (..., D) normalised per part, lses (...) their log-sum-exps,
    parts along `dim` of lses (and of outs) -> (out without `dim`, its lse).

    A part that saw no key has lse -inf and weight 0. Subtracting the largest lse first keeps
    every exp <= 1 (without it, scores of ~100 overflow float32)."""
    dim = dim % lses.dim()                       # outs has one more (last) dim than lses
    top = lses.amax(dim, keepdim=True)                                        # (.., 1, ..)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)           # all parts empty
    w = torch.exp(lses - top)                                                 # (...), in [0, 1]
    total = w.sum(dim)                                                        # (...)
    out = (w.unsqueeze(-1) * outs).sum(dim) / total.clamp_min(torch.finfo(w.dtype).tiny).unsqueeze(-1)
    return out, top.squeeze(dim) + torch.log(total)


class DecodePlan:
    """Gather indices and key masks of one decode step, shared by every layer.

    slots (B, Sg): slot row of key s of sequence i (entries past context_lens[i] are ignored);
    context_lens[i] >= 1 keys seen by sequence i's query. The nC chunks are computed in tiles of
    about `tile_keys` slot rows (over the batch): one tile's K and V are gathered into two small
    buffers and used while they are still in the CPU's cache, instead of gathering the whole
    context first (a copy as large as the KV itself, read back from memory)."""

    def __init__(self, slots, context_lens, n_kv_head: int, chunk: int,
                 max_context: int | None = None, tile_keys: int = TILE_KEYS):
        check_int("chunk", chunk, 1)
        check_int("n_kv_head", n_kv_head, 1)
        check_int("tile_keys", tile_keys, 1)
        if slots.dim() != 2 or slots.shape[0] != len(context_lens) or not context_lens:
            raise ValueError(f"slots must be (B, Sg) with B = len(context_lens) = "
                             f"{len(context_lens)} >= 1, got {tuple(slots.shape)}")
        if min(context_lens) < 1 or max(context_lens) > slots.shape[1]:
            raise ValueError(f"context_lens must be in [1, {slots.shape[1]}] (slots' width), "
                             f"got {min(context_lens)}..{max(context_lens)}")
        if max_context is not None and max(context_lens) > max_context:
            raise ValueError(f"context_lens: a context of {max(context_lens)} tokens is beyond the "
                             f"model's maximum max_context={max_context}")
        B, Sg = len(context_lens), max(context_lens)
        nC = -(-Sg // chunk)
        slots = slots[:, :Sg]
        if nC * chunk > Sg:            # pad to whole chunks with each row's first key (masked)
            slots = torch.cat([slots, slots[:, :1].expand(B, nC * chunk - Sg)], 1)  # (B, nC*C)
        heads = torch.arange(n_kv_head, device=slots.device)
        idx = slots[:, None, :] * n_kv_head + heads[:, None]                  # (B, Hkv, nC*C)
        seen = torch.arange(nC * chunk) < long_tensor(list(context_lens))[:, None]  # (B, nC*C)
        per_tile = max(1, tile_keys // (B * chunk))                           # chunks per tile
        self.tiles = []                  # (first chunk, last + 1, head-row index, slots, mask)
        for c0 in range(0, nC, per_tile):
            c1, keys = min(c0 + per_tile, nC), slice(c0 * chunk, min(c0 + per_tile, nC) * chunk)
            m = seen[:, keys]
            self.tiles.append((c0, c1, idx[:, :, keys].reshape(-1), slots[:, keys].reshape(-1),
                               None if bool(m.all()) else m.reshape(B, 1, c1 - c0, 1, chunk)
                               .to(slots.device)))
        self._bias, self._buffers = {}, {}
        self.shape, self.n_kv_head, self.chunk = (B, nC, chunk), n_kv_head, chunk

    @classmethod
    def from_tables(cls, context_lens, block_tables, block_size: int, n_kv_head: int,
                    chunk: int, device=None, max_context: int | None = None,
                    tile_keys: int = TILE_KEYS) -> "DecodePlan":
        """The plan from block tables: key s of sequence i is slot table[s // P] * P + s % P."""
        check_int("block_size", block_size, 1)
        for i, (t, n) in enumerate(zip(block_tables, context_lens)):
            if len(t) * block_size < n:
                raise ValueError(f"block_tables[{i}]: {len(t)} blocks x {block_size} cannot hold "
                                 f"context_lens[{i}] = {n}")
        Sg = max(context_lens)
        rows = [[t[p // block_size] * block_size + p % block_size for p in range(n)]
                + [t[0] * block_size] * (Sg - n) for t, n in zip(block_tables, context_lens)]
        slots = long_tensor([x for r in rows for x in r], device).view(len(rows), Sg)
        return cls(slots, context_lens, n_kv_head, chunk, max_context, tile_keys)

    @classmethod
    def from_metadata(cls, meta: PagedAttentionMetadata, n_kv_head: int, chunk: int,
                      max_context: int | None = None, tile_keys: int = TILE_KEYS) -> "DecodePlan":
        """The plan of a decode-only step (every query_len 1) from the paged metadata."""
        if any(t != 1 for t in meta.query_lens):
            raise ValueError("flash_decode needs a decode-only step (every query_len 1), got "
                             f"query_lens {meta.query_lens[:8]}")
        g = meta.groups[0]       # the decode group: kv_slots (B*Sg,), each row padded with key 0
        B, _, Sg = g.shape
        return cls(g.kv_slots.view(B, Sg), meta.context_lens, n_kv_head, chunk, max_context,
                   tile_keys)

    def bias(self, tile: int, dtype):
        """Tile `tile`'s key mask as 0 / -inf, (B, 1, n, 1, C), made once per step and dtype."""
        mask = self.tiles[tile][4]
        if mask is None:
            return None
        if (tile, dtype) not in self._bias:
            zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._bias[tile, dtype] = zeros.masked_fill(~mask, float("-inf"))
        return self._bias[tile, dtype]

    def buffer(self, name: str, like, D: int, rows: int):
        """The first `rows` rows of a gather buffer (max tile rows, D) reused by every tile and
        layer of the step: a fresh large tensor per call is fresh pages from the OS (faults)."""
        key = (name, like.dtype, like.device, D)
        if key not in self._buffers:
            most = max(t[2].numel() for t in self.tiles)
            self._buffers[key] = torch.empty(most, D, dtype=like.dtype, device=like.device)
        return self._buffers[key][:rows]


def _gather(slots_2d, plan: DecodePlan, tile: int, D: int, name: str):
    """Slot rows (N*P, Hkv*D) -> tile `tile`'s keys as (B, Hkv, n, C, D), in buffer `name`."""
    (B, _, C), Hkv = plan.shape, plan.n_kv_head
    c0, c1, index, slots, _ = plan.tiles[tile]
    if isinstance(slots_2d, torch.Tensor):       # one row per (slot, head): lands in order
        rows = torch.index_select(slots_2d.view(-1, D), 0, index,
                                  out=plan.buffer(name, slots_2d, D, index.numel()))  # (B*Hkv*n*C, D)
        return rows.view(B, Hkv, c1 - c0, C, D)
    rows = slots_2d.index_select(0, slots)       # a quantized pool (paging/kv_storage.py KVSlots)
    return rows.view(B, c1 - c0, C, Hkv, D).permute(0, 3, 1, 2, 4)           # (B, Hkv, n, C, D)


def chunk_partials(qg, k, v, bias=None):
    """One softmax per chunk: qg (B, Hkv, 1, G, D) pre-scaled, k/v (B, Hkv, n, C, D), bias 0/-inf
    (B, 1, n, 1, C) or None -> outs (B, Hkv, n, G, D) normalised per chunk, lses (B, Hkv, n, G)."""
    scores = qg @ k.transpose(-1, -2)                                         # (B, Hkv, n, G, C)
    if bias is not None:
        scores.add_(bias)
    m = scores.amax(-1, keepdim=True)                                         # (B, Hkv, n, G, 1)
    if bias is not None:         # a chunk of padding only: max -inf, weights 0, lse -inf
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = scores.sub_(m).exp_()                                                 # in place: no copy
    denom = p.sum(-1, keepdim=True)                                           # (B, Hkv, n, G, 1)
    outs = (p @ v).div_(denom if bias is None else denom.clamp_min(torch.finfo(p.dtype).tiny))
    return outs, (m + torch.log(denom)).squeeze(-1)     # outs (B, Hkv, n, G, D), lse (B, Hkv, n, G)


def flash_decode(q, k_slots, v_slots, n_kv_head: int, meta, *, chunk: int = CHUNK,
                 max_context: int | None = None):
    """Decode attention of q (B, H, D), one query per sequence, over one layer's slot rows
    k_slots, v_slots (N*P, Hkv*D) -> (B, H, D).

    meta: the step's `PagedAttentionMetadata` (decode-only) or a `DecodePlan` built once per
    step (then `chunk` and `max_context` are the plan's). chunk: keys per split (>= 1)."""
    check_int("n_kv_head", n_kv_head, 1)
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D) with one query per sequence, got {tuple(q.shape)}")
    B, H, D = q.shape
    if H % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide the {H} query heads of q")
    widths = [(x if isinstance(x, torch.Tensor) else x.codes).shape for x in (k_slots, v_slots)]
    if any(len(w) != 2 or w[1] != n_kv_head * D for w in widths):
        raise ValueError(f"k_slots/v_slots must be (N*P, n_kv_head*D) = (., {n_kv_head * D}), "
                         f"got {tuple(widths[0])}, {tuple(widths[1])}")
    plan = meta if isinstance(meta, DecodePlan) else DecodePlan.from_metadata(
        meta, n_kv_head, chunk, max_context)
    if plan.shape[0] != B or plan.n_kv_head != n_kv_head:
        raise ValueError(f"q holds {B} sequences and {n_kv_head} kv heads; the plan has "
                         f"{plan.shape[0]} and {plan.n_kv_head}")
    G, nC = H // n_kv_head, plan.shape[1]
    qg = q.reshape(B, n_kv_head, 1, G, D) * (1.0 / math.sqrt(D))              # (B, Hkv, 1, G, D)
    if len(plan.tiles) == 1:
        outs, lses = chunk_partials(qg, _gather(k_slots, plan, 0, D, "k"),
                                    _gather(v_slots, plan, 0, D, "v"), plan.bias(0, q.dtype))
    else:
        outs = q.new_empty(B, n_kv_head, nC, G, D)                            # (B, Hkv, nC, G, D)
        lses = q.new_empty(B, n_kv_head, nC, G)                               # (B, Hkv, nC, G)
        for t, (c0, c1, *_) in enumerate(plan.tiles):
            outs[:, :, c0:c1], lses[:, :, c0:c1] = chunk_partials(
                qg, _gather(k_slots, plan, t, D, "k"), _gather(v_slots, plan, t, D, "v"),
                plan.bias(t, q.dtype))
    if nC == 1:                                  # one chunk: its partial is the answer
        return outs.reshape(B, H, D)
    out, _ = merge_partials(outs, lses, dim=2)                                # (B, Hkv, G, D)
    return out.reshape(B, H, D)
