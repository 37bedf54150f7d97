"""Priorities and queue-wait bounds (engine/policies/priority.py) against schedules reasoned out
by hand here.

Every scenario uses a tiny model and 1-2 seats so that the step at which each request gets its
first token can be counted on paper; outputs are checked against a solo greedy run (`generate`),
which is exact for recompute and swap alike.
"""
import math

import pytest
import torch

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.policies.priority import SEED_CLASSES, PriorityClass
from minillm.engine.sampling_params import SamplingParams

P = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16], [17, 18, 19]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0, dtype=torch.float64)


def _engine(model, seats, policy="priority", classes=(), **kw):
    kw = {"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 32, **kw}
    return LLMEngine(model, EngineConfig(max_num_seqs=seats, scheduling_policy=policy,
                                         priority_classes=classes, **kw))


def _drain(engine, clock=None, dt=0.0):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        if clock is not None:
            clock[0] += dt
    return outs


def _first_steps(engine, rids):
    return [engine.requests[r].metrics.first_token_step for r in rids]


def test_admission_order_is_class_then_arrival(model):
    """One seat, 2 tokens each: a request holds the seat for 2 steps, so the k-th one served gets
    its first token at step 2k. Arrival order batch, interactive, standard, interactive."""
    engine = _engine(model, 1)
    prios = [2, 0, 1, 0]
    rids = [engine.add_request(p, SamplingParams(max_tokens=2), priority=pr) for p, pr in zip(P, prios)]
    outs = _drain(engine)
    # served order: interactive (arrived 2nd), interactive (4th), standard, batch
    assert _first_steps(engine, rids) == [6, 0, 4, 2]
    assert [engine.requests[r].metrics.priority for r in rids] == prios
    for r, p in zip(rids, P):
        assert outs[r].token_ids == generate(model, p, 2)
    fcfs = _engine(model, 1, policy="fcfs")                 # the same requests, all at priority 0
    rids = [fcfs.add_request(p, SamplingParams(max_tokens=2)) for p in P[:4]]
    _drain(fcfs)
    assert _first_steps(fcfs, rids) == [0, 2, 4, 6]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_interactive_arrival_preempts_the_latest_batch_request(model, mode):
    """Two seats held by batch requests B1, B2 (10 tokens each, started at step 0). An interactive
    request arrives before step 3: B2 (latest arrival of the lowest class) is preempted in step 3 and
    the interactive one gets its first token in that very step. Under fcfs it waits for a seat:
    B1 and B2 finish at step 9, so its first token comes at step 10."""
    first = {}
    for policy in ("priority", "fcfs"):
        engine = _engine(model, 2, policy=policy, preemption_mode=mode)
        prio = 2 if policy == "priority" else 0
        b = [engine.add_request(p, SamplingParams(max_tokens=10), priority=prio) for p in P[:2]]
        for _ in range(3):
            engine.step()
        i = engine.add_request(P[2], SamplingParams(max_tokens=3))
        outs = _drain(engine)
        first[policy] = engine.requests[i].metrics.first_token_step
        pre = [engine.requests[r].metrics.num_preemptions for r in b]
        assert pre == ([0, 1] if policy == "priority" else [0, 0])
        for r, p, n in zip(b + [i], P, (10, 10, 3)):
            assert outs[r].token_ids == generate(model, p, n)
    assert first == {"priority": 3, "fcfs": 10}


def test_no_preemption_for_an_equal_class(model):
    """Two interactive requests hold both seats; a third interactive one waits (no eviction)."""
    engine = _engine(model, 2)
    rids = [engine.add_request(p, SamplingParams(max_tokens=4)) for p in P[:2]]
    engine.step()
    late = engine.add_request(P[2], SamplingParams(max_tokens=2))
    _drain(engine)
    assert engine.scheduler.num_preemptions == 0
    assert engine.requests[late].metrics.first_token_step == 4   # the first two finish at step 3
    assert _first_steps(engine, rids) == [0, 0]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_memory_pressure_victim_is_the_lowest_class(model, policy):
    """4 blocks of 4 tokens; L (batch, first) and H (later) with 4-token prompts and 8 tokens each
    need 3 blocks apiece: when both want their third block the pool is empty. fcfs preempts the
    latest arrival (H); priority preempts the lowest class (L), though it arrived first."""
    engine = _engine(model, 2, policy=policy, num_blocks=4)
    low = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=8),
                             priority=2 if policy == "priority" else 0)
    high = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8))
    outs = _drain(engine)
    pre = [engine.requests[r].metrics.num_preemptions for r in (low, high)]
    assert pre == ([1, 0] if policy == "priority" else [0, 1])
    assert outs[low].token_ids == generate(model, [1, 2, 3, 4], 8)
    assert outs[high].token_ids == generate(model, [5, 6, 7, 8], 8)


