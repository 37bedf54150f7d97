"""Paged KV storage and attention over a ragged batch, with the dense reference beside it.

Letters: N blocks in the pool, P block size (tokens per block), Hkv kv heads, H query heads,
D head dim, L layers, B sequences in the batch, T new (query) tokens of one sequence,
S context length of one sequence (tokens already cached + the new ones), M = sum of T over the batch.

Layout (the one place it is defined): every layer owns one K pool and one V pool of shape
`(N, P, Hkv, D)`; the cache keeps them stacked as `(L, N, P, Hkv, D)`. Token `pos` of a sequence
lives in physical slot `table[pos // P] * P + pos % P` of the flattened pool `(N * P, Hkv, D)`.

One forward pass runs the new tokens of many sequences flattened into one row of M tokens:
prefill chunks (T > 1) and decode tokens (T == 1) mixed. `PagedAttentionMetadata` (metadata.py)
turns the per-sequence lengths and block tables into index tensors once per step; every layer
reuses them:
1. write: the new K/V go to their slots (`slot_mapping`, one slot per new token);
2. gather: each sequence's K/V are read through its block table with one `index_select`;
3. attend: `F.scaled_dot_product_attention` with an explicit mask that is causal per sequence
   (query t of a sequence sees context positions <= S - T + t) and hides padding.
Decodes and prefill chunks form two groups, so one long chunk does not pad every decode to T.
Per layer only the write, the gather and SDPA run: the mask is made once per step (as the
0 / -inf tensor SDPA would otherwise rebuild from a boolean one in every layer, and not at all
when every query sees every key), and a group that is the whole batch in order (all decodes, or
one prefill chunk) reaches SDPA through views, without gathering queries or scattering outputs.
`bench overhead` measures what this saves on a 30-layer tiny model.

Left out on purpose: a fused kernel (we gather into a padded dense tensor, which costs memory
traffic a real PagedAttention kernel avoids) and sliding windows. `kv_cache_dtype` "int8" / "fp8"
stores one-byte codes (int8 with a scale pool; minillm/quant/kv.py): the same write and gather run
through `KVSlots`, which quantizes on write and dequantizes what it gathers.
"""
import torch
import torch.nn.functional as F

from minillm.model.config import ModelConfig
# the per-step index tensors live in metadata.py; imported here too, where callers find them
from minillm.paging.metadata import PagedAttentionMetadata, long_tensor  # noqa: F401


def write_kv(k_pool, v_pool, k, v, slot_mapping) -> None:
    """Store new K/V (M, Hkv, D) into pools (N, P, Hkv, D) at their slots (M,)."""
    N, P, Hkv, D = k_pool.shape
    M = k.shape[0]
    _write_slots(k_pool.view(N * P, Hkv * D), v_pool.view(N * P, Hkv * D),
                 k.reshape(M, Hkv * D), v.reshape(M, Hkv * D), slot_mapping)


def paged_attention(q, k_pool, v_pool, meta: PagedAttentionMetadata):
    """Attention of flattened queries q (M, H, D) over K/V pools (N, P, Hkv, D) -> (M, H, D)."""
    M, H, D = q.shape
    N, P, Hkv, _ = k_pool.shape
    if M != meta.num_tokens or P != meta.block_size:
        raise ValueError(f"q has {M} tokens and pools have block size {P}; metadata expects "
                         f"{meta.num_tokens} tokens and block size {meta.block_size}")
    return _attend_rows(q, k_pool.view(N * P, Hkv * D), v_pool.view(N * P, Hkv * D), Hkv,
                        meta)                                                 # (M, H, D)


# The per-layer hot path. It takes q one row per token, (M, H, D), as the fused q/k/v projection
# produces it (the reference model's heads-first (H, M, D) is one transpose away), and each
# layer's pools as one row per slot, (N * P, Hkv * D): one `index_copy_` writes and one
# `index_select` gathers whole rows (the 2-D form is the fastest one on CPU). It does nothing the
# step's metadata could do once for every layer, and in the common case (a group that is the
# whole batch) it reaches SDPA through views only.

