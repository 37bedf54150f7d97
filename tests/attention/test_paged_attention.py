"""Paged attention == dense attention (independent matmul + softmax), over random block tables,
block sizes 1..32, ragged prefill/decode mixes and GQA; and the cache's write/copy/swap paths."""
import random

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.attention.metadata import PagedAttentionMetadata, long_tensor
from minillm.attention.paged import dense_attention, paged_attention, ragged_dense_attention, write_kv
from minillm.paging.paged_cache import PagedKVCache


def _random_batch(rng, block_size, n_head, n_kv_head, dtype, max_ctx=40, num_seqs=None):
    """Random ragged batch: K/V per sequence written into a pool through shuffled block tables."""
    D = 8
    B = num_seqs or rng.randint(1, 6)
    ctx = [rng.randint(1, max_ctx) for _ in range(B)]
    qlen = [rng.choice([1, rng.randint(1, c)]) for c in ctx]
    need = [-(-c // block_size) for c in ctx]
    N = sum(need) + rng.randint(0, 5)
    ids = list(range(N))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n] + [ids[-1]] * rng.randint(0, 2))  # spare entries are ignored
        at += n
    g = torch.Generator().manual_seed(rng.randint(0, 10**6))
    ks = [torch.randn(c, n_kv_head, D, generator=g, dtype=dtype) for c in ctx]
    vs = [torch.randn(c, n_kv_head, D, generator=g, dtype=dtype) for c in ctx]
    q = torch.randn(sum(qlen), n_head, D, generator=g, dtype=dtype)
    k_pool = torch.full((N, block_size, n_kv_head, D), float("nan"), dtype=dtype)
    v_pool = torch.full((N, block_size, n_kv_head, D), float("nan"), dtype=dtype)
    # write all context tokens (not only the new ones) through the slot formula
    full = PagedAttentionMetadata(ctx, ctx, tables, block_size)
    write_kv(k_pool, v_pool, torch.cat(ks), torch.cat(vs), full.slot_mapping)
    meta = PagedAttentionMetadata(qlen, ctx, tables, block_size)
    return q, ks, vs, qlen, k_pool, v_pool, meta


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_equals_dense_float64(block_size, heads):
    rng = random.Random(block_size * 100 + heads[1])
    for _ in range(5):
        q, ks, vs, qlen, kp, vp, meta = _random_batch(rng, block_size, *heads, torch.float64)
        ref = ragged_dense_attention(q, ks, vs, qlen)
        out = paged_attention(q, kp, vp, meta)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_paged_equals_dense_float32():
    rng = random.Random(7)
    for _ in range(20):
        bs = rng.randint(1, 32)
        q, ks, vs, qlen, kp, vp, meta = _random_batch(rng, bs, 8, 2, torch.float32, max_ctx=80)
        ref = ragged_dense_attention(q.double(), [k.double() for k in ks],
                                     [v.double() for v in vs], qlen)
        torch.testing.assert_close(paged_attention(q, kp, vp, meta).double(), ref,
                                   rtol=1e-5, atol=1e-5)


