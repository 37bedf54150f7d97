"""The contiguous KV cache: one preallocated (n_layer, B, Hkv, S_max, D) tensor for K and one for V.

Every sequence reserves S_max slots up front: simple and fast, and exactly the waste that chapter
2 measures and chapter 3's paged cache removes. All rows of the batch share their positions.

The cache protocol (every cache in minillm follows it): the model calls
`cache.attend(layer_idx, q, k, v, positions)` in each layer; the cache stores the new k and v at
their `positions` and returns each query's attention over keys at positions up to its own. The
cache keeps no length: rolling back rejected drafts is writing at earlier positions next time.
- `KVCache` slices the slots up to the last position (one host read per pass) and needs no mask
  for a single new token;
- `StaticKVCache` attends over all S_max slots with a position mask, so no value leaves the
  device and a CUDA graph can capture the step.
What depends only on positions is worked out once per pass, by the first layer, and reused.

Left out on purpose: ragged batches (the paged cache's job).
"""
import torch
import torch.nn.functional as F

from minillm._validate import check_int
from minillm.model.config import ModelConfig


class KVCache:
    masked = False              # True: attend over every slot with a position mask (no host sync)

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        check_int("batch_size", batch_size, 1)
        check_int("max_seq_len", max_seq_len, 1, config.max_seq_len)
        shape = (config.n_layer, batch_size, config.n_kv_head, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)    # (L, B, Hkv, S_max, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots = torch.arange(max_seq_len, device=self.k.device)   # (S_max,)
        self.n_layer, self.max_seq_len = config.n_layer, max_seq_len
        self._pass = None       # (positions, pos (T,), end, mask) of the current forward pass

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def truncate(self, num_tokens: int) -> None:
        """Kept for code written against earlier versions, where the cache counted its tokens.
        Positions now say where every token goes, so a rollback needs no call: the next forward
        pass at position `num_tokens` overwrites what follows. Only checks the range."""
        if not 0 <= num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens must be in [0, {self.max_seq_len}], got {num_tokens}")

    def attend(self, layer_idx: int, q, k, v, positions):
        # q (B, H, T, D), k/v (B, Hkv, T, D), positions (1, T) shared by the rows -> (B, H, T, D)
        if positions.dim() != 2 or positions.shape[0] != 1 or positions.shape[1] != q.shape[2]:
            raise ValueError(f"KVCache rows share positions: pass positions of shape (T,) or (1, T) "
                             f"with T = {q.shape[2]}, got {tuple(positions.shape)}")
        if layer_idx == 0 or self._pass is None or self._pass[0] is not positions:
            self._pass = (positions, *self._plan(positions[0], q.shape[2], q.dtype))
        _, pos, end, mask = self._pass
        self.k[layer_idx].index_copy_(2, pos, k)                   # (B, Hkv, T, D) at pos
        self.v[layer_idx].index_copy_(2, pos, v)
        keys, values = self.k[layer_idx], self.v[layer_idx]        # (B, Hkv, S_max, D)
        if end is not None:                                        # the slots up to the last query
            keys, values = keys[:, :, :end], values[:, :, :end]    # (B, Hkv, S, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])

    def _plan(self, pos, T: int, dtype):
        """pos (T,) -> (pos, end, mask) for every layer of one forward pass: `end` the slots
        read (None: all of them, masked), `mask` (T, S) as 0 (seen) / -inf (hidden) in the
        queries' dtype, or None (a single query sees every slot read). A boolean mask would be
        turned into that same 0 / -inf tensor inside SDPA again in every layer."""
        if self.masked:                                            # every slot, masked by position
            end, seen = None, self.slots <= pos[:, None]           # (T, S_max)
        else:
            end = int(pos[-1]) + 1
            if end > self.max_seq_len:
                raise ValueError(f"KV cache full: position {end - 1} >= max_seq_len {self.max_seq_len}")
            seen = None if T == 1 else self.slots[:end] <= pos[:, None]   # (T, S)
        mask = None if seen is None else torch.zeros(seen.shape, dtype=dtype, device=seen.device
                                                     ).masked_fill_(~seen, float("-inf"))
        return pos, end, mask

class StaticKVCache(KVCache):
    """A KVCache that reads every slot through a position mask: no host sync, graph-capturable."""
    masked = True
