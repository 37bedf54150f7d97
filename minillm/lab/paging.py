"""Chapter 3: paged attention timed against the block size, beside contiguous SDPA.

Letters: B sequences, S context length, H query heads, Hkv kv heads, D head dim, N blocks,
P block size.

`time_paged_vs_block_size` builds, for each block size P, a pool whose blocks are shuffled (a
long-running server's pool is fragmented) holding B contexts of S tokens, and times one decode
step of `paged_attention` over it (B queries, one per sequence) and SDPA over the same shapes
stored contiguously. The candidates take turns, round after round, and each keeps its fastest
round: a burst of other work on a shared machine then slows every candidate alike instead of
one. Timings are for the reader's machine; nothing here asserts a speed.

Left out on purpose: a fused paged kernel (minillm gathers into a dense tensor, see
minillm.paging.paged_cache) and GPU timing.
"""
import random
import time

import torch
import torch.nn.functional as F

from minillm.attention.metadata import PagedAttentionMetadata
from minillm.attention.paged import paged_attention


def _best_ms(fns: dict, rounds: int) -> dict:
    best = {name: float("inf") for name in fns}
    for r in range(rounds + 1):                       # round 0 is a warm-up
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r:
                best[name] = min(best[name], dt)
    return {name: 1e3 * t for name, t in best.items()}


def time_paged_vs_block_size(block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), batch: int = 16,
                             context_len: int = 1024, n_head: int = 9, n_kv_head: int = 3,
                             head_dim: int = 64, rounds: int = 15, seed: int = 0) -> dict:
    """{"dense": ms, P: ms for each block size}: fastest of `rounds` decode steps, fp32, on CPU.
    Defaults: SmolLM2-135M's attention shape (9 query heads, 3 kv heads of 64)."""
    for name, v in (("batch", batch), ("context_len", context_len), ("n_head", n_head),
                    ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("rounds", rounds)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if n_head % n_kv_head:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
    if not block_sizes or any(not isinstance(p, int) or p < 1 for p in block_sizes):
        raise ValueError(f"block_sizes must be ints >= 1, got {block_sizes!r}")
    B, S, H, Hkv, D = batch, context_len, n_head, n_kv_head, head_dim
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)                                     # (B, H, D)
    k = torch.randn(B, Hkv, S, D, generator=g)                                # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D, generator=g)
    fns = {"dense": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)}
    for P in block_sizes:
        nb = -(-S // P)                                                       # blocks per sequence
        ids = list(range(B * nb))
        random.Random(seed + P).shuffle(ids)                                  # a fragmented pool
        tables = [ids[i * nb:(i + 1) * nb] for i in range(B)]
        k_pool = torch.randn(B * nb, P, Hkv, D, generator=g)                  # (N, P, Hkv, D)
        v_pool = torch.randn(B * nb, P, Hkv, D, generator=g)
        meta = PagedAttentionMetadata([1] * B, [S] * B, tables, block_size=P)
        fns[P] = lambda kp=k_pool, vp=v_pool, m=meta: paged_attention(q, kp, vp, m)
    return _best_ms(fns, rounds)
