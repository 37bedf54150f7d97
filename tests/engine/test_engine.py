"""The engine against trusted references: every request's greedy output equals `minillm.generate`
run alone (tiny float64 model, so ties cannot flip), over block sizes, chunk budgets, batch limits,
forced preemption in both modes, prefix caching and static batching; seeded sampling does not
depend on the batch; no block ever leaks; bad input is rejected clearly."""
import random

import pytest
import torch

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def workload(model):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    max_tokens = [rng.randint(1, MAX_TOKENS) for _ in prompts]
    refs = [generate(model, p, k) for p, k in zip(prompts, max_tokens)]
    return prompts, max_tokens, refs


CONFIGS = {
    "bs1": dict(block_size=1, num_blocks=400, max_num_seqs=64, max_num_batched_tokens=64),
    "bs3_seqs4_chunk8": dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=8),
    "bs16_seqs1": dict(block_size=16, num_blocks=20, max_num_seqs=1, max_num_batched_tokens=16),
    "bs16_seqs64_nochunk": dict(block_size=16, num_blocks=40, max_num_seqs=64,
                                max_num_batched_tokens=64, enable_chunked_prefill=False),
    # a request holds up to 40 + 24 = 64 tokens, 4 blocks of 16: 7 blocks cannot hold them all
    "preempt_recompute": dict(block_size=16, num_blocks=7, max_num_seqs=64, max_num_batched_tokens=64),
    "preempt_swap": dict(block_size=3, num_blocks=23, max_num_seqs=32, max_num_batched_tokens=32,
                         preemption_mode="swap"),
    "prefix_cache": dict(block_size=3, num_blocks=60, max_num_seqs=8, max_num_batched_tokens=16,
                         enable_prefix_caching=True),
    "prefix_cache_swap": dict(block_size=3, num_blocks=23, max_num_seqs=32,
                              max_num_batched_tokens=32, enable_prefix_caching=True,
                              preemption_mode="swap"),
    "static": dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64,
                   scheduling="static"),
}


def _count_swaps(cache) -> dict[str, int]:
    """Count the cache's swap_out / swap_in calls (the KV copies the runner really makes)."""
    moved = {"out": 0, "in": 0}
    for kind in moved:
        real = getattr(cache, f"swap_{kind}")

        def counted(*args, _real=real, _kind=kind):
            moved[_kind] += 1
            return _real(*args)
        setattr(cache, f"swap_{kind}", counted)
    return moved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate_alone(model, workload, name):
    prompts, max_tokens, refs = workload
    if name.startswith("prefix"):  # give the prompts a shared prefix so the cache gets hits
        prompts = [[7, 8, 9, 10, 11, 12, 13] + p for p in prompts]
        refs = [generate(model, p, k) for p, k in zip(prompts, max_tokens)]
    engine = LLMEngine(model, EngineConfig(**CONFIGS[name]))
    moved = _count_swaps(engine.cache)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    for out, ref, p in zip(outs, refs, prompts):
        assert out.token_ids == ref
        assert out.prompt_token_ids == p
        assert out.finish_reason == "length" and out.finished
    assert engine.num_free_blocks == engine.num_blocks
    if "preempt" in name or "swap" in name:
        assert engine.scheduler.num_preemptions > 0
    if "swap" in name:   # victims really went to CPU memory (no silent fallback to recompute)
        assert max(r["num_swapped"] for r in engine.trace) > 0
        assert 0 < moved["out"] == moved["in"]          # every saved sequence came back
    if name.startswith("prefix"):
        assert engine.block_manager.stats["hit_blocks"] > 0


def _batches(trace):
    """Split the trace where the running queue empties; the request ids seen in each part."""
    parts, current = [], set()
    for rec in trace:
        current |= set(rec["request_ids"])
        if rec["num_running"] == 0:
            parts.append(current)
            current = set()
    return parts


