"""Bad input is rejected at the door with a clear message, and the other requests still finish
exactly as `minillm.generate` would; aborts at any point never leak a block (property test)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import generate, tiny_model
from minillm.engine import EngineConfig, LLMEngine
from minillm.sequence import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64, max_seq_len=128)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(n=0), "n must"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(top_p=float("nan")), ValueError, "top_p must be finite"),
    (dict(temperature="hot"), TypeError, "temperature must be a real number"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(top_p=None), TypeError, "top_p"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=None), TypeError, "top_k"),
])
def test_nan_inf_and_wrong_types_are_rejected_at_the_door(kwargs, error, match):
    """Bug B1 of the review: NaN passed `temperature < 0`, reached the sampler after the engine
    had advanced the request, and broke every later step for everyone."""
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_a_nan_request_harms_nobody(model):
    """Even a SamplingParams altered after construction is stopped at add_request (before the fix
    it was queued, and the first step that sampled it broke the engine); the neighbour gets
    exactly its answer."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=16))
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6))
    engine.step()
    bad = SamplingParams(temperature=1.0, max_tokens=6)
    object.__setattr__(bad, "temperature", float("nan"))
    with pytest.raises(ValueError, match="temperature must be finite"):
        engine.add_request([8, 9], bad)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done == {rid: generate(model, [5, 6, 7], 6)}
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(scheduling="fifo"), "scheduling"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_requests_rejected_others_finish(model):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=16))
    good = [[5, 6, 7], [9] * 20]
    rids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in good]
    engine.step()                                             # requests are now mid-flight
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.add_request([1, 256], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.add_request([-1], SamplingParams())
    with pytest.raises(ValueError, match="max_seq_len=128"):
        engine.add_request([1] * 128, SamplingParams())
    with pytest.raises(ValueError, match="num_blocks=20 x block_size=4 = 80"):
        engine.add_request([1] * 70, SamplingParams(max_tokens=20))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})
    with pytest.raises(TypeError, match="tokenizer"):
        engine.add_request("hello", SamplingParams())
    with pytest.raises(ValueError, match="unknown"):
        engine.abort_request("no-such-request")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], SamplingParams(), request_id=rids[0])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[r] for r in rids] == [generate(model, p, 6) for p in good]
    assert engine.num_free_blocks == engine.num_blocks


def test_abort_mid_prefill_and_mid_decode(model):
    engine = LLMEngine(model, EngineConfig(block_size=2, num_blocks=60, max_num_batched_tokens=8))
    a = engine.add_request(list(range(40)), SamplingParams(max_tokens=5))   # 5 prefill steps
    b = engine.add_request([3, 4], SamplingParams(max_tokens=30))
    c = engine.add_request([8, 9, 10], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort_request(a)                                   # mid-prefill
    for _ in range(3):
        engine.step()
    engine.abort_request(b)                                   # mid-decode
    engine.abort_request(b)                                   # finished: a no-op (as in vLLM)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[c].token_ids == generate(model, [8, 9, 10], 4)
    assert engine.requests[a].output().finish_reason == "abort"
    assert engine.num_free_blocks == engine.num_blocks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_block_leaks_random_schedules(model, data):
    cfg = EngineConfig(
        block_size=data.draw(st.sampled_from([1, 3, 4])),
        num_blocks=data.draw(st.integers(14, 40)),
        max_num_seqs=data.draw(st.sampled_from([1, 2, 8])),
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16])),
        enable_prefix_caching=data.draw(st.booleans()),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])))
    engine = LLMEngine(model, cfg)
    live = []
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "step", "step", "abort"]))
        if op == "add":
            prompt = data.draw(st.lists(st.integers(0, 15), min_size=1, max_size=12))
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 8)),
                                    n=data.draw(st.sampled_from([1, 1, 2])))
            if params.n > cfg.max_num_seqs:
                with pytest.raises(ValueError, match="max_num_seqs"):
                    engine.add_request(prompt, params)
                continue
            if len(prompt) + params.max_tokens > cfg.num_blocks * cfg.block_size:
                with pytest.raises(ValueError, match="whole pool"):
                    engine.add_request(prompt, params)
                continue
            live.append(engine.add_request(prompt, params))
        elif op == "step":
            engine.step()
        elif live:
            rid = live.pop(data.draw(st.integers(0, len(live) - 1)))
            if not engine.requests[rid].finished:
                engine.abort_request(rid)
        used = engine.num_blocks - engine.num_free_blocks
        assert used == len({b for s in engine.block_manager.seq_ids()
                            for b in engine.block_manager.block_table(s)})
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.block_manager.seq_ids() == []
    for req in engine.requests.values():          # everything not aborted is still exact
        assert req.finished
        if all(s.finish_reason != "abort" for s in req.seqs):
            ref = generate(model, req.prompt_token_ids, req.params.max_tokens)
            assert all(s.output_token_ids == ref for s in req.seqs)
