"""Scheduler behaviour, step by step: chunked prefill keeps every running decode flowing
(decode-first, review T4), and a failed admission changes nothing (review B2)."""
import pytest
import torch

from minillm import generate, tiny_model
from minillm.paging.block_manager import BlockManager
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.scheduler import Scheduler
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Sequence, SequenceStatus


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0, dtype=torch.float64)


def test_chunked_prefill_gives_every_decode_a_token_every_step(model):
    """Three requests decode while a 40-token prompt prefills in chunks of the budget they leave
    (8 - 3 = 5 tokens): on each of those 8 steps each decode gains exactly one token."""
    budget, short, long_prompt = 8, [[1, 2], [3, 4, 5], [6]], list(range(10, 50))
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=60, max_num_seqs=8,
                                           max_num_batched_tokens=budget))
    rids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in short]
    engine.step()                                       # the three prompts fit one step
    decoders = [engine.requests[r].seqs[0] for r in rids]
    assert [len(s.output_token_ids) for s in decoders] == [1, 1, 1]
    big = engine.requests[engine.add_request(long_prompt, SamplingParams(max_tokens=3))].seqs[0]
    chunk = budget - len(decoders)
    for step in range(1, -(-len(long_prompt) // chunk) + 1):
        engine.step()
        assert [len(s.output_token_ids) for s in decoders] == [1 + step] * 3
        assert big.num_computed_tokens == min(step * chunk, len(long_prompt))
        rec = engine.trace[-1]
        assert rec["num_decode_tokens"] == 3
        assert rec["num_prefill_tokens"] == min(chunk, len(long_prompt) - (step - 1) * chunk)
        assert rec["prefill_request_ids"] == [big.request_id]
    assert len(big.output_token_ids) == 1               # its last chunk sampled the first token
    while engine.has_unfinished_requests():
        engine.step()
    for rid, p in zip(rids, short):
        assert engine.requests[rid].output().token_ids == generate(model, p, 20)
    assert big.output_token_ids == generate(model, long_prompt, 3)


def _state(bm: BlockManager):
    """Everything a scheduler step can change in the block manager, statistics included."""
    seqs = {s: (bm.block_table(s), bm.token_ids(s), bm.num_computed_tokens(s)) for s in bm.seq_ids()}
    return (seqs, [bm.ref_count(b) for b in range(bm.num_blocks)], bm.free_block_ids(),
            [bm.is_cached(b) for b in range(bm.num_blocks)], dict(bm.stats))


def _one_cached_block_and_a_running_prompt(waiting_too: bool):
    """The review's repro (section 1.4): one cached block; a 4-token prompt runs, a second one
    waits but does not fit what is left of the 5-token budget (chunking off)."""
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    bm.allocate("x", [1, 1, 1])
    bm.mark_computed("x", 3)
    bm.free("x")
    sched = Scheduler(bm, 8, 5, enable_chunked_prefill=False)
    sched.add(Sequence(0, "a", [5] * 4, SamplingParams(), 0.0))
    if waiting_too:
        sched.add(Sequence(1, "b", [7] * 4, SamplingParams(), 1.0))
    return bm, sched


def test_failed_admission_has_no_side_effects():
    bm, sched = _one_cached_block_and_a_running_prompt(waiting_too=True)
    ref_bm, ref_sched = _one_cached_block_and_a_running_prompt(waiting_too=False)
    out, ref = sched.schedule(), ref_sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 4)]
    assert [(s.request_id, n) for s, n in ref.scheduled] == [("a", 4)]
    b = sched.waiting[0]
    assert b.request_id == "b" and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    # b's failed admission must leave the cache, the free list and the statistics untouched
    assert bm.num_cached_blocks == 1 and bm.stats["evicted_blocks"] == 0
    assert _state(bm) == _state(ref_bm)


