"""Piecewise CUDA graphs (kernels/cuda_graph_steps.py) against the eager model and `generate`.

On a CPU the graphs are `EagerGraph`s (capture keeps the piece, replay re-runs it into the same
tensors), so everything but the recording is checked: the pieces compose to the model's forward,
static buffers are reused, padding rows never reach a real row, nothing stale survives from an
earlier step, and an engine over them gives `generate`'s greedy tokens through chunked prefill
and preemption. A float64 tiny model: ties cannot flip. With CUDA, the same with real graphs.
"""
import math
import random

import pytest
import torch

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels import compiled_steps as cs
from minillm.kernels import cuda_graph_steps as cgs
from minillm.kernels.compilation_config import CompilationConfig
from minillm.paging.paged_cache import PagedKVCache

F64, SIZES = torch.float64, (1, 2, 4, 8)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=F64)


def _config(**kw):
    return CompilationConfig(**{"compile_sizes": SIZES, "keep": "agreeing", "rounds": 1, **kw})


def _make(model):
    return lambda n, p: PagedKVCache(model.config, n, p, dtype=model.dtype,   # noqa: E731
                                     device=model.device)


@pytest.fixture(scope="module")
def steps(model):
    return cgs.CudaGraphSteps(model, _config(), cgs.EagerGraph).capture(_make(model))


