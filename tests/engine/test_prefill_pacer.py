"""Prompt chunks sized in time (engine/policies/prefill_pacer.py): a short request beside a long
prompt runs each of its steps beside a chunk worth `prefill_step_target_ms`, not
`long_prefill_token_threshold` tokens, on a machine whose steps are slow (a fake clock: each step
costs a fixed part plus a part per token, so nothing here is timed); and pacing changes no token."""
import random

import pytest
import torch

from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.policies.prefill_pacer import PrefillPacer
from minillm.engine.sampling_params import SamplingParams

# A loaded 2-core CPU, in simulated seconds: a step costs 0.2 s plus 20 ms per token, so a
# 384-token chunk takes 7.9 s (the issue: 6-18 s per chunk of SmolLM2-135M at load 7).
FIXED_S, PER_TOKEN_S = 0.2, 0.02
LONG, SHORT = [(7 * i) % 250 + 1 for i in range(6000)], [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=8192, dtype=torch.float64)


def slow_machine(engine, cost=lambda n: FIXED_S + PER_TOKEN_S * n):
    """Drive `engine.clock` by hand: each forward pass of n tokens advances it by cost(n)."""
    now = [0.0]
    engine.clock = lambda: now[0]
    execute = engine.runner.execute

    def timed(out):
        now[0] += cost(out.num_tokens)
        return execute(out)
    engine.runner.execute = timed
    return engine


def short_beside_long(model, config: EngineConfig, arrive_after: int = 3, max_tokens: int = 8):
    """A 6000-token prompt, then after `arrive_after` steps a 5-token one (max_tokens, ignore_eos):
    the short request's steps (arrival to last token) and the prompt tokens run in them."""
    engine = slow_machine(LLMEngine(model, config))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(LONG, SamplingParams(max_tokens=1))
    for _ in range(arrive_after):
        engine.step()
    rid = engine.add_request(SHORT, params)
    while not engine.requests[rid].finished:
        engine.step()
    m = engine.requests[rid].metrics
    rows = [r for r in engine.trace if m.arrival_step <= r["step"] <= m.finish_step]
    return {"steps": len(rows), "first_token_steps": m.first_token_step - m.arrival_step + 1,
            "long_tokens_beside": sum(r["num_prefill_tokens"] for r in rows) - len(SHORT),
            "e2e_s": m.e2e, "tokens": engine.requests[rid].seqs[0].output_token_ids}


def test_the_server_defaults_keep_a_short_request_beside_a_long_prompt_within_the_target(model):
    """With the server's defaults the short request gets its first token in the step after it
    arrives and its 8 tokens in 8 steps, as before; what changed is what runs beside it: on this
    slow machine each of its steps carries a chunk of about (target - 0.2 s) / 20 ms tokens, not
    384 (before the pacer: 3072 tokens beside it and 63 simulated seconds; at 500 ms, 128 and 4.4)."""
    from minillm.serve.cli import engine_options, parser
    config = EngineConfig(**engine_options(parser().parse_args([])))
    target_s = config.prefill_step_target_ms / 1e3
    run = short_beside_long(model, config)
    assert run["first_token_steps"] <= 2 and run["steps"] <= 8 + 1
    # tokens a step of target_s holds here, or the pacer's floor (one block) when that is fewer
    per_step = max(config.block_size, (target_s - FIXED_S) / PER_TOKEN_S)
    assert run["long_tokens_beside"] <= run["steps"] * per_step
    assert run["e2e_s"] <= run["steps"] * 1.5 * target_s
    assert run["tokens"] == generate(model, SHORT, 8)


def test_without_the_pacer_every_step_beside_it_carries_a_whole_chunk(model):
    """The old order, for contrast: partial prefills alone admit the short request at once, but
    every one of its steps carries a 384-token chunk, 7.9 s on this machine."""
    config = EngineConfig(max_num_batched_tokens=512, long_prefill_token_threshold=384,
                          max_num_partial_prefills=2)
    run = short_beside_long(model, config)
    assert run["long_tokens_beside"] == run["steps"] * 384
    assert run["e2e_s"] > run["steps"] * 7.9


def test_the_cap_climbs_and_falls_to_the_target_without_overshooting():
    """c' = c * T / (F + p * c): from below the cap rises to the fixed point (T - F) / p and never
    passes it; from above it falls to it; a fixed part above the target leaves the floor."""
    class Sched:
        max_num_batched_tokens, prefill_chunk_cap = 512, None
    F, p, T = 0.2, 0.02, 1.0
    best = (T - F) / p                                       # 40 tokens
    for start in (16, 512):
        pacer = PrefillPacer(Sched(), T * 1e3, floor=16)
        pacer.cap = start
        caps = []
        for _ in range(30):
            pacer.observe(pacer.cap, F + p * pacer.cap)
            caps.append(pacer.cap)
        assert caps[-1] in (39, 40)
        assert all(c <= best for c in caps) if start < best else all(c >= best - 1 for c in caps)
    pacer = PrefillPacer(Sched(), 100, floor=16)             # 0.1 s < the fixed part: the floor
    pacer.observe(16, F + p * 16)
    assert pacer.cap == 16
    pacer.observe(0, 5.0)                                    # a decode-only step moves nothing
    assert pacer.cap == 16


def test_pacing_changes_no_token(model):
    """Prompts of several lengths, arriving over time, on a machine whose step costs jump at random
    (so the chunk boundaries are ragged): every output equals `generate` alone."""
    rng = random.Random(0)
    prompts = [[(3 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate((700, 37, 260, 5, 1200))]
    engine = slow_machine(LLMEngine(model, EngineConfig(
        max_num_batched_tokens=512, long_prefill_token_threshold=384, max_num_partial_prefills=2,
        prefill_step_target_ms=1000)), cost=lambda n: rng.uniform(0.05, 0.6) + 0.01 * n)
    rids = []
    for p in prompts:
        rids.append(engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    chunks = {r["num_prefill_tokens"] for r in engine.trace}
    assert len(chunks) > 5                                   # the chunks did move
    for p, rid in zip(prompts, rids):
        assert engine.requests[rid].seqs[0].output_token_ids == generate(model, p, 6)


@pytest.mark.parametrize("bad, match", [
    (dict(prefill_step_target_ms=-1.0), "prefill_step_target_ms"),
    (dict(prefill_step_target_ms=float("nan")), "prefill_step_target_ms"),
    (dict(prefill_step_target_ms="1000"), "prefill_step_target_ms"),
    (dict(prefill_step_target_ms=500, enable_chunked_prefill=False), "enable_chunked_prefill"),
])
def test_bad_targets_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_the_server_paces_by_default_and_its_flag_turns_it_off(model):
    from minillm.serve.cli import engine_options, parser
    assert EngineConfig().prefill_step_target_ms is None and LLMEngine(model).pacer is None
    cfg = EngineConfig(**engine_options(parser().parse_args([])))
    assert cfg.prefill_step_target_ms > 0
    engine = LLMEngine(model, cfg)
    assert engine.pacer is not None and engine.scheduler.prefill_chunk_cap == cfg.block_size
    off = EngineConfig(**engine_options(parser().parse_args(["--prefill-step-target-ms", "0"])))
    assert LLMEngine(model, off).pacer is None
    plain = EngineConfig(**engine_options(parser().parse_args(["--no-enable-chunked-prefill"])))
    assert plain.prefill_step_target_ms is None