def test_static_batching_admits_only_between_batches(model, workload):
    prompts, max_tokens, _ = workload
    params = [SamplingParams(max_tokens=k) for k in max_tokens]
    engine = LLMEngine(model, EngineConfig(**CONFIGS["static"]))
    engine.generate(prompts, params)
    parts = _batches(engine.trace)
    assert [len(p) for p in parts] == [4, 4, 2]          # 10 requests, max_num_seqs=4
    assert len(set().union(*parts)) == 10
    engine = LLMEngine(model, EngineConfig(**{**CONFIGS["static"], "scheduling": "continuous"}))
    engine.generate(prompts, params)
    assert len(_batches(engine.trace)[0]) > 4             # continuous: new requests join at once


def test_prefix_hits_match_shared_length(model):
    system = list(range(30, 60))                        # 30 shared tokens = 10 blocks of 3
    engine = LLMEngine(model, EngineConfig(block_size=3, num_blocks=100, enable_prefix_caching=True))
    engine.generate([system + [1, 2]], SamplingParams(max_tokens=2))
    outs = engine.generate([system + [3, 4, 5], system + [6]], SamplingParams(max_tokens=3))
    assert engine.block_manager.stats["hit_blocks"] == 2 * 10
    assert [o.metrics.num_cached_tokens for o in outs] == [30, 30]      # 10 whole blocks each
    assert outs[0].token_ids == generate(model, system + [3, 4, 5], 3)
    assert outs[1].token_ids == generate(model, system + [6], 3)


def test_eos_and_stop_tokens(model, workload):
    prompts, _, refs = workload
    p, ref = prompts[0], generate(model, prompts[0], MAX_TOKENS)
    stop = ref[3]
    engine = LLMEngine(model, EngineConfig(num_blocks=50))
    out = engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    engine.eos_token_id = stop
    assert engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0].finish_reason == "stop"
    out = engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == ref


def _seeded(model, cfg, prompts, params):
    return [o.outputs for o in LLMEngine(model, EngineConfig(**cfg)).generate(prompts, params)]


def test_seeded_sampling_independent_of_batch_chunking_preemption(model, workload):
    prompts = workload[0][:6]
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=MAX_TOKENS,
                             seed=100 + i) for i in range(len(prompts))]
    alone = [_seeded(model, dict(num_blocks=50), [p], [sp])[0] for p, sp in zip(prompts, params)]
    for cfg in [dict(num_blocks=50, max_num_seqs=8),
                dict(block_size=3, num_blocks=200, max_num_batched_tokens=8, max_num_seqs=4),
                dict(block_size=16, num_blocks=5, preemption_mode="recompute"),
                dict(block_size=3, num_blocks=23, preemption_mode="swap")]:
        assert _seeded(model, cfg, prompts, params) == alone, cfg
    # a different seed gives a different stream
    other = _seeded(model, dict(num_blocks=50), [prompts[0]], [SamplingParams(
        temperature=1.0, max_tokens=MAX_TOKENS, seed=999)])[0]
    assert other != alone[0]


def test_parallel_sampling_shares_the_prompt(model, workload):
    prompt = workload[0][1] + list(range(40))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=200))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, n=3))[0]
    assert len(greedy.outputs) == 3
    ref = generate(model, prompt, 8)
    assert all(c.token_ids == ref for c in greedy.outputs)
    peak = max(r["blocks_used"] for r in engine.trace)
    # 3 independent copies would need 3 x ceil((len + 8) / 4) blocks; forks share the prompt
    assert peak < 3 * -(-(len(prompt) + 8) // 4)
    sp = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5)
    a = engine.generate([prompt], sp)[0]
    b = LLMEngine(model, EngineConfig(block_size=3, num_blocks=40, max_num_batched_tokens=32)
                  ).generate([prompt, prompt[:9]], [sp, SamplingParams(max_tokens=8)])[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert engine.num_free_blocks == engine.num_blocks


def test_metrics_and_trace(model, workload):
    prompts, max_tokens, _ = workload
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=16))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    for o, k in zip(outs, max_tokens):
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
        assert m.ttft >= 0 and m.e2e >= m.ttft and m.num_generated == k
        assert (m.tpot is None) == (k == 1)
    total = sum(len(p) for p in prompts) + sum(max_tokens) - len(prompts)
    assert sum(r["num_prefill_tokens"] + r["num_decode_tokens"] for r in engine.trace) == total
    assert all(r["num_prefill_tokens"] + r["num_decode_tokens"] <= 16 for r in engine.trace)
    data = engine.export_trace()
    assert len(data["requests"]) == len(prompts) and len(data["steps"]) == len(engine.trace)