def _bounded(on_timeout):
    return (PriorityClass("interactive", 0), PriorityClass("batch", 1, 1.0, on_timeout))


def _stream_behind_one_seat(model, on_timeout):
    """One seat; at t=0 batch B (bound 1.0 s) and interactive I1, I2, I3 (2 tokens each) arrive;
    each step advances the fake clock by 0.4 s (step k starts at t = 0.4 k). Without the bound:
    I1 steps 0-1, I2 2-3, I3 4-5, B 6-7. Step 3 starts at t=1.2 > 1.0: B times out."""
    engine = _engine(model, 1, classes=_bounded(on_timeout))
    clock = [0.0]
    engine.clock = lambda: clock[0]
    b = engine.add_request(P[0], SamplingParams(max_tokens=2), priority=1)
    rids = [engine.add_request(p, SamplingParams(max_tokens=2)) for p in P[1:4]]
    return engine, b, rids, _drain(engine, clock, 0.4)


def test_promotion_after_the_queue_wait_bound(model):
    """Promoted at step 3, B takes the seat I2 frees ahead of I3: B 4-5, I3 6-7."""
    engine, b, rids, outs = _stream_behind_one_seat(model, "promote")
    assert _first_steps(engine, [b] + rids) == [4, 0, 2, 6]
    assert [engine.requests[r].metrics.num_promotions for r in [b] + rids] == [1, 0, 0, 0]
    assert engine.scheduler.num_preemptions == 0            # promotion evicts nobody
    for r, p in zip([b] + rids, P):
        assert outs[r].token_ids == generate(model, p, 2)


def test_reject_after_the_queue_wait_bound(model):
    """Rejected at the start of step 3: finish_reason abort, the error says why, no tokens, and
    everyone else is served as before (I3 at step 4, right after I2)."""
    engine, b, rids, outs = _stream_behind_one_seat(model, "reject")
    assert outs[b].finished and outs[b].finish_reason == "abort" and outs[b].token_ids == []
    assert outs[b].error == "queue timeout: waited 1.2 s > max_queue_wait 1 s of class 'batch'"
    assert engine.requests[b].metrics.finish_step == 3
    assert _first_steps(engine, rids) == [0, 2, 4]
    assert all(outs[r].error is None and outs[r].token_ids == generate(model, p, 2)
               for r, p in zip(rids, P[1:4]))
    assert engine.num_free_blocks == engine.num_blocks


def test_the_bound_applies_to_the_first_admission_only(model):
    """B (batch, reject after 1.0 s) starts at once; an interactive request preempts it and keeps the
    seat for 6 steps (2.4 s): B waits again far past the bound but is not rejected."""
    engine = _engine(model, 1, classes=_bounded("reject"))
    clock = [0.0]
    engine.clock = lambda: clock[0]
    b = engine.add_request(P[0], SamplingParams(max_tokens=4), priority=1)
    engine.step()
    clock[0] += 0.4
    i = engine.add_request(P[1], SamplingParams(max_tokens=6))
    outs = _drain(engine, clock, 0.4)
    assert engine.requests[b].metrics.num_preemptions == 1 and outs[b].error is None
    assert outs[b].token_ids == generate(model, P[0], 4)
    assert outs[i].token_ids == generate(model, P[1], 6)


def test_priority_with_equal_priorities_schedules_as_fcfs(model):
    """The priority policy with every request at 0 (and roomy memory) makes fcfs's schedule."""
    traces = []
    for policy in ("fcfs", "priority"):
        engine = _engine(model, 2, policy=policy, max_num_batched_tokens=4)
        for k, p in enumerate(P):
            engine.add_request(p * 3, SamplingParams(max_tokens=3 + k))
        _drain(engine)
        traces.append([(r["request_ids"], r["num_prefill_tokens"]) for r in engine.trace])
    assert traces[0] == traces[1]