def _prefill_first_engine(model, budget, prefill_first=True):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=60, max_num_seqs=min(8, budget),
                                           max_num_batched_tokens=budget))
    engine.scheduler.prefill_first = prefill_first   # the switch EngineConfig.prefill_first sets
    return engine


def test_prefill_first_gives_the_prompt_the_whole_budget_and_stays_exact(model):
    """Prefill-first (vLLM V0's order): while a 40-token prompt has tokens left, its chunks take
    the 8-token budget before the three decodes, which get only what is left (0 for 5 steps,
    then 8 - 0 = 8 spare); every output still equals `generate` alone."""
    short, long_prompt = [[1, 2], [3, 4, 5], [6]], list(range(10, 50))
    engine = _prefill_first_engine(model, 8)
    rids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in short]
    engine.step()
    rid = engine.add_request(long_prompt, SamplingParams(max_tokens=3))
    comp = []
    while engine.has_unfinished_requests():
        engine.step()
        comp.append((engine.trace[-1]["num_prefill_tokens"], engine.trace[-1]["num_decode_tokens"]))
    assert comp[:6] == [(8, 0)] * 5 + [(0, 4)]     # 40 = 5 x 8: the decodes wait five steps
    for r, p in zip(rids, short):
        assert engine.requests[r].output().token_ids == generate(model, p, 20)
    assert engine.requests[rid].output().token_ids == generate(model, long_prompt, 3)


def test_prefill_first_admits_waiting_prompts_before_decodes(model):
    """A new prompt is admitted ahead of the running decodes: with a 6-token budget and a
    5-token prompt, the step holds the prompt (5) and one of the three decodes (the oldest)."""
    engine = _prefill_first_engine(model, 6)
    rids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in [[1, 2], [3], [4]]]
    engine.step()
    engine.add_request([7, 8, 9, 10, 11], SamplingParams(max_tokens=2))
    engine.step()
    rec = engine.trace[-1]
    assert (rec["num_prefill_tokens"], rec["num_decode_tokens"]) == (5, 1)
    assert engine.requests[rids[0]].seqs[0].num_tokens == 2 + 2   # the oldest decode ran
    assert [len(engine.requests[r].seqs[0].output_token_ids) for r in rids] == [2, 1, 1]


def test_decode_first_is_the_default():
    assert EngineConfig().prefill_first is False
    assert Scheduler(BlockManager(4, 2), 2, 4).prefill_first is False


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_prefill_first_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="prefill_first"):
        EngineConfig(prefill_first=bad)
    with pytest.raises(TypeError, match="prefill_first"):
        Scheduler(BlockManager(4, 2), 2, 4, prefill_first=bad)


def test_engine_passes_prefill_first_to_its_scheduler(model):
    assert LLMEngine(model, EngineConfig(prefill_first=True)).scheduler.prefill_first is True


# ---- partial prefills: no lock-out behind a long prompt ------------------------------------------
LONG = [(7 * i) % 61 + 1 for i in range(160)]   # 160 tokens: ten chunks of the 16-token budget
SHORT = [50, 51, 52, 53]