@pytest.mark.parametrize("cfg", [
    dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16),
    dict(block_size=4, num_blocks=16, max_num_seqs=64, max_num_batched_tokens=64,
         preemption_mode="swap", enable_prefix_caching=True),
    dict(block_size=1, num_blocks=90, max_num_seqs=64, max_num_batched_tokens=64),
])
def test_speculative_greedy_equals_generate(model, cfg):
    """n-gram drafts verified in the ragged batch: greedy output unchanged, drafts accepted."""
    rng = random.Random(1)
    base = [rng.randrange(256) for _ in range(8)]
    prompts = [(base * 4)[:rng.randint(5, 30)] for _ in range(8)]  # repetitive: n-gram hits
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    engine = LLMEngine(model, EngineConfig(**cfg, num_speculative_tokens=3))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == [generate(model, p, k) for p, k in zip(prompts, max_tokens)]
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_draft_tokens
    assert sum(o.metrics.num_spec_steps for o in outs) == stats.num_spec_steps
    assert engine.num_free_blocks == engine.num_blocks


def test_speculative_draft_model_is_target(model, workload):
    """A draft model identical to the target: every greedy draft is accepted."""
    prompts, max_tokens, refs = workload
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=100, num_speculative_tokens=4,
                                           speculative_method="draft"), draft_model=model)
    outs = engine.generate(prompts[:4], [SamplingParams(max_tokens=k) for k in max_tokens[:4]])
    assert [o.token_ids for o in outs] == refs[:4]
    assert engine.spec_stats.accepted_fraction == 1.0
    for o, k in zip(outs, max_tokens[:4]):      # prefill gives 1 token, each verify step k + 1
        done, steps, drafts = 1, 0, 0
        while done < k:
            kk = min(4, k - done - 1)
            done, steps, drafts = done + kk + 1, steps + (kk > 0), drafts + kk
        m = o.metrics
        assert (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens) == (steps, drafts, drafts)
        assert m.acceptance_rate == (1.0 if drafts else None)
    steps_plain = sum(max_tokens[:4])
    assert sum(r["num_seqs"] for r in engine.trace) < steps_plain   # fewer target passes per token


def test_num_blocks_from_memory_budget(model):
    """num_blocks=None: as many blocks as fit in kv_cache_memory_bytes (K and V, all layers)."""
    from minillm.paging.paged_cache import PagedKVCache
    per_block = PagedKVCache.bytes_per_block(model.config, 16, torch.float64)
    engine = LLMEngine(model, EngineConfig(num_blocks=None, kv_cache_memory_bytes=10 * per_block + 5))
    assert engine.num_blocks == 10 and engine.num_free_blocks == 10
    assert engine.cache.nbytes == 10 * per_block


def test_token_ids_from_equals_slicing_the_whole_context():
    """The scheduler and runner read a decode's newest tokens with `token_ids_from`."""
    from minillm.engine.sequence import Sequence
    seq = Sequence(0, "r", [5, 6, 7], SamplingParams(), 0.0, output_token_ids=[8, 9])
    for drafts in ([], [1, 2]):
        seq.draft_token_ids = drafts
        for start in range(7):
            assert seq.token_ids_from(start) == (seq.token_ids + drafts)[start:]