def _write_slots(k_slots, v_slots, k_rows, v_rows, slot_mapping) -> None:
    """New K/V rows (M, Hkv * D) -> rows `slot_mapping` (M,) of k_slots, v_slots (N * P, Hkv * D)."""
    k_slots.index_copy_(0, slot_mapping, k_rows)
    v_slots.index_copy_(0, slot_mapping, v_rows)


def _attend_rows(q, k_slots, v_slots, Hkv: int, meta: PagedAttentionMetadata):
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


class PagedKVCache:
    """The model's cache protocol (`attend`) over paged pools of shape (L, N, P, Hkv, D), in `dtype`
    or, with `kv_cache_dtype` "int8" / "fp8", as codes (+ scales (L, N, P, Hkv) for int8).

    Before each forward pass call `prepare(query_lens, context_lens, block_tables)` (or set
    `metadata`); the model is then called with input_ids (1, M) and positions (M,)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device=None,
                 dtype=torch.float32, kv_cache_dtype: str = "auto",
                 attention_backend: str = "paged"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        from minillm.attention.flash_decoding import ATTENTION_BACKENDS
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {attention_backend!r}")
        # "flash_decoding": decode-only steps split the context into chunks merged by their
        # log-sum-exp (minillm/attention/flash_decoding.py); steps with a prefill chunk stay here
        self.attention_backend = attention_backend
        self._decode_plan = self._plan_meta = None          # built once per step, for every layer
        self._threshold = False                             # "auto": the crossover, once asked
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.kv_cache_dtype = kv_cache_dtype
        shape = (config.n_layer, num_blocks, block_size, config.n_kv_head, config.head_dim)
        self.k_scale = self.v_scale = None
        if kv_cache_dtype == "auto":
            # each layer's pools as one row per slot, viewed once: (N*P, Hkv*D) each
            flat = (config.n_layer, num_blocks * block_size, config.n_kv_head * config.head_dim)
            self.k = torch.zeros(shape, device=device, dtype=dtype)          # (L, N, P, Hkv, D)
            self.v = torch.zeros(shape, device=device, dtype=dtype)          # (L, N, P, Hkv, D)
            self._k_slots, self._v_slots = list(self.k.view(flat)), list(self.v.view(flat))
        else:   # codes (L, N, P, Hkv, D) + scales (L, N, P, Hkv), quantized on write (quant/kv.py)
            from minillm.quant.kv import kv_pools
            self.k, self.k_scale, self._k_slots = kv_pools(kv_cache_dtype, shape, device, dtype)
            self.v, self.v_scale, self._v_slots = kv_pools(kv_cache_dtype, shape, device, dtype)
        self.metadata: PagedAttentionMetadata | None = None

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype=torch.float32,
                        kv_cache_dtype: str = "auto") -> int:
        """K and V bytes of one block across all layers (scales included)."""
        if kv_cache_dtype == "auto":
            elem = torch.tensor([], dtype=dtype).element_size()
        else:
            from minillm.quant.kv import kv_dtype_bytes
            elem = kv_dtype_bytes(kv_cache_dtype, config.head_dim, dtype)
        return round(2 * config.n_layer * block_size * config.n_kv_head * config.head_dim * elem)

    def _pairs(self) -> list:
        """(K, V) pools in block order: the values, then the scales when quantized."""
        return [(self.k, self.v)] + ([(self.k_scale, self.v_scale)] if self.k_scale is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._pairs())

    def prepare(self, query_lens, context_lens, block_tables) -> PagedAttentionMetadata:
        self.metadata = PagedAttentionMetadata(query_lens, context_lens, block_tables,
                                               self.block_size, self.k.device)
        return self.metadata

    def attend(self, layer_idx: int, q, k, v, positions=None):
        """q (1, H, M, D), k/v (1, Hkv, M, D) of the flattened batch -> (1, H, M, D). The slots
        and each query's context length come from `prepare`'s metadata (built from the same
        positions the runner passes to the model), so `positions` is not read again here."""
        if q.shape[0] != 1:
            raise ValueError(f"paged attention expects a flattened batch (1, H, M, D), got {tuple(q.shape)}")
        M, Hkv = q.shape[2], k.shape[1]
        out = self._attend(layer_idx, q[0].transpose(0, 1), k.transpose(1, 2).reshape(M, -1),
                           v.transpose(1, 2).reshape(M, -1), Hkv)             # (M, H, D)
        return out.transpose(0, 1)[None]                                      # (1, H, M, D)

    def attend_rows(self, layer_idx: int, q, k, v):
        """`attend` with one row per token: q (M, H, D), k/v (M, Hkv, D) -> (M, H, D). The same
        function without the heads-first transposes; the flat forward (kernels/flat_forward.py)
        calls it with views into its fused q/k/v projection."""
        if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
            raise ValueError(f"attend_rows expects q (M, H, D) and k, v (M, Hkv, D), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        M = q.shape[0]
        return self._attend(layer_idx, q, k.reshape(M, -1), v.reshape(M, -1), k.shape[1])

    def _attend(self, layer_idx: int, q, k_rows, v_rows, Hkv: int):
        """q (M, H, D), new K/V rows (M, Hkv * D) -> (M, H, D): write, then attend."""
        meta = self.metadata
        if meta is None:
            raise RuntimeError("PagedKVCache.attend called before prepare(...)")
        M = q.shape[0]
        if M != meta.num_tokens:
            raise ValueError(f"{M} new tokens passed, but prepare(...) described a step of "
                             f"{meta.num_tokens} (the sum of query_lens)")
        k_slots, v_slots = self._k_slots[layer_idx], self._v_slots[layer_idx]   # (N*P, Hkv*D)
        _write_slots(k_slots, v_slots, k_rows, v_rows, meta.slot_mapping)
        if self._plan_meta is not meta:     # a new step: which path, and its plan, once
            self._plan_meta, self._decode_plan = meta, None
            if M == len(meta.query_lens) and self._flash_decoding(q, meta):
                from minillm.attention.flash_decoding import CHUNK, DecodePlan
                self._decode_plan = DecodePlan.from_metadata(meta, Hkv, CHUNK,
                                                             self.config.max_seq_len)
        if self._decode_plan is not None:
            from minillm.attention.flash_decoding import flash_decode
            return flash_decode(q, k_slots, v_slots, Hkv, self._decode_plan)   # (M, H, D)
        return _attend_rows(q, k_slots, v_slots, Hkv, meta)                   # (M, H, D)

    def _flash_decoding(self, q, meta) -> bool:
        """Whether this decode-only step goes through flash-decoding: always with that backend;
        with "auto" when the longest context spans more than one chunk and the step's keys
        (batch x longest context) reach this machine's timed crossover (timed once, cached)."""
        if self.attention_backend != "auto":
            return self.attention_backend == "flash_decoding"
        from minillm.attention.flash_decoding import CHUNK
        B, _, Sg = meta.groups[0].shape
        if Sg <= CHUNK:
            return False
        if self._threshold is False:                       # not asked yet in this cache's life
            from minillm.attention.backend_tuning import decode_threshold
            self._threshold = decode_threshold(q.shape[1], self.config.n_kv_head,
                                               self.config.head_dim, q.dtype, q.device)
        return self._threshold is not None and B * Sg >= self._threshold

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: copy block src to dst in every layer, for each (src, dst) pair."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        for k, v in self._pairs():
            k[:, dst] = k[:, src]
            v[:, dst] = v[:, src]

    def swap_out(self, block_ids):
        """Copy blocks to CPU memory, in the pool's own format: (2, L, len(block_ids), P, Hkv, D),
        or for a quantized cache (that codes tensor, the scales (2, L, len(block_ids), P, Hkv))."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        saved = tuple(torch.stack([k[:, idx], v[:, idx]]).to("cpu") for k, v in self._pairs())
        return saved if self.k_scale is not None else saved[0]

    def swap_in(self, data, block_ids, first: int = 0) -> None:
        """Write blocks `first:` of what `swap_out` saved back into (possibly other) blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        for (k, v), d in zip(self._pairs(), data if isinstance(data, tuple) else (data,)):
            k[:, idx] = d[0, :, first:].to(k.device)
            v[:, idx] = d[1, :, first:].to(v.device)
