"""Scheduler behaviour, step by step: chunked prefill keeps every running decode flowing
(decode-first, review T4), and a failed admission changes nothing (review B2)."""
import pytest
import torch

from minillm import generate, tiny_model
from minillm.paging.block_manager import BlockManager
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import SamplingParams, Sequence, SequenceStatus


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
