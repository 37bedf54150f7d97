"""The contiguous KV cache: one preallocated (n_layer, B, Hkv, S_max, D) tensor for K and one for V.

Every sequence in the batch reserves S_max slots up front, whatever it ends up using: simple and
fast, and exactly the waste that chapter 2 measures and chapter 3's paged cache removes. All rows
of the batch share one length (`seq_len`); ragged batches are the paged cache's job.
"""
import torch
import torch.nn.functional as F

from minillm.model.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 device=None, dtype: torch.dtype = torch.float32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_seq_len <= config.max_seq_len:
            raise ValueError(f"max_seq_len must be in [1, {config.max_seq_len}], got {max_seq_len}")
        shape = (config.n_layer, batch_size, config.n_kv_head, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)    # (L, B, Hkv, S_max, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.n_layer, self.max_seq_len = config.n_layer, max_seq_len
        self.seq_len = 0                                           # tokens stored per row

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def truncate(self, num_tokens: int) -> None:
        """Forget everything after the first `num_tokens` tokens (speculative-decoding rollback)."""
        if not 0 <= num_tokens <= self.seq_len:
            raise ValueError(f"num_tokens must be in [0, {self.seq_len}], got {num_tokens}")
        self.seq_len = num_tokens

    def attend(self, layer_idx: int, q, k, v):
        # q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D)
        T, start = q.shape[2], self.seq_len
        end = start + T
        if end > self.max_seq_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > max_seq_len {self.max_seq_len}")
        self.k[layer_idx, :, :, start:end] = k
        self.v[layer_idx, :, :, start:end] = v
        keys, values = self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]  # (B, Hkv, S, D)
        gqa = keys.shape[1] != q.shape[1]
        if T == 1:  # one new token sees the whole context: no mask needed
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        else:       # query i (absolute position start + i) sees keys 0..start + i
            mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        if layer_idx == self.n_layer - 1:
            self.seq_len = end
        return out