def _step(model, lens, pad_to=None, seed=0, pad_ids=0):
    """A mixed step over a fresh paged cache: sequence r first prefills lens[r][0] tokens alone
    (eager), then its next lens[r][1] tokens are this step's rows; padded to `pad_to` rows on
    the scratch block (the last). -> (cache, ids (1, M'), pos (M',), lists for prepare, rows)."""
    g = torch.Generator().manual_seed(seed)
    P, cache = 4, PagedKVCache(model.config, 40, 4, dtype=F64)
    ids, pos, q, ctx, tables = [], [], [], [], []
    for r, (done, new) in enumerate(lens):
        toks = torch.randint(256, (done + new,), generator=g).tolist()
        table = list(range(4 * r, 4 * r + -(-(done + new) // P)))   # <= 16 tokens each
        if done:
            cache.prepare([done], [done], [table])
            model(torch.tensor([toks[:done]]), torch.arange(done), cache)
        ids += toks[done:]
        pos += range(done, done + new)
        q.append(new)
        ctx.append(done + new)
        tables.append(table)
    rows = len(ids)
    pad = (pad_to or rows) - rows                            # padding rows, as the runner adds
    ids, pos, q, ctx = ids + [pad_ids] * pad, pos + [0] * pad, q + [1] * pad, ctx + [1] * pad
    tables += [[39]] * pad
    return cache, torch.tensor([ids]), torch.tensor(pos), (q, ctx, tables), rows


LENS = [(5, 1), (0, 3), (9, 1)]                               # decode, prefill chunk, decode


@torch.inference_mode()
def test_the_pieces_compose_to_the_model_and_padding_stays_out(model, steps):
    cache, ids, pos, lists, rows = _step(model, LENS)
    cache.prepare(*lists)
    want = model(ids, pos, cache)[0]                                          # (5, V) eager
    for pad_ids in (0, 255):                                  # what the padding holds: no matter
        cache, ids, pos, lists, rows = _step(model, LENS, pad_to=8, pad_ids=pad_ids)
        cache.prepare(*lists)
        got, hidden = steps.run(ids, pos, cache, rows, None, return_hidden=True)
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)
        assert hidden.shape == (1, rows, model.config.d_model)
        if pad_ids == 0:
            first = got
        else:
            assert torch.equal(got, first)                    # bit for bit, whatever the padding
    body = cs._Body(steps.pieces.m)                          # the compiled steps' own body
    cache, ids, pos, lists, rows = _step(model, LENS, pad_to=8)
    cache.prepare(*lists)
    with cs.active_cache(cache):
        ref = body(ids, pos)[:rows]                                           # (5, C)
    torch.testing.assert_close(hidden[0], ref, rtol=1e-10, atol=1e-10)


@torch.inference_mode()
def test_static_buffers_are_reused_and_nothing_stale_leaks(model, steps):
    ptrs = {s: [t.data_ptr() for t in (g.ids, g.pos, g.hidden, *g.ys, *sum(g.qkv, ()))]
            for s, g in steps.sizes.items()}
    eight = [(3, 1)] * 8                                      # a full size-8 step first
    for lens, pad_to in ((eight, 8), (LENS, 8), ([(4, 1)], 1), ([(2, 1), (6, 1)], 2)):
        cache, ids, pos, lists, rows = _step(model, lens, seed=len(lens))
        cache.prepare(*lists)
        want = model(ids, pos, cache)[0]
        cache, ids, pos, lists, rows = _step(model, lens, pad_to=pad_to, seed=len(lens))
        cache.prepare(*lists)
        got = steps.run(ids, pos, cache, rows, None)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for g in steps.sizes.values():                        # poison every static tensor
            for t in (g.hidden, *g.ys, *sum(g.qkv, ())):
                t.fill_(float("nan"))
            g.ids.fill_(255)
            g.pos.fill_(10**4)
    assert ptrs == {s: [t.data_ptr() for t in (g.ids, g.pos, g.hidden, *g.ys, *sum(g.qkv, ()))]
                    for s, g in steps.sizes.items()}


def test_sizes_are_judged_and_the_summary_says_so(model, steps):
    assert steps.kept == SIZES and [t.size for t in steps.timings] == list(SIZES)
    assert all(t.tokens_equal and t.max_abs_diff < 1e-9 for t in steps.timings)
    assert steps.padded(3) == 4 and steps.padded(8) == 8 and steps.padded(9) is None
    line = steps.summary()
    assert "piecewise, 3 pieces" in line and "kept 1 (" in line and "over 8 rows run eager" in line
    assert steps.as_dict()["graph"] == "EagerGraph"
    lazy = cgs.CudaGraphSteps(model, _config(keep="faster", min_gain=0.99), cgs.EagerGraph)
    assert lazy.capture(_make(model)).kept == ()              # eager pieces never win by 99%
    assert "eager at 1 (not faster)" in lazy.summary()


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(0)
    prompts = [[7, 8, 9, 10] + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
               for _ in range(8)]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    return prompts, max_tokens, [generate(model, p, k) for p, k in zip(prompts, max_tokens)]


CONFIGS = {
    "chunk8": dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=16, num_blocks=6, max_num_seqs=64,
                              max_num_batched_tokens=64),
    "preempt_swap": dict(block_size=3, num_blocks=20, max_num_seqs=32, max_num_batched_tokens=32,
                         preemption_mode="swap"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_engine_over_the_graphs_gives_generates_tokens(model, workload, name, monkeypatch):
    monkeypatch.setattr(cgs, "graph_backend", lambda device: cgs.EagerGraph)
    engine = LLMEngine(model, EngineConfig(**CONFIGS[name],
                                           compilation_config=_config(cudagraph_mode="piecewise")))
    steps = engine.runner.compiled
    assert isinstance(steps, cgs.CudaGraphSteps) and steps.kept == SIZES
    sizes, real = [], steps.run

    def counting(input_ids, positions, cache, rows, *a, **kw):
        sizes.append((input_ids.shape[1], rows))
        return real(input_ids, positions, cache, rows, *a, **kw)
    monkeypatch.setattr(steps, "run", counting)
    prompts, max_tokens, refs = workload
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs
    assert sizes and {s for s, _ in sizes} <= set(SIZES) and any(r < s for s, r in sizes)
    assert engine.num_free_blocks == engine.num_blocks
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0


def test_piecewise_without_cuda_is_ignored_with_one_line(model, workload, monkeypatch, tmp_path):
    lines = []
    monkeypatch.setattr(cgs, "notice", lines.append)
    monkeypatch.setattr(cs.CompiledSteps, "_build",          # no inductor here: eager
                        lambda self, *a: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    cc = _config(cudagraph_mode="piecewise", cache_dir=str(tmp_path))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, compilation_config=cc))
    assert engine.runner.compiled is None
    assert len(lines) == 1 and "needs a CUDA device" in lines[0] and "ignored" in lines[0]
    assert cgs.cuda_graph_steps(model, _config(), None, "cpu") is None          # default: quiet
    assert cgs.cuda_graph_steps(model, _config(cudagraph_mode="none"), None, "cuda") is None
    assert len(lines) == 1
    with pytest.raises(ValueError, match="CUDA"):
        cgs.CudaGraphSteps(model, _config())


@pytest.mark.parametrize("value, word", [
    (dict(cudagraph_mode="full"), "compilation_config.cudagraph_mode"),
    (dict(cudagraph_capture_sizes=[4, 2]), "cudagraph_capture_sizes must be strictly"),
    (dict(cudagraph_capture_sizes=[0]), r"cudagraph_capture_sizes\[0\]"),
    (dict(cudagraph_capture_sizes=[1, 512]), "cudagraph_capture_sizes go up to 512")])
def test_bad_graph_config_names_the_field(value, word):
    with pytest.raises(ValueError, match=word):
        EngineConfig(max_num_batched_tokens=256, compilation_config=value)
    assert CompilationConfig(cudagraph_capture_sizes=[1, 3]).capture_sizes == (1, 3)
    assert CompilationConfig(compile_sizes=[2, 5]).capture_sizes == (2, 5)


def test_the_benchmark_skips_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the benchmark really runs")
    from benchmarks import cuda_graph_steps as bench
    assert "CUDA" in bench.run(True, "cpu", tmp_path)["skipped"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_give_generates_tokens(workload):
    model = tiny_model(vocab_size=256, seed=0, dtype=F64, device="cuda")
    prompts, max_tokens, _ = workload
    refs = [generate(model, p, k) for p, k in zip(prompts, max_tokens)]    # eager, on the GPU
    engine = LLMEngine(model, EngineConfig(**CONFIGS["preempt_recompute"],
                                           compilation_config=_config()))   # piecewise by default
    steps = engine.runner.compiled
    assert isinstance(steps, cgs.CudaGraphSteps) and steps.graph is cgs.CudaGraph
    assert steps.kept == SIZES and steps.pool is not None
    ptr = steps.sizes[8].hidden.data_ptr()
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs and engine.scheduler.num_preemptions > 0
    assert steps.sizes[8].hidden.data_ptr() == ptr


def test_the_benchmark_rehearses_on_a_cpu(model, monkeypatch):
    """Its measurement with `EagerGraph`s and a tiny model: every figure there, nothing written."""
    monkeypatch.setattr(cgs, "graph_backend", lambda device: cgs.EagerGraph)
    from benchmarks import cuda_graph_steps as bench
    r = bench.measure(model, (4, 1), bandwidth=1e10, keep="agreeing")
    assert set(r["decode"]) == {"batch1", "batch8", "batch64"}
    assert r["decode"]["batch8"]["padded_to"] == 8 and r["steps"]["kept"] == list(bench.SIZES)
    assert all(d["floor_ms_per_step"] > 0 for d in r["decode"].values())
    # a timed difference of two runs of a tiny model can be any sign on a busy CPU: finite, no more
    assert all(math.isfinite(d["graphs_ms_per_step"]) and math.isfinite(d["eager_ms_per_step"])
               for d in r["decode"].values())
    assert "batch64" in bench.report({**r, "weights": "random", "quick": True})
