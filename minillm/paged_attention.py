"""Paged KV storage and attention over a ragged batch, with the dense reference beside it.

Letters: N blocks in the pool, P block size (tokens per block), Hkv kv heads, H query heads,
D head dim, L layers, B sequences in the batch, T new (query) tokens of one sequence,
S context length of one sequence (tokens already cached + the new ones), M = sum of T over the batch.

Layout (the one place it is defined): every layer owns one K pool and one V pool of shape
`(N, P, Hkv, D)`; the cache keeps them stacked as `(L, N, P, Hkv, D)`. Token `pos` of a sequence
lives in physical slot `table[pos // P] * P + pos % P` of the flattened pool `(N * P, Hkv, D)`.

One forward pass runs the new tokens of many sequences flattened into one row of M tokens:
prefill chunks (T > 1) and decode tokens (T == 1) mixed. `PagedAttentionMetadata` turns the
per-sequence lengths and block tables into index tensors once per step; every layer reuses them:
1. write: the new K/V go to their slots (`slot_mapping`, one slot per new token);
2. gather: each sequence's K/V are read through its block table with one `index_select`;
3. attend: `F.scaled_dot_product_attention` with an explicit mask that is causal per sequence
   (query t of a sequence sees context positions <= S - T + t) and hides padding.
Decodes and prefill chunks form two groups, so one long chunk does not pad every decode to T.

Left out on purpose: a fused kernel (we gather into a padded dense tensor, which costs memory
traffic a real PagedAttention kernel avoids), sliding windows, and KV quantization.
"""
import torch
import torch.nn.functional as F

from .config import ModelConfig


