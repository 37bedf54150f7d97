"""Flash-decoding (minillm/attention/flash_decoding.py): checked per sequence against
`dense_attention` (plain matmul + softmax over that sequence's own keys), the merge against a
softmax written here, the engine option against the paged engine and `generate`, bad input, and
a planted bug (a merge without the max shift) that the merge check must catch."""
import math

import pytest
import torch

from minillm import generate, tiny_model
from minillm.attention.flash_decoding import DecodePlan, flash_decode, merge_partials
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.attention.metadata import PagedAttentionMetadata
from minillm.attention.paged import dense_attention, paged_attention
from minillm.paging.paged_cache import PagedKVCache

H, HKV, D, P, N = 9, 3, 16, 4, 64        # SmolLM2's GQA 9/3, small head dim and blocks


def _batch(lens, dtype, seed=0):
    """Random pools (N, P, Hkv, D), one query per sequence (B, H, D), shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, P, HKV, D, generator=g, dtype=dtype)
    v = torch.randn(N, P, HKV, D, generator=g, dtype=dtype)
    q = torch.randn(len(lens), H, D, generator=g, dtype=dtype)
    free, tables = torch.randperm(N, generator=g).tolist(), []
    for n in lens:
        nb = -(-n // P)
        tables.append(free[:nb])
        free = free[nb:]
    return q, k, v, tables


def _dense_per_sequence(q, k, v, lens, tables):
    """Each sequence alone: its keys picked slot by slot, then dense_attention -> (B, H, D)."""
    rows = []
    for i, (n, t) in enumerate(zip(lens, tables)):
        slots = torch.tensor([t[p // P] * P + p % P for p in range(n)])
        ki = k.view(N * P, HKV, D)[slots].transpose(0, 1)                     # (Hkv, S, D)
        vi = v.view(N * P, HKV, D)[slots].transpose(0, 1)
        rows.append(dense_attention(q[i][:, None], ki, vi)[:, 0])             # (H, D)
    return torch.stack(rows)


LENS = [1, 5, 16, 37, 70]                 # ragged: one key, inside a block, whole blocks, odd


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 7, 16, 64, 500])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_equals_dense_per_sequence_and_paged(chunk, dtype, tol):
    q, k, v, tables = _batch(LENS, dtype)
    meta = PagedAttentionMetadata([1] * len(LENS), LENS, tables, P)
    out = flash_decode(q, k.view(N * P, -1), v.view(N * P, -1), HKV, meta, chunk=chunk)
    assert out.shape == (len(LENS), H, D) and out.dtype == dtype
    torch.testing.assert_close(out, _dense_per_sequence(q, k, v, LENS, tables), atol=tol, rtol=0)
    torch.testing.assert_close(out, paged_attention(q, k, v, meta), atol=tol, rtol=0)


@pytest.mark.parametrize("chunk,tile_keys", [(8, 1), (8, 45), (3, 60), (16, 10_000)])
def test_tiles_and_plans_from_tables_equal_dense(chunk, tile_keys):
    """Chunks computed tile by tile (1 chunk per tile .. all in one) give the same answer."""
    q, k, v, tables = _batch(LENS, torch.float64, seed=3)
    meta = PagedAttentionMetadata([1] * len(LENS), LENS, tables, P)
    want = _dense_per_sequence(q, k, v, LENS, tables)
    for plan in (DecodePlan.from_tables(LENS, tables, P, HKV, chunk, tile_keys=tile_keys),
                 DecodePlan.from_metadata(meta, HKV, chunk, tile_keys=tile_keys)):
        for _ in range(2):                       # the plan's buffers are reused by a 2nd layer
            out = flash_decode(q, k.view(N * P, -1), v.view(N * P, -1), HKV, plan)
            torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def _softmax_mean(scores, values):
    """The trusted answer: softmax over all scores (n,), weights applied to values (n, D)."""
    w = [math.exp(s - max(scores)) for s in scores]
    return [sum(wi * values[i][d] for i, wi in enumerate(w)) / sum(w) for d in range(len(values[0]))]


def _merge_matches_softmax(merge) -> bool:
    """Split 12 large scores (~800: exp overflows float64 past 709 without a shift) into 3 parts,
    merge their partials with `merge`, and compare with one softmax over all of them."""
    g = torch.Generator().manual_seed(1)
    scores = (800 + 3 * torch.randn(12, generator=g, dtype=torch.float64)).tolist()
    values = torch.randn(12, 4, generator=g, dtype=torch.float64)
    outs, lses = [], []
    for part in (slice(0, 5), slice(5, 6), slice(6, 12)):
        s = torch.tensor(scores[part], dtype=torch.float64)
        lses.append(torch.logsumexp(s, 0))
        outs.append(torch.softmax(s, 0) @ values[part])                       # (4,)
    out, lse = merge(torch.stack(outs), torch.stack(lses))
    want = torch.tensor(_softmax_mean(scores, values.tolist()), dtype=torch.float64)
    want_lse = max(scores) + math.log(sum(math.exp(s - max(scores)) for s in scores))
    return (bool(torch.allclose(out, want, atol=1e-12, rtol=0))
            and math.isclose(float(lse), want_lse, rel_tol=1e-12))


def _merge_without_shift(outs, lses):
    """A planted bug: the textbook merge without subtracting the largest lse first."""
    w = torch.exp(lses)
    return (w[:, None] * outs).sum(0) / w.sum(), torch.log(w.sum())


def _merge_with_max_as_lse(outs, lses):
    """A planted bug: each part's weight from its max score alone (a wrong lse)."""
    return merge_partials(outs, lses - torch.log(torch.tensor([5.0, 1.0, 6.0], dtype=lses.dtype)))