def test_generate_takes_one_priority_or_one_per_prompt(model):
    engine = _engine(model, 1)
    outs = engine.generate(P[:3], SamplingParams(max_tokens=2), priority=[2, 1, 0])
    assert [o.metrics.first_token_step for o in outs] == [4, 2, 0]
    outs = engine.generate(P[:2], SamplingParams(max_tokens=2), priority=1)
    assert [o.metrics.priority for o in outs] == [1, 1]


@pytest.mark.parametrize("kw, err", [
    (dict(name=""), TypeError), (dict(priority=True), TypeError), (dict(priority=1.0), TypeError),
    (dict(max_queue_wait=0), ValueError), (dict(max_queue_wait=-1.0), ValueError),
    (dict(max_queue_wait=math.nan), ValueError), (dict(max_queue_wait=math.inf), ValueError),
    (dict(max_queue_wait="1"), TypeError), (dict(max_queue_wait=True), TypeError),
    (dict(on_timeout="drop"), ValueError)])
def test_bad_priority_class(kw, err):
    with pytest.raises(err):
        PriorityClass(**{"name": "x", "priority": 0, **kw})


@pytest.mark.parametrize("kw, err, text", [
    (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy"),
    (dict(priority_classes=SEED_CLASSES), ValueError, "need scheduling_policy='priority'"),
    (dict(scheduling_policy="priority", priority_classes=(PriorityClass("a", 0), PriorityClass("a", 1))),
     ValueError, "unique names"),
    (dict(scheduling_policy="priority", priority_classes=(PriorityClass("a", 0), PriorityClass("b", 0))),
     ValueError, "unique priorities"),
    (dict(scheduling_policy="priority", priority_classes=("interactive",)), TypeError, "PriorityClass"),
    (dict(scheduling_policy="priority", scheduling="static"), ValueError, "continuous")])
def test_bad_engine_config(kw, err, text):
    with pytest.raises(err, match=text):
        EngineConfig(**kw)


def test_bad_request_priority_changes_nothing(model):
    fcfs, prio = _engine(model, 2, policy="fcfs"), _engine(model, 2, classes=SEED_CLASSES)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.add_request(P[0], priority=1)
    with pytest.raises(ValueError, match=r"allowed: \[0, 1, 2\]"):
        prio.add_request(P[0], priority=5)
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="priority"):
            prio.add_request(P[0], priority=bad)
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        prio.generate(P[:3], priority=[0, 1])
    with pytest.raises(ValueError, match="allowed"):
        prio.generate(P[:3], priority=[0, 1, 7])          # all or nothing: the first two are aborted
    for engine in (fcfs, prio):
        assert not engine.has_unfinished_requests()
        assert all(r.seqs[0].finish_reason == "abort" for r in engine.requests.values())
    assert EngineConfig(scheduling_policy="priority",
                        priority_classes=list(SEED_CLASSES)).priority_classes == SEED_CLASSES


def test_llm_generate_passes_priorities_through(model):
    """vLLM's front door: LLM(..., scheduling_policy="priority").generate(prompts, priority=[...])."""
    from minillm import LLM
    llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=32,
              scheduling_policy="priority")
    outs = llm.generate(P[:3], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0, 2])
    assert [o.metrics.first_token_step for o in outs] == [2, 0, 4]
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        LLM(model, num_blocks=64).generate(P[:1], use_tqdm=False, priority=1)


@pytest.mark.parametrize("kw, error", [
    (dict(scheduling_policy="lottery"), ValueError), (dict(priority_classes=None), TypeError),
    (dict(priority_classes=("batch",)), TypeError),
    (dict(priority_classes=(PriorityClass("batch", 2),)), ValueError),      # fcfs with classes
    (dict(scheduling_policy="priority",
          priority_classes=(PriorityClass("a", 0), PriorityClass("a", 1))), ValueError)])
def test_bad_policy_or_classes_are_refused_by_name(kw, error):
    with pytest.raises(error, match="scheduling_policy|priority_classes"):
        EngineConfig(**kw)
