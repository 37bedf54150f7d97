"""The paged KV cache: one K pool and one V pool per layer, written and read through block tables.

Letters: L layers, N blocks in the pool, P block size (tokens per block), Hkv kv heads, H query
heads, D head dim, M new tokens of a step (flattened over its sequences).

`PagedKVCache` holds every layer's pools stacked as `(L, N, P, Hkv, D)` (one pool's layout is
defined in attention/paged.py) and follows the model's cache protocol: the runner calls
`prepare(query_lens, context_lens, block_tables)` once per step (building the
`PagedAttentionMetadata`), then every layer calls `attend` (or `attend_rows`). The cache's
`BackendChoice` (attention/backends.py) picks per step the paged path or, for a decode-only step,
flash-decoding. Block tables come from the `BlockManager`; this class never picks a block. With
`kv_cache_dtype` "int8" / "fp8" each pool is a `KVSlots` (kv_storage.py) holding one-byte codes.
`CacheSpec` describes a pool, so the engine's runner and each tensor-parallel worker make their own;
`move_blocks` is a step's swaps and copies, in one order for both.

Left out on purpose: swapping to disk (swap_out keeps blocks in CPU memory), pools that grow,
and a fused kernel (see attention/paged.py).
"""
from dataclasses import dataclass

import torch

from minillm.attention.backends import BackendChoice
from minillm.attention.flash_decoding import flash_decode
from minillm.attention.metadata import PagedAttentionMetadata
from minillm.attention.paged import attend_slot_rows, write_slots
from minillm.model.config import ModelConfig
from minillm.paging.kv_storage import kv_dtype_bytes, kv_pools


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
        # "flash_decoding": decode-only steps split the context into chunks merged by their
        # log-sum-exp (minillm/attention/flash_decoding.py); steps with a prefill chunk stay paged
        self.backend = BackendChoice(attention_backend, config.n_kv_head, config.head_dim,
                                     config.max_seq_len)
        self.attention_backend = attention_backend
        self._decode_plan = self._plan_meta = None          # built once per step, for every layer
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
        else:   # codes (L, N, P, Hkv, D) + scales (L, N, P, Hkv), quantized on write (kv_storage.py)
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
            elem = kv_dtype_bytes(kv_cache_dtype, config.head_dim, dtype)
        return round(2 * config.n_layer * block_size * config.n_kv_head * config.head_dim * elem)

    def pools(self) -> list:
        """(K, V) pools in block order: the values, then the scales when quantized."""
        return [(self.k, self.v)] + ([(self.k_scale, self.v_scale)] if self.k_scale is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.pools())

    def prepare(self, query_lens, context_lens, block_tables,
                tree_parents=None) -> PagedAttentionMetadata:
        """The step's metadata; `tree_parents` (None, or per sequence None or the parents of its
        new tokens) gives a sequence verifying a token tree its tree mask (metadata.py)."""
        self.metadata = PagedAttentionMetadata(query_lens, context_lens, block_tables,
                                               self.block_size, self.k.device, tree_parents)
        return self.metadata

    def move_slots(self, src, dst) -> None:
        """Copy the K/V (codes and scales as stored) of slots `src` to slots `dst` in every layer,
        all read before any is written: the accepted path of a token tree moved to the slots
        plain decoding would have used (overlapping lists are safe)."""
        if len(src) != len(dst):
            raise ValueError(f"src and dst must have one length, got {len(src)}, {len(dst)}")
        if not len(src):
            return
        s = torch.as_tensor(src, dtype=torch.long, device=self.k.device)
        d = torch.as_tensor(dst, dtype=torch.long, device=self.k.device)
        for pools in self.pools():
            for pool in pools:                       # (L, N, P, ...) viewed as (L, N*P, ...)
                flat = pool.view(pool.shape[0], -1, *pool.shape[3:])
                flat[:, d] = flat[:, s]

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
        write_slots(k_slots, v_slots, k_rows, v_rows, meta.slot_mapping)
        if self._plan_meta is not meta:     # a new step: which path, and its plan, once
            self._plan_meta, self._decode_plan = meta, self.backend.decode_plan(q, meta)
        if self._decode_plan is not None:
            return flash_decode(q, k_slots, v_slots, Hkv, self._decode_plan)   # (M, H, D)
        return attend_slot_rows(q, k_slots, v_slots, Hkv, meta)               # (M, H, D)

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: copy block src to dst in every layer, for each (src, dst) pair."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        for k, v in self.pools():
            k[:, dst] = k[:, src]
            v[:, dst] = v[:, src]

    def swap_out(self, block_ids):
        """Copy blocks to CPU memory, in the pool's own format: (2, L, len(block_ids), P, Hkv, D),
        or for a quantized cache (that codes tensor, the scales (2, L, len(block_ids), P, Hkv))."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        saved = tuple(torch.stack([k[:, idx], v[:, idx]]).to("cpu") for k, v in self.pools())
        return saved if self.k_scale is not None else saved[0]

    def swap_in(self, data, block_ids, first: int = 0) -> None:
        """Write blocks `first:` of what `swap_out` saved back into (possibly other) blocks."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        for (k, v), d in zip(self.pools(), data if isinstance(data, tuple) else (data,)):
            k[:, idx] = d[0, :, first:].to(k.device)
            v[:, idx] = d[1, :, first:].to(v.device)

    def move_blocks(self, swap_out, copies, swap_in, swapped) -> None:
        """A step's block moves, in this order: swap-outs [(key, blocks)], copy-on-write copies
        [(src, dst)], swap-ins [(key, blocks, first)]. `swapped` holds each key's CPU copy (a
        swap-out sets it, a swap-in pops it): the engine keys by sequence, a TP worker by seq_id."""
        for key, blocks in swap_out:
            swapped[key] = self.swap_out(blocks)
        self.copy_blocks(copies)
        for key, blocks, first in swap_in:
            self.swap_in(swapped.pop(key), blocks, first)


@dataclass
class CacheSpec:
    """How to make a paged pool: the engine's pool settings, made for a model's (or a tensor-
    parallel shard's) config on a device. The engine's runner and each TP worker make theirs."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    attention_backend: str = "paged"

    @classmethod
    def for_engine(cls, config, num_blocks: int, dtype: torch.dtype) -> "CacheSpec":
        """An `EngineConfig`'s pool (read by attribute) of `num_blocks` blocks in `dtype`."""
        return cls(num_blocks, config.block_size, dtype, config.kv_cache_dtype,
                   config.attention_backend)

    def make(self, model_cfg: ModelConfig, device=None) -> PagedKVCache:
        return PagedKVCache(model_cfg, self.num_blocks, self.block_size, device, self.dtype,
                            self.kv_cache_dtype, self.attention_backend)