class _Group:
    """Index tensors for a set of sequences attended together (padded to Tg queries, Sg keys)."""

    def __init__(self, seqs, starts, query_lens, context_lens, tables, block_size, device):
        B = len(seqs)
        q = torch.tensor([query_lens[i] for i in seqs], dtype=torch.long)
        s = torch.tensor([context_lens[i] for i in seqs], dtype=torch.long)
        start = torch.tensor([starts[i] for i in seqs], dtype=torch.long)
        Tg, Sg = int(q.max()), int(s.max())
        nb = max(len(tables[i]) for i in seqs)
        table = torch.zeros(B, nb, dtype=torch.long)
        for row, i in enumerate(seqs):
            table[row, :len(tables[i])] = torch.tensor(tables[i], dtype=torch.long)
        t = torch.arange(Tg)
        j = torch.arange(Sg)
        # query t of a row sits at position S - T + t; padded rows repeat the last real query
        qpos = torch.minimum(s[:, None] - q[:, None] + t, s[:, None] - 1)        # (B, Tg)
        self.q_index = (start[:, None] + torch.minimum(t, q[:, None] - 1)).to(device)  # (B, Tg)
        self.mask = (j <= qpos[..., None])[:, None].to(device)               # (B, 1, Tg, Sg)
        slots = table[:, j // block_size] * block_size + j % block_size        # (B, Sg)
        # padding keys read the row's own first token (always written, so never NaN garbage)
        slots = torch.where(j < s[:, None], slots, table[:, :1] * block_size)
        self.kv_slots = slots.reshape(-1).to(device)                           # (B*Sg,)
        valid = t < q[:, None]                                                  # (B, Tg)
        self.src = valid.reshape(-1).nonzero().squeeze(1).to(device)            # rows of (B*Tg)
        self.dst = (start[:, None] + t).masked_select(valid).to(device)         # flat token ids
        self.shape = (B, Tg, Sg)


class PagedAttentionMetadata:
    """Per-step attention metadata, built once and shared by every layer.

    query_lens[i]: new tokens of sequence i in this pass (T_i >= 1), in flattened order.
    context_lens[i]: tokens of sequence i that attention sees, the new ones included (S_i >= T_i).
    block_tables[i]: physical block ids of sequence i, at least ceil(S_i / P) of them.
    """

    def __init__(self, query_lens, context_lens, block_tables, block_size: int, device=None):
        if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, context_lens and block_tables must be non-empty lists "
                             f"of one length, got {len(query_lens)}, {len(context_lens)}, "
                             f"{len(block_tables)}")
        for i, (t, s, tab) in enumerate(zip(query_lens, context_lens, block_tables)):
            if not 1 <= t <= s:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {t}, {s}")
            if len(tab) * block_size < s:
                raise ValueError(f"sequence {i}: block table of {len(tab)} blocks x {block_size} "
                                 f"cannot hold context_len {s}")
        self.block_size = block_size
        self.query_lens, self.context_lens = list(query_lens), list(context_lens)
        self.num_tokens = sum(query_lens)
        starts, slots, acc = [], [], 0
        for t, s, tab in zip(query_lens, context_lens, block_tables):
            starts.append(acc)
            acc += t
            slots += [tab[p // block_size] * block_size + p % block_size for p in range(s - t, s)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)  # (M,)
        decode = [i for i, t in enumerate(query_lens) if t == 1]
        prefill = [i for i, t in enumerate(query_lens) if t > 1]
        self.groups = [_Group(g, starts, query_lens, context_lens, block_tables, block_size, device)
                       for g in (decode, prefill) if g]


def write_kv(k_pool, v_pool, k, v, slot_mapping) -> None:
    """Store new K/V (M, Hkv, D) into pools (N, P, Hkv, D) at their slots (M,)."""
    N, P, Hkv, D = k_pool.shape
    k_pool.view(N * P, Hkv, D).index_copy_(0, slot_mapping, k)
    v_pool.view(N * P, Hkv, D).index_copy_(0, slot_mapping, v)


def paged_attention(q, k_pool, v_pool, meta: PagedAttentionMetadata):
    """Attention of flattened queries q (M, H, D) over K/V pools (N, P, Hkv, D) -> (M, H, D)."""
    M, H, D = q.shape
    N, P, Hkv, _ = k_pool.shape
    if M != meta.num_tokens or P != meta.block_size:
        raise ValueError(f"q has {M} tokens and pools have block size {P}; metadata expects "
                         f"{meta.num_tokens} tokens and block size {meta.block_size}")
    k_flat, v_flat = k_pool.view(N * P, Hkv, D), v_pool.view(N * P, Hkv, D)
    out = torch.empty_like(q)
    for g in meta.groups:
        B, Tg, Sg = g.shape
        qg = q[g.q_index].transpose(1, 2)                                     # (B, H, Tg, D)
        kg = k_flat.index_select(0, g.kv_slots).view(B, Sg, Hkv, D).transpose(1, 2)  # (B, Hkv, Sg, D)
        vg = v_flat.index_select(0, g.kv_slots).view(B, Sg, Hkv, D).transpose(1, 2)  # (B, Hkv, Sg, D)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask,
                                            enable_gqa=H != Hkv)              # (B, H, Tg, D)
        og = og.transpose(1, 2).reshape(B * Tg, H, D)                         # (B*Tg, H, D)
        out.index_copy_(0, g.dst, og.index_select(0, g.src))
    return out


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


class PagedKVCache:
    """The model's cache protocol (`attend`) over paged pools of shape (L, N, P, Hkv, D).

    Before each forward pass call `prepare(query_lens, context_lens, block_tables)` (or set
    `metadata`); the model is then called with input_ids (1, M) and positions (M,)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device=None,
                 dtype=torch.float32):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        shape = (config.n_layer, num_blocks, block_size, config.n_kv_head, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)              # (L, N, P, Hkv, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)              # (L, N, P, Hkv, D)
        self.metadata: PagedAttentionMetadata | None = None

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype=torch.float32) -> int:
        """K and V bytes of one block across all layers."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.n_layer * block_size * config.n_kv_head * config.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prepare(self, query_lens, context_lens, block_tables) -> PagedAttentionMetadata:
        self.metadata = PagedAttentionMetadata(query_lens, context_lens, block_tables,
                                               self.block_size, self.k.device)
        return self.metadata

    def attend(self, layer_idx: int, q, k, v):
        """q (1, H, M, D), k/v (1, Hkv, M, D) of the flattened batch -> (1, H, M, D)."""
        if self.metadata is None:
            raise RuntimeError("PagedKVCache.attend called before prepare(...)")
        if q.shape[0] != 1:
            raise ValueError(f"paged attention expects a flattened batch (1, H, M, D), got {tuple(q.shape)}")
        write_kv(self.k[layer_idx], self.v[layer_idx], k[0].transpose(0, 1),
                 v[0].transpose(0, 1), self.metadata.slot_mapping)             # (M, Hkv, D)
        out = paged_attention(q[0].transpose(0, 1), self.k[layer_idx], self.v[layer_idx],
                              self.metadata)                                  # (M, H, D)
        return out.transpose(0, 1)[None]                                      # (1, H, M, D)

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: copy block src to dst in every layer, for each (src, dst) pair."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def swap_out(self, block_ids) -> torch.Tensor:
        """Copy blocks to CPU memory -> (2, L, len(block_ids), P, Hkv, D)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return torch.stack([self.k[:, idx], self.v[:, idx]]).to("cpu")

    def swap_in(self, data: torch.Tensor, block_ids) -> None:
        """Write blocks saved by `swap_out` back into (possibly different) physical blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        self.k[:, idx] = data[0].to(self.k.device)
        self.v[:, idx] = data[1].to(self.k.device)
