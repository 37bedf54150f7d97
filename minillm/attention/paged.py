"""Paged attention over a ragged batch, with the dense reference beside it.

Letters: N blocks in the pool, P block size (tokens per block), Hkv kv heads, H query heads,
D head dim, B sequences in the batch, T new (query) tokens of one sequence, S context length of
one sequence (tokens already cached + the new ones), M = sum of T over the batch.

Layout (the one place it is defined): a layer's K pool and V pool each have shape
`(N, P, Hkv, D)`. Token `pos` of a sequence lives in physical slot `table[pos // P] * P + pos % P`
of the flattened pool `(N * P, Hkv, D)`; paging/paged_cache.py owns the pools.

One pass runs prefill chunks and decode tokens flattened into M rows, with the index tensors of
`PagedAttentionMetadata` (metadata.py) built once per step: write the new K/V to their slots
(`slot_mapping`), gather each sequence's K/V through its block table (`index_select`), attend
with `F.scaled_dot_product_attention` under a mask made once per step (query t sees context
positions <= S - T + t). Decodes and prefill chunks form two groups, so a long chunk does not pad
every decode to T. A pool may be a quantized `KVSlots` (paging/kv_storage.py): same two methods.

Left out on purpose: a fused kernel (we gather into a padded dense tensor, which costs memory
traffic a real PagedAttention kernel avoids) and sliding windows.
"""
import torch
import torch.nn.functional as F

from minillm.attention.metadata import PagedAttentionMetadata


def write_kv(k_pool, v_pool, k, v, slot_mapping) -> None:
    """Store new K/V (M, Hkv, D) into pools (N, P, Hkv, D) at their slots (M,)."""
    N, P, Hkv, D = k_pool.shape
    M = k.shape[0]
    write_slots(k_pool.view(N * P, Hkv * D), v_pool.view(N * P, Hkv * D),
                k.reshape(M, Hkv * D), v.reshape(M, Hkv * D), slot_mapping)


def paged_attention(q, k_pool, v_pool, meta: PagedAttentionMetadata):
    """Attention of flattened queries q (M, H, D) over K/V pools (N, P, Hkv, D) -> (M, H, D)."""
    M, H, D = q.shape
    N, P, Hkv, _ = k_pool.shape
    if M != meta.num_tokens or P != meta.block_size:
        raise ValueError(f"q has {M} tokens and pools have block size {P}; metadata expects "
                         f"{meta.num_tokens} tokens and block size {meta.block_size}")
    return attend_slot_rows(q, k_pool.view(N * P, Hkv * D), v_pool.view(N * P, Hkv * D), Hkv,
                            meta)                                             # (M, H, D)


# The per-layer hot path. It takes q one row per token, (M, H, D), as the fused q/k/v projection
# produces it (the reference model's heads-first (H, M, D) is one transpose away), and each
# layer's pools as one row per slot, (N * P, Hkv * D): one `index_copy_` writes and one
# `index_select` gathers whole rows (the 2-D form is the fastest one on CPU). It does nothing the
# step's metadata could do once for every layer, and in the common case (a group that is the
# whole batch) it reaches SDPA through views only.

def write_slots(k_slots, v_slots, k_rows, v_rows, slot_mapping) -> None:
    """New K/V rows (M, Hkv * D) -> rows `slot_mapping` (M,) of k_slots, v_slots (N * P, Hkv * D)."""
    k_slots.index_copy_(0, slot_mapping, k_rows)
    v_slots.index_copy_(0, slot_mapping, v_rows)


def attend_slot_rows(q, k_slots, v_slots, Hkv: int, meta: PagedAttentionMetadata):
    """q (M, H, D), one row per token, over slot rows (N * P, Hkv * D) -> (M, H, D); unchecked
    (see paged_attention). q may be a view into a wider tensor (the model's fused q/k/v)."""
    M, H, D = q.shape
    out = None
    for g in meta.groups:
        B, Tg, Sg = g.shape
        qg = q.view(B, Tg, H, D) if g.whole else q[g.q_index]                 # (B, Tg, H, D)
        kg = k_slots.index_select(0, g.kv_slots).view(B, Sg, Hkv, D)          # (B, Sg, Hkv, D)
        vg = v_slots.index_select(0, g.kv_slots).view(B, Sg, Hkv, D)          # (B, Sg, Hkv, D)
        og = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
            attn_mask=g.additive_mask(q.dtype), enable_gqa=H != Hkv)        # (B, H, Tg, D)
        og = og.transpose(1, 2).reshape(B * Tg, H, D)     # a view when Tg == 1 (decodes)
        if g.whole:
            return og                                                         # (M, H, D)
        if out is None:
            out = q.new_empty(M, H, D)                                        # (M, H, D)
        out.index_copy_(0, g.dst, og.index_select(0, g.src))
    return out                                                                # (M, H, D)


def dense_attention(q, k, v):
    """Reference: causal attention of one sequence's T newest queries over its whole context.

    q (H, T, D); k, v (Hkv, S, D) with S >= T; query t sits at position S - T + t. Written with
    plain matmul + softmax (no SDPA), so the paged path is checked against independent math."""
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    k = k.repeat_interleave(H // Hkv, dim=0)                                  # (H, S, D)
    v = v.repeat_interleave(H // Hkv, dim=0)                                  # (H, S, D)
    scores = q @ k.transpose(1, 2) / D ** 0.5                                 # (H, T, S)
    allowed = torch.arange(S) <= (S - T + torch.arange(T))[:, None]           # (T, S)
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v                                  # (H, T, D)


def ragged_dense_attention(q, ks, vs, query_lens):
    """Reference for a flattened batch: q (M, H, D), ks/vs lists of (S_i, Hkv, D) -> (M, H, D)."""
    outs, start = [], 0
    for k, v, t in zip(ks, vs, query_lens):
        qi = q[start:start + t].transpose(0, 1)                               # (H, T, D)
        outs.append(dense_attention(qi, k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1))
        start += t
    return torch.cat(outs)                                                    # (M, H, D)