def test_dense_reference_matches_sdpa():
    """The reference itself agrees with torch's causal SDPA when T == S."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(dense_attention(q, k, v), ref, rtol=0, atol=1e-12)


def test_metadata_bad_input():
    with pytest.raises(ValueError, match="query_len"):
        PagedAttentionMetadata([3], [2], [[0]], 4)
    with pytest.raises(ValueError, match="cannot hold"):
        PagedAttentionMetadata([1], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="non-empty"):
        PagedAttentionMetadata([], [], [], 4)


def _cache_config():
    return ModelConfig(n_layer=2, n_head=4, n_kv_head=2, head_dim=8, d_model=32, d_ff=64,
                       vocab_size=64, max_seq_len=128)


@pytest.mark.parametrize("rows", [False, True])
def test_cache_attend_incremental_matches_dense(rows):
    """Prefill in chunks then decode through `attend` (heads first) or `attend_rows` (one row
    per token, as the flat forward calls it): each step equals dense attention."""
    cfg = _cache_config()
    cache = PagedKVCache(cfg, num_blocks=10, block_size=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    tables = [[7, 2, 9, 0], [4, 1, 8]]
    total = [0, 0]
    ks = [torch.empty(0, 2, 8, dtype=torch.float64) for _ in range(2)]
    vs = [torch.empty(0, 2, 8, dtype=torch.float64) for _ in range(2)]
    for step_lens in ([5, 2], [4, 3], [1, 1], [1, 1]):
        ctx = [t + n for t, n in zip(total, step_lens)]
        cache.prepare(step_lens, ctx, tables)
        M = sum(step_lens)
        q = torch.randn(1, 4, M, 8, generator=g, dtype=torch.float64)
        k = torch.randn(1, 2, M, 8, generator=g, dtype=torch.float64)
        v = torch.randn(1, 2, M, 8, generator=g, dtype=torch.float64)
        if rows:
            out = cache.attend_rows(1, *(t[0].transpose(0, 1) for t in (q, k, v)))
            out = out.transpose(0, 1)[None]                                 # (1, H, M, D)
        else:
            out = cache.attend(1, q, k, v)
        kk, vv = k[0].transpose(0, 1).split(step_lens), v[0].transpose(0, 1).split(step_lens)
        ks = [torch.cat([a, b]) for a, b in zip(ks, kk)]
        vs = [torch.cat([a, b]) for a, b in zip(vs, vv)]
        ref = ragged_dense_attention(q[0].transpose(0, 1), ks, vs, step_lens)
        torch.testing.assert_close(out[0].transpose(0, 1), ref, rtol=0, atol=1e-12)
        total = ctx


def test_attend_bad_input():
    cfg = _cache_config()
    cache = PagedKVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float64)
    q, kv = torch.zeros(3, 4, 8, dtype=torch.float64), torch.zeros(3, 2, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="prepare"):
        cache.attend_rows(0, q, kv, kv)
    cache.prepare([2], [2], [[0]])
    with pytest.raises(ValueError, match="sum of query_lens"):        # 3 tokens, a step of 2
        cache.attend_rows(0, q, kv, kv)
    with pytest.raises(ValueError, match="flattened batch"):
        cache.attend(0, q[None].expand(2, -1, -1, -1).transpose(1, 2), kv[None].transpose(1, 2),
                     kv[None].transpose(1, 2))
    with pytest.raises(ValueError, match=r"q \(M, H, D\)"):
        cache.attend_rows(0, q[None], kv, kv)
    with pytest.raises(ValueError, match=r"k, v \(M, Hkv, D\)"):
        cache.attend_rows(0, q[:2], kv[:2], kv[:1])
    out = cache.attend_rows(0, q[:2], kv[:2], kv[:2])                 # and still serves
    assert out.shape == (2, 4, 8)


def test_copy_and_swap_blocks():
    cfg = _cache_config()
    cache = PagedKVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float64)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    before = cache.k[:, 2].clone()
    cache.copy_blocks([(2, 5)])
    torch.testing.assert_close(cache.k[:, 5], before, rtol=0, atol=0)
    saved = cache.swap_out([1, 3])
    assert saved.shape == (2, 2, 2, 4, 2, 8)
    k1 = cache.k[:, 1].clone()
    cache.k.zero_()
    cache.swap_in(saved, [4, 0])
    torch.testing.assert_close(cache.k[:, 4], k1, rtol=0, atol=0)
    assert PagedKVCache.bytes_per_block(cfg, 4, torch.float64) == cache.nbytes // 6


@pytest.mark.slow
def test_real_model_paged_cache_matches_contiguous_generate(smollm2):
    """SmolLM2 (fp32) decoding through a paged cache with a shuffled block table gives the same
    greedy tokens as `minillm.generate` with the contiguous cache."""
    from minillm import generate
    model, tok = smollm2
    prompt = tok.encode("The capital of France is")
    n_new, P = 12, 4
    cache = PagedKVCache(model.config, num_blocks=16, block_size=P, dtype=model.dtype)
    table = random.Random(0).sample(range(16), 16)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for step in range(n_new):
            new = ids if step == 0 else ids[-1:]
            start = len(ids) - len(new)
            cache.prepare([len(new)], [len(ids)], [table])
            logits = model(torch.tensor([new]), positions=torch.arange(start, len(ids)),
                           cache=cache, logits_index=torch.tensor([len(new) - 1]))
            ids.append(int(logits[0, -1].argmax()))
            out.append(ids[-1])
    assert out == generate(model, prompt, n_new)


# The per-step metadata takes shortcuts in common cases: no mask when every query sees every key,
# no query gather / output scatter when one group is the whole batch. Each case is checked
# against F.scaled_dot_product_attention run on each sequence alone, through `paged_attention`
# and through `PagedKVCache.attend` (its precomputed per-layer views), with every slot that was
# never written holding NaN: a padding key that read one would poison its row.
FAST_PATHS = {   # name: (query_lens, context_lens, expected (mask is None, whole) per group)
    "batch1_decode": ([1], [21], [(True, True)]),
    "equal_decodes": ([1, 1, 1], [9, 9, 9], [(True, True)]),
    "ragged_decodes": ([1, 1, 1], [3, 17, 9], [(False, True)]),
    "one_prefill_chunk": ([6], [6], [(False, True)]),
    "later_chunk": ([4], [13], [(False, True)]),
    "equal_chunks": ([3, 3], [3, 8], [(False, True)]),
    "mixed": ([1, 5, 1, 2], [7, 5, 12, 9], [(False, False), (False, False)]),
}


def _sdpa_reference(q, ks, vs, query_lens):
    """Per sequence: SDPA of its T queries (at positions S - T ..) over its S keys, boolean mask."""
    outs, start = [], 0
    for k, v, t in zip(ks, vs, query_lens):
        s = k.shape[0]
        allowed = torch.arange(s) <= (s - t + torch.arange(t))[:, None]          # (T, S)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + t].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=allowed, enable_gqa=True)                                  # (H, T, D)
        outs.append(o.transpose(0, 1))
        start += t
    return torch.cat(outs)                                                      # (M, H, D)


@pytest.mark.parametrize("case", sorted(FAST_PATHS))
def test_metadata_fast_paths_match_sdpa(case):
    qlens, ctxs, expected = FAST_PATHS[case]
    cfg, P = _cache_config(), 4
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    cache = PagedKVCache(cfg, num_blocks=24, block_size=P, dtype=torch.float64)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    ids = random.Random(len(case)).sample(range(24), 24)
    tables, at = [], 0
    for c in ctxs:                                   # shuffled blocks + one spare entry each
        n = -(-c // P)
        tables.append(ids[at:at + n] + [ids[-1]])
        at += n
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(c, Hkv, D, generator=g, dtype=torch.float64) for c in ctxs]
    vs = [torch.randn(c, Hkv, D, generator=g, dtype=torch.float64) for c in ctxs]
    q = torch.randn(sum(qlens), H, D, generator=g, dtype=torch.float64)
    old = [c - t for c, t in zip(ctxs, qlens)]       # the context cached before this step
    if any(old):
        past = PagedAttentionMetadata([o for o in old if o], [o for o in old if o],
                                      [tab for tab, o in zip(tables, old) if o], P)
        write_kv(cache.k[1], cache.v[1], torch.cat([k[:o] for k, o in zip(ks, old)]),
                 torch.cat([v[:o] for v, o in zip(vs, old)]), past.slot_mapping)
    meta = cache.prepare(qlens, ctxs, tables)
    assert [(grp.mask is None, grp.whole) for grp in meta.groups] == expected
    new_k = torch.cat([k[o:] for k, o in zip(ks, old)])                     # (M, Hkv, D)
    new_v = torch.cat([v[o:] for v, o in zip(vs, old)])
    out = cache.attend(1, q.transpose(0, 1)[None], new_k.transpose(0, 1)[None],
                       new_v.transpose(0, 1)[None])[0].transpose(0, 1)       # (M, H, D)
    ref = _sdpa_reference(q, ks, vs, qlens)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(paged_attention(q, cache.k[1], cache.v[1], meta), ref,
                               rtol=0, atol=1e-12)
    assert torch.isnan(cache.k[0]).all()             # layer 0 was never written


def test_long_tensor():
    t = long_tensor([3, -1, 2**40])
    assert t.dtype == torch.long and t.tolist() == [3, -1, 2**40]
    assert long_tensor([]).shape == (0,)
