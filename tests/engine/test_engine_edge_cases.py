"""Regression tests for the bugs of the code review (../shared/reviews/code-review-bc85599.md):
each one failed before its fix. The references are `minillm.generate` run alone (tiny float64
model), a snapshot of the block manager, and the global RNG state."""
import pytest
import torch

from minillm import generate, tiny_model
from minillm.paging.block_manager import BlockManager
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.spec.proposers import DraftModelProposer
from minillm.engine.scheduler import Scheduler
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Sequence

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(vocab_size=64, seed=1, dtype=torch.float64)


def _run(engine):
    while engine.has_unfinished_requests():
        engine.step()


# ---- B1: a step that fails for one request leaves everyone else intact ---------------------
def test_unsampleable_request_aborts_alone(model):
    """A request whose parameters turn invalid after admission (a frozen dataclass can still be
    altered) cannot be sampled: it ends with "abort" and its neighbours get exactly their answer."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40))
    good = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=6)
    bad = engine.add_request([1, 2, 3], params)
    object.__setattr__(params, "temperature", float("nan"))     # slips past every check
    _run(engine)
    assert engine.requests[bad].output().finish_reason == "abort"
    assert "nan" in engine.requests[bad].seqs[0].error.lower()
    for rid, p in zip(good, PROMPTS):
        assert engine.requests[rid].output().token_ids == generate(model, p, 6)
    assert engine.num_free_blocks == engine.num_blocks


def test_failed_forward_changes_nothing(model, monkeypatch):
    """The forward pass raises once: step() re-raises, and the engine then serves every request
    exactly, with no block leaked."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=8))
    rids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    engine.step()
    engine.step()
    real, calls = engine.runner.model, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "model", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    _run(engine)
    for rid, p in zip(rids, PROMPTS):
        assert engine.requests[rid].output().token_ids == generate(model, p, 6)
    assert engine.num_free_blocks == engine.num_blocks


# ---- B2: tests/engine/test_scheduler.py::test_failed_admission_has_no_side_effects -----------------


# ---- B4: each sequence keeps its own draft cache --------------------------------------------
def test_draft_caches_are_per_sequence(draft):
    """Two contexts that share only their first token (as every chat prompt does) alternate:
    each call feeds the draft model only the new tokens, not the whole context again."""
    prop = DraftModelProposer(draft, max_cached_seqs=4)
    fed = []
    real = draft.forward
    ctxs = {0: [1, 20, 21, 22, 23, 24, 25, 26, 27, 28], 1: [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]}
    try:
        draft.forward = lambda ids, *a, **k: (fed.append(ids.shape[1]), real(ids, *a, **k))[1]
        for step in range(3):
            for key, ctx in ctxs.items():
                fed.clear()
                out = prop.propose([ctx], 2, key=key)
                if step > 0:
                    assert fed[0] <= 2, f"step {step}: fed {fed[0]} tokens for sequence {key}"
                ctx.append(int(out.token_ids[0, 0]))
    finally:
        del draft.forward
    assert len(prop._slots) == 2


def test_engine_draft_model_feeds_little(model, draft):
    """Through the engine: with a draft model, no draft forward after the first one per sequence
    re-feeds the shared-first-token contexts."""
    prompts = [[1] + list(range(20, 30)), [1] + list(range(40, 50))]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, num_speculative_tokens=2,
                                           speculative_method="draft"), draft_model=draft)
    fed = []
    real = draft.forward
    try:
        draft.forward = lambda ids, *a, **k: (fed.append(ids.shape[1]), real(ids, *a, **k))[1]
        outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    finally:
        del draft.forward
    assert [o.token_ids for o in outs] == [generate(model, p, 8) for p in prompts]
    assert sum(n > 4 for n in fed) <= len(prompts)       # one full prefill per sequence


# ---- B5: unseeded draft sampling leaves the global RNG alone --------------------------------
def test_unseeded_draft_sampling_uses_the_engine_generator(model, draft):
    cfg = EngineConfig(block_size=4, num_blocks=40, num_speculative_tokens=2,
                       speculative_method="draft", seed=7)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, cfg, draft_model=draft)
        outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8))
        runs.append([o.token_ids for o in outs])
        torch.rand(1)                                     # a caller's own use of the global RNG
    assert runs[0] == runs[1]                             # EngineConfig.seed makes it reproducible
    torch.set_rng_state(state)
    engine = LLMEngine(model, cfg, draft_model=draft)
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8))
    assert torch.equal(torch.get_rng_state(), state)


# ---- the smaller ones ------------------------------------------------------------------------
def test_drafts_are_dropped_before_anyone_is_preempted():
    """Optional draft tokens that need a block the pool lacks are dropped; nobody is preempted."""
    bm = BlockManager(3, 4)
    s = Scheduler(bm, 8, 64)
    a = Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=9), 0.0)
    b = Sequence(1, "b", [4, 5, 6], SamplingParams(max_tokens=9), 1.0)
    s.add(a)
    s.add(b)
    s.schedule()                                          # both prefill: one block each
    for seq in (a, b):
        seq.num_computed_tokens = 3
        seq.output_token_ids.append(7)
    a.draft_token_ids = [8, 9, 10, 11]                    # needs a second block; one is free...
    b.draft_token_ids = [8, 9, 10, 11]                    # ...so b's drafts cannot also fit
    out = s.schedule()
    assert out.preempted == []
    assert sorted(n for _, n in out.scheduled) == [1, 5]


def test_config_rejects_a_budget_below_the_batch():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(max_num_seqs=2, max_num_batched_tokens=4, num_speculative_tokens=4)
    assert EngineConfig(max_num_batched_tokens=8).max_num_seqs == 8     # default follows the budget
    assert EngineConfig().max_num_seqs == 32


def test_forked_children_respect_max_num_seqs(model):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=80, max_num_seqs=4))
    params = SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=1)
    rids = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 4
    assert all(len(engine.requests[r].output().outputs) == 3 for r in rids)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request([1, 2], SamplingParams(n=5))


def test_finished_requests_are_not_kept_forever(model):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=40, retain_finished=2,
                                           max_trace_steps=5))
    for p in PROMPTS * 2:
        engine.generate([p], SamplingParams(max_tokens=3))
    assert len(engine.requests) <= 2 and len(engine.trace) <= 5
    outs = engine.generate(PROMPTS * 2, SamplingParams(max_tokens=3))   # more than retained
    assert [o.token_ids for o in outs] == [generate(model, p, 3) for p in PROMPTS * 2]