def _short_behind_long(model, **knobs):
    """A 160-token prompt prefills (budget 16); after its second step a 4-token prompt arrives.
    Returns (steps from the short one's arrival to its first token, steps until the long one's
    first token, both requests' outputs)."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=80, max_num_seqs=4,
                                           max_num_batched_tokens=16, **knobs))
    big = engine.add_request(LONG, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    small = engine.add_request(SHORT, SamplingParams(max_tokens=4))
    first, steps = {}, 2
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for rid in (big, small):
            if rid not in first and engine.requests[rid].seqs[0].output_token_ids:
                first[rid] = steps
    outs = {rid: engine.requests[rid].output().token_ids for rid in (big, small)}
    return first[small] - 2, first[big], outs


def test_a_short_prompt_waits_for_a_long_prefill_without_the_knobs(model):
    """The default (vLLM's defaults: knobs off): the long prompt's chunks take the whole budget,
    so the short one is admitted only after the long prefill ends (step 10) and samples at 11."""
    wait, long_first, outs = _short_behind_long(model)
    assert long_first == 10 and wait == 11 - 2
    assert outs == {"0": generate(model, LONG, 4), "1": generate(model, SHORT, 4)}


def test_a_short_prompt_runs_beside_a_long_prefill_with_the_knobs(model):
    """long_prefill_token_threshold=8: every chunk of the long prompt stops at 8 tokens, so the
    short prompt is admitted in the very step after it arrives, beside the long chunk, and samples
    there. The price: the long prefill takes 160 / 8 = 20 steps instead of 10. Both outputs equal
    `generate` alone (mixing chunks changes no token)."""
    for knobs in (dict(long_prefill_token_threshold=8),
                  dict(long_prefill_token_threshold=8, max_num_partial_prefills=2)):
        wait, long_first, outs = _short_behind_long(model, **knobs)
        assert (wait, long_first) == (1, 20)
        assert outs == {"0": generate(model, LONG, 4), "1": generate(model, SHORT, 4)}


def _scheduled(sched):
    out = sched.schedule()
    for seq, n in out.scheduled:           # what the engine does once the step has run
        seq.num_computed_tokens += n
        sched.bm.mark_computed(seq.seq_id, seq.num_computed_tokens)
        if seq.num_uncomputed == 0:        # a prompt finished (or a decode ran): it samples
            seq.output_token_ids.append(1)
    return [(s.request_id, n) for s, n in out.scheduled]


def _queue(knobs, lengths):
    sched = Scheduler(BlockManager(64, 4), 8, 16, **knobs)
    for i, k in enumerate(lengths):
        sched.add(Sequence(i, "abcdef"[i], [1] * k, SamplingParams(), float(i)))
    return sched


def test_a_waiting_long_prompt_keeps_its_place_while_a_short_one_passes():
    """threshold 4, one long partial prefill allowed: 'a' (20 tokens, long) runs 4; 'b' (also
    long) must wait, but 'c' (3 tokens, whole in one step) is admitted behind it, and so is 'd'
    as far as the budget goes if it finishes; 'b' stays first in the queue."""
    sched = _queue(dict(long_prefill_token_threshold=4, max_num_partial_prefills=2), [20, 10, 3, 4, 9])
    assert _scheduled(sched) == [("a", 4), ("c", 3), ("d", 4)]
    assert [s.request_id for s in sched.waiting] == ["b", "e"]
    # 'e' (9 tokens) is long too; with two long slots both 'b' and 'e' may start
    sched = _queue(dict(long_prefill_token_threshold=4, max_num_partial_prefills=3,
                        max_long_partial_prefills=3), [20, 10, 3, 4, 9])
    assert _scheduled(sched) == [("a", 4), ("b", 4), ("c", 3), ("d", 4), ("e", 1)]


def test_max_num_partial_prefills_bounds_prompts_mid_prefill():
    """threshold 6, budget 16, three 20-token prompts: with two slots 'a' and 'b' run 6 each and
    'c' waits although 4 tokens of budget are left; with three slots it starts with those 4. A
    prompt that finishes in its step takes no slot: 'd' (3 tokens) still goes in."""
    sched = _queue(dict(long_prefill_token_threshold=6, max_num_partial_prefills=2,
                        max_long_partial_prefills=2), [20, 20, 20, 3])
    assert _scheduled(sched) == [("a", 6), ("b", 6), ("d", 3)]
    assert _scheduled(sched) == [("d", 1), ("a", 6), ("b", 6)]    # decodes first; 'c' still waits
    sched = _queue(dict(long_prefill_token_threshold=6, max_num_partial_prefills=3,
                        max_long_partial_prefills=3), [20, 20, 20, 3])
    assert _scheduled(sched) == [("a", 6), ("b", 6), ("c", 4)]


@pytest.mark.parametrize("knobs", [
    dict(block_size=3, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=8,
         long_prefill_token_threshold=3, max_num_partial_prefills=2),
    dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16,
         long_prefill_token_threshold=5, max_num_partial_prefills=3, max_long_partial_prefills=2),
    dict(block_size=16, num_blocks=7, max_num_seqs=64, max_num_batched_tokens=64,     # preempts
         long_prefill_token_threshold=12, max_num_partial_prefills=4),
    dict(block_size=3, num_blocks=23, max_num_seqs=32, max_num_batched_tokens=32,
         preemption_mode="swap", long_prefill_token_threshold=7, max_num_partial_prefills=2),
    dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16, prefill_first=True,
         long_prefill_token_threshold=5, max_num_partial_prefills=2),
    dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=16,
         scheduling_policy="priority", long_prefill_token_threshold=5, max_num_partial_prefills=2),
], ids=["chunk8", "three_slots", "preempt_recompute", "preempt_swap", "prefill_first", "priority"])
def test_partial_prefills_change_no_token(model, knobs):
    """Ten ragged prompts (1-40 tokens) at once, greedy: every output equals `generate` alone."""
    import random
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    engine = LLMEngine(model, EngineConfig(**knobs))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == [generate(model, p, k) for p, k in zip(prompts, max_tokens)]
    assert engine.num_free_blocks == engine.num_blocks
    assert max(r["num_prefill_tokens"] for r in engine.trace) <= knobs["long_prefill_token_threshold"] * \
        knobs["max_num_partial_prefills"] + 40         # capped chunks, plus prompts that finish
    if knobs["num_blocks"] < 30:                     # the pool is too small for all ten
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("bad, field", [
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
    (dict(max_long_partial_prefills=0), "max_long_partial_prefills"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold=1.5), "long_prefill_token_threshold"),
    (dict(max_num_partial_prefills=True), "max_num_partial_prefills"),
    (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False), "enable_chunked_prefill"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False), "enable_chunked_prefill"),
])
def test_bad_partial_prefill_knobs_raise(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**bad)
    with pytest.raises(ValueError, match=field):
        Scheduler(BlockManager(4, 2), 2, 4, **bad)


def test_partial_prefill_knobs_default_off_and_reach_the_scheduler(model):
    cfg = EngineConfig()
    assert (cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
            cfg.long_prefill_token_threshold) == (1, 1, 0)
    s = LLMEngine(model, EngineConfig(max_num_partial_prefills=3, max_long_partial_prefills=2,
                                      long_prefill_token_threshold=40)).scheduler
    assert (s.max_num_partial_prefills, s.max_long_partial_prefills,
            s.long_prefill_token_threshold) == (3, 2, 40)


def test_the_server_turns_partial_prefills_on_by_default():
    """`python -m minillm serve` has no lock-out out of the box; its flags turn it back off, and
    turning chunked prefill off drops the partial-prefill defaults (they need it)."""
    from minillm.serve.cli import engine_options, parser
    cfg = EngineConfig(**engine_options(parser().parse_args([])))
    assert (cfg.max_num_batched_tokens, cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
            cfg.long_prefill_token_threshold) == (512, 2, 1, 384)
    cfg = EngineConfig(**engine_options(parser().parse_args(
        ["--long-prefill-token-threshold", "0", "--max-num-partial-prefills", "1",
         "--max-num-batched-tokens", "256"])))
    assert (cfg.max_num_batched_tokens, cfg.max_num_partial_prefills,
            cfg.long_prefill_token_threshold) == (256, 1, 0)
    cfg = EngineConfig(**engine_options(parser().parse_args(["--no-enable-chunked-prefill"])))
    assert (cfg.enable_chunked_prefill, cfg.max_num_partial_prefills, cfg.long_prefill_token_threshold) \
        == (False, 1, 0)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(**engine_options(parser().parse_args(["--max-long-partial-prefills", "3"])))
