"""FlashAttention's forward pass as readable PyTorch: tiles of queries against tiles of keys with
the online softmax, so the (T, S) scores never exist whole.

Letters as in `reference.py` (B, H, Hkv, G = H / Hkv, T, S, D); bq, bk the tile sizes.
For each tile of `block_q` queries we keep a running row maximum m, a running sum l of
exp(score - m) and an unnormalized output acc; each tile of `block_k` keys updates them
(`online_softmax_step`): when the maximum grows from m to m', everything summed so far is
rescaled by exp(m - m'). After the last key tile, acc / l is exactly softmax(scores) @ v, and
m + log(l) is the row's log-sum-exp (what flash-decoding merges partial results with).

Causal attention visits only key tiles with at least one visible key (about half the tiles when
T = S) and builds a mask only for tiles that straddle the diagonal (`key_tiles`). GQA views the
H query heads as Hkv groups of G, so a key tile is read once per group, never repeated.
Accumulation is in float32 for 16-bit inputs (float64 for float64), as the kernels do.

Left out on purpose: the backward pass, dropout, and everything that makes the real kernel fast
(tiles held in on-chip SRAM, one fused kernel, no Python loop): this file shows the algorithm and
its arithmetic; `io_model.py` counts the memory traffic a kernel running it would have.
"""
from dataclasses import dataclass

import torch

from minillm._validate import check_int
from minillm.attention.reference import check_attention_inputs


@dataclass(frozen=True)
class TileStats:
    """How many (query tile, key tile) pairs a call visits, skips and masks."""
    total: int          # ceil(T / bq) * ceil(S / bk)
    visited: int        # tiles computed
    skipped: int        # tiles every key of which is hidden by causality: never computed
    masked: int         # visited tiles that straddle the diagonal and need a causal mask


def key_tiles(i0: int, i1: int, T: int, S: int, causal: bool, block_k: int):
    """Key tiles (j0, j1, needs_causal_mask) that queries i0..i1-1 visit. Query t sits at position
    S - T + t, so with `causal` keys past S - T + i1 - 1 are hidden from the whole tile."""
    end = min(S, S - T + i1) if causal else S
    for j0 in range(0, end, block_k):
        j1 = min(j0 + block_k, S)
        yield j0, j1, causal and j1 - 1 > S - T + i0       # some key hidden from the first query


def flash_attention_stats(T: int, S: int, *, causal: bool = True, block_q: int = 64,
                          block_k: int = 64) -> TileStats:
    """The tile counts of `flash_attention` on T queries and S keys (the same loop bounds)."""
    check_int("T", T, low=1)
    check_int("S", S, low=T)
    check_int("block_q", block_q, low=1)
    check_int("block_k", block_k, low=1)
    visited = masked = 0
    for i0 in range(0, T, block_q):
        for _, _, diag in key_tiles(i0, min(i0 + block_q, T), T, S, causal, block_k):
            visited, masked = visited + 1, masked + diag
    total = -(-T // block_q) * -(-S // block_k)
    return TileStats(total, visited, total - visited, masked)


def online_softmax_step(m, l, acc, s, v_tile):
    """Fold one tile of scores s (..., rows, bk) and values v_tile (..., bk, D) into the running
    max m (..., rows, 1), sum l (..., rows, 1) and unnormalized output acc (..., rows, D)."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)   # a row that has seen no key yet
    alpha = torch.exp(m - m_safe)                     # rescales what was summed under the old max
    p = torch.exp(s - m_safe)                                                # (..., rows, bk)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v_tile


def _tile_mask(mask5, diag, i0, i1, j0, j1, T, S, G, device):
    """The (B?, Hkv?, G * bq, bk) allowed-mask of one tile, or None when every score is visible."""
    allowed = None
    if diag:
        t = torch.arange(i0, i1, device=device)[:, None]
        allowed = (torch.arange(j0, j1, device=device) <= S - T + t).repeat(G, 1)   # (G*bq, bk)
    if mask5 is not None:
        user = mask5[:, :, :, i0:i1, j0:j1].reshape(*mask5.shape[:2], G * (i1 - i0), j1 - j0)
        allowed = user if allowed is None else user & allowed
    return allowed


def _flash_core(q, k, v, mask5, scale, causal, block_q, block_k):
    """The two loops. q (B, Hkv, G, T, D) in the accumulation dtype; -> out like q, lse (B, Hkv, G, T)."""
    B, Hkv, G, T, D = q.shape
    S = k.shape[2]
    out, lse = torch.empty_like(q), q.new_empty(B, Hkv, G, T)
    for i0 in range(0, T, block_q):
        i1 = min(i0 + block_q, T)
        rows = G * (i1 - i0)
        qt = q[:, :, :, i0:i1].reshape(B, Hkv, rows, D) * scale                  # (B, Hkv, G*bq, D)
        m = q.new_full((B, Hkv, rows, 1), float("-inf"))
        l, acc = q.new_zeros(B, Hkv, rows, 1), q.new_zeros(B, Hkv, rows, D)
        for j0, j1, diag in key_tiles(i0, i1, T, S, causal, block_k):
            s = qt @ k[:, :, j0:j1].transpose(-2, -1).to(q.dtype)                 # (B, Hkv, G*bq, bk)
            allowed = _tile_mask(mask5, diag, i0, i1, j0, j1, T, S, G, q.device)
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            m, l, acc = online_softmax_step(m, l, acc, s, v[:, :, j0:j1].to(q.dtype))
        o = torch.where(l > 0, acc / l.clamp_min(torch.finfo(l.dtype).tiny), 0.0)  # 0 if no key seen
        out[:, :, :, i0:i1] = o.view(B, Hkv, G, i1 - i0, D)
        lse[:, :, :, i0:i1] = (m + torch.log(l)).view(B, Hkv, G, i1 - i0)       # -inf if no key seen
    return out, lse


def flash_attention(q, k, v, *, causal: bool = True, block_q: int = 64, block_k: int = 64,
                    mask=None, scale=None, return_lse: bool = False):
    """Attention of q (B, H, T, D) over k, v (B, Hkv, S, D), tiled with the online softmax.

    Equal to `attention_reference` (to rounding in float64). `mask`: bool, broadcastable to
    (B, H, T, S), True = may attend. -> out (B, H, T, D) in q's dtype, and with `return_lse` also
    the log-sum-exp of each row's scaled scores (B, H, T), float32 (float64 for float64 inputs),
    -inf for a row that sees no key (whose output is 0)."""
    scale = check_attention_inputs(q, k, v, mask, scale)
    check_int("block_q", block_q, low=1)
    check_int("block_k", block_k, low=1)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q5 = q.reshape(B, Hkv, G, T, D).to(acc_dtype)             # heads h = g_kv * G + g: GQA's grouping
    mask5 = None if mask is None else mask.expand(B, H, T, k.shape[2]).reshape(B, Hkv, G, T, -1)
    out, lse = _flash_core(q5, k, v, mask5, scale, causal, block_q, block_k)
    out = out.view(B, H, T, D).to(q.dtype)
    return (out, lse.view(B, H, T)) if return_lse else out
