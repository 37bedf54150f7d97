"""Bad input is rejected at the door with a clear message, and the other requests still finish
exactly as `minillm.generate` would; aborts at any point never leak a block (property test)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import SequenceStatus


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64, max_seq_len=128)


@pytest.fixture(scope="module")
def small_vocab_model():
    """8 tokens: outputs repeat the context, so the n-gram lookup keeps finding drafts."""
    return tiny_model(vocab_size=8, seed=0, dtype=torch.float64, max_seq_len=128)


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
    """A SamplingParams altered after construction (a frozen dataclass can be, through
    object.__setattr__) is checked only once, when built: it is queued, cannot be sampled, and
    ends alone with "abort"; the neighbour gets exactly its answer and no block leaks."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=16))
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6))
    engine.step()
    bad = SamplingParams(temperature=1.0, max_tokens=6)
    object.__setattr__(bad, "temperature", float("nan"))
    bad_rid = engine.add_request([8, 9], bad)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.finish_reason, out.token_ids)
    assert done[rid] == ("length", generate(model, [5, 6, 7], 6))
    assert done[bad_rid][0] == "abort"
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


def _random_ops(engine, model, data, sampled: bool = False, alphabet: int = 16) -> None:
    """Random add / step / abort, checking after each that the used blocks are exactly those in
    some block table; then run to the end: the pool is whole again, and every greedy request
    that was not aborted got exactly `generate`'s tokens."""
    cfg, live = engine.config, []
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "step", "step", "abort"]))
        if op == "add":
            prompt = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=12))
            sampling = {}
            if sampled and data.draw(st.booleans()):
                sampling = dict(temperature=data.draw(st.sampled_from([0.7, 1.0])),
                                top_p=data.draw(st.sampled_from([1.0, 0.9])),
                                seed=data.draw(st.sampled_from([None, 1, 2])))
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 8)),
                                    n=data.draw(st.sampled_from([1, 1, 2])), **sampling)
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
        elif live:   # anywhere: waiting, mid-prefill, swapped, forked, between verify steps
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
        assert all(len(s.output_token_ids) <= req.params.max_tokens for s in req.seqs)
        if req.params.temperature == 0 and all(s.finish_reason != "abort" for s in req.seqs):
            ref = generate(model, req.prompt_token_ids, req.params.max_tokens)
            assert all(s.output_token_ids == ref for s in req.seqs)


def _pool_and_batch(data) -> dict:
    """The EngineConfig fields both leak property tests draw: pool, batch limits, prefix cache."""
    return dict(block_size=data.draw(st.sampled_from([1, 3, 4])),
                num_blocks=data.draw(st.integers(14, 40)),
                max_num_seqs=data.draw(st.sampled_from([1, 2, 8])),
                max_num_batched_tokens=data.draw(st.sampled_from([8, 16])),
                enable_prefix_caching=data.draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_block_leaks_random_schedules(model, data):
    cfg = EngineConfig(
        **_pool_and_batch(data),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])))
    _random_ops(LLMEngine(model, cfg), model, data)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_block_leaks_with_speculation_static_batching_and_sampling(small_vocab_model, data):
    """Review T5: the same property with n-gram speculation (K = 2), static scheduling, chunking
    off and sampled requests (seeded or not) in the mix, so aborts also land between verify steps
    and on sequences whose drafts were rolled back."""
    cfg = EngineConfig(
        **_pool_and_batch(data),
        enable_chunked_prefill=data.draw(st.booleans()),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])),
        scheduling=data.draw(st.sampled_from(["continuous", "static"])),
        num_speculative_tokens=data.draw(st.sampled_from([0, 2, 2])),
        speculative_method="ngram")
    model = small_vocab_model
    _random_ops(LLMEngine(model, cfg), model, data, sampled=True, alphabet=8)


def test_abort_a_forked_request_while_swapped_between_verify_steps(small_vocab_model):
    """Random schedules rarely reach this corner, so it is built by hand: a request with n = 2
    that has verified drafts, one completion running and one swapped out, is aborted; the
    swapped KV and both block tables go, and the other requests still get exactly their answer."""
    model = small_vocab_model
    engine = LLMEngine(model, EngineConfig(block_size=2, num_blocks=8, max_num_batched_tokens=16,
                                           preemption_mode="swap", num_speculative_tokens=2,
                                           speculative_method="ngram"))
    a = engine.add_request([1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=10, n=2))
    b = engine.add_request([4, 5, 4, 5], SamplingParams(max_tokens=10))
    req = engine.requests[a]
    for _ in range(20):
        engine.step()
        if any(s.status is SequenceStatus.SWAPPED for s in req.seqs):
            break
    statuses = {s.status for s in req.seqs}
    assert len(req.seqs) == 2 and statuses == {SequenceStatus.RUNNING, SequenceStatus.SWAPPED}
    assert req.metrics.num_spec_steps > 0 and not req.finished
    c = engine.add_request([6, 7, 6], SamplingParams(max_tokens=6))
    engine.abort_request(a)
    assert all(s.swapped_kv is None for s in req.seqs)
    assert not set(engine.block_manager.seq_ids()) & {s.seq_id for s in req.seqs}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[b].output().token_ids == generate(model, [4, 5, 4, 5], 10)
    assert engine.requests[c].output().token_ids == generate(model, [6, 7, 6], 6)
    assert engine.num_free_blocks == engine.num_blocks