def test_merge_identity_and_planted_bugs():
    assert _merge_matches_softmax(merge_partials)
    assert not _merge_matches_softmax(_merge_without_shift)
    assert not _merge_matches_softmax(_merge_with_max_as_lse)


def test_merge_is_associative_and_skips_empty_parts():
    g = torch.Generator().manual_seed(2)
    outs, lses = torch.randn(6, 3, 5, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g,
                                                                                  dtype=torch.float64)
    whole, whole_lse = merge_partials(outs, lses)
    a, la = merge_partials(outs[:2], lses[:2])
    b, lb = merge_partials(outs[2:], lses[2:])
    two, two_lse = merge_partials(torch.stack([a, b]), torch.stack([la, lb]))
    torch.testing.assert_close(two, whole, atol=1e-13, rtol=0)
    torch.testing.assert_close(two_lse, whole_lse, atol=1e-13, rtol=0)
    out, _ = merge_partials(torch.cat([outs, torch.zeros(1, 3, 5, dtype=torch.float64)]),
                            torch.cat([lses, torch.full((1, 3), -math.inf, dtype=torch.float64)]))
    torch.testing.assert_close(out, whole, atol=1e-13, rtol=0)      # a part that saw no key


def test_bad_input_names_the_argument():
    q, k, v, tables = _batch(LENS, torch.float32)
    meta = PagedAttentionMetadata([1] * len(LENS), LENS, tables, P)
    ks, vs = k.view(N * P, -1), v.view(N * P, -1)
    with pytest.raises(ValueError, match="chunk"):
        flash_decode(q, ks, vs, HKV, meta, chunk=0)
    with pytest.raises(ValueError, match="n_kv_head"):
        flash_decode(q, ks, vs, 2, meta)                      # 9 heads, 2 kv heads
    with pytest.raises(ValueError, match="max_context"):
        flash_decode(q, ks, vs, HKV, meta, max_context=64)    # a context of 70
    with pytest.raises(ValueError, match="block_tables"):
        DecodePlan.from_tables([9], [[0, 1]], 4, HKV, 8)          # 8 slots for 9 keys
    with pytest.raises(ValueError, match="tile_keys"):
        DecodePlan.from_tables([5], [[0, 1]], 4, HKV, 8, tile_keys=0)
    prefill = PagedAttentionMetadata([1, 3], [5, 16], tables[1:3], P)
    with pytest.raises(ValueError, match="decode-only"):
        flash_decode(q[:2], ks, vs, HKV, prefill)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend"):
        PagedKVCache(tiny_model().config, 4, 4, attention_backend="sdpa")


def test_engine_option_gives_the_same_greedy_tokens(monkeypatch):
    import minillm.paging.paged_cache as pc        # where the cache calls it
    calls = []
    real = pc.flash_decode
    monkeypatch.setattr(pc, "flash_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_model(vocab_size=128, seed=0, dtype=torch.float64)
    prompts = [[1, 2, 3], [5] * 40, list(range(10, 31)), [7]]
    refs = [generate(model, p, 12) for p in prompts]
    for backend in ("paged", "flash_decoding"):
        # 4-token chunks of prefill mix with decodes; blocks of 4 make every row ragged
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                               attention_backend=backend))
        assert engine.cache.attention_backend == backend
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == refs, backend
        assert bool(calls) == (backend == "flash_decoding")      # decode-only steps went there


def test_engine_option_with_int8_kv_matches_paged_int8():
    model = tiny_model(vocab_size=128, seed=0, dtype=torch.float64)
    prompts = [list(range(3, 40)), [9, 8, 7]]
    toks = {}
    for backend in ("paged", "flash_decoding"):
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, kv_cache_dtype="int8",
                                               attention_backend=backend))
        toks[backend] = [o.token_ids for o in engine.generate(
            prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
    assert toks["flash_decoding"] == toks["paged"]


def test_benchmarks_run_at_small_sizes():
    """A smoke test of the benchmark code (no timing is judged): rows, ratios and shares."""
    from minillm.analysis.roofline import Hardware
    from minillm.lab.attention_decode import decode_table, run_decode
    from minillm.lab.long_context import long_context_table, run_long_context
    table = run_decode(contexts=(20, 300), batches=(1, 2), rounds=1, repeat=1)
    assert [(r["batch"], r["context"]) for r in table["rows"]] == [(1, 20), (1, 300), (2, 20), (2, 300)]
    assert all(r["paged_over_sdpa"] > 0 and r["flashdec_ms"] > 0 for r in table["rows"])
    hw = Hardware("made up", {"fp32": 1e11}, mem_bandwidth=1e10, mem_bytes=1e10)
    model = tiny_model(vocab_size=64, seed=0)
    rec = run_long_context(model, hw, decode_contexts=(40, 300), prefill_lengths=(32,), rounds=1,
                           repeat=1)
    assert [r["context"] for r in rec["decode"]] == [40, 300]
    assert all(0 < r["paged"]["share"] and 0 < r["roofline_share"] < 1 for r in rec["decode"])
    assert "fd share" in long_context_table(rec) and "flashdec/sdpa" in decode_table(table)


@pytest.mark.slow
def test_real_model_flash_decoding_matches_paged_and_generate(smollm2):
    model, tok = smollm2
    long = tok.encode("The quick brown fox jumps over the lazy dog. " * 30)   # > one 256-key chunk
    prompts = [tok.encode("The capital of France is"), long]
    refs = [generate(model, p, 6) for p in prompts]
    outs = {}
    for backend in ("paged", "flash_decoding"):
        engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64, attention_backend=backend),
                           tokenizer=tok)
        outs[backend] = [o.token_ids for o in engine.generate(
            prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert outs["flash_decoding"] == outs["paged"] == refs


def test_chapter9_figures_draw_from_the_rows_the_chapter_measures():
    """viz.attention's three plots take the lab's rows (and a record's, dashed) and return a Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from minillm.viz.attention import plot_attention_share, plot_decode_attention, plot_peak_memory
    rows = [{"batch": b, "context": s, "paged_ms": 1.0 * s, "flashdec_ms": 0.8 * s, "sdpa_ms": 0.5 * s}
            for b in (1, 8) for s in (128, 1024)]
    share = [{"context": s, "paged": {"share": f}, "roofline_share": f / 2} for s, f in ((128, 0.1), (2048, 0.4))]
    figs = [plot_peak_memory([1024, 2048], [4e6, 16e6], [1e6, 2e6], record_points=[(4096, 64e6, 4e6)]),
            plot_decode_attention(rows, record_rows=rows[:2]), plot_decode_attention(rows[:2]),
            plot_attention_share(share, record_rows=share), plot_attention_share(share)]
    assert [len(f.axes) for f in figs] == [1, 2, 1, 1, 1]
    for f in figs:
        plt.close(f)
