"""The prefill-stall harness: real engine runs give one stamp per token and the long prompt's
arrival after every short request has its tokens; the simulated replay, on hand-picked costs,
gives the gaps worked out here by hand (a colocated stall of one long prefill step, none
disaggregated)."""
import pytest

from minillm import tiny_model
from minillm.analysis.disagg_sim import SimConfig
from minillm.analysis.step_fit import StepCosts
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.prefill_stall import (engine_config, simulate_token_times, stall_summary,
                                       token_times)


def test_a_real_run_stamps_every_token_and_injects_after_the_shorts():
    model = tiny_model()
    shorts = [[1, 2, 3], [4, 5, 6, 7]]
    run = token_times(LLMEngine(model, engine_config()), shorts, list(range(10, 60)),
                      inject_after=3, max_tokens=6, long_max_tokens=2)
    assert {k: len(v) for k, v in run["times"].items()} == {"short-0": 6, "short-1": 6, "long": 2}
    assert run["prompt_tokens"] == {"short-0": 3, "short-1": 4, "long": 50}
    third = max(run["times"][k][2] for k in ("short-0", "short-1"))
    assert run["long_arrival_s"] >= third
    s = stall_summary(run)
    assert s["max_gap_s"] >= s["median_gap_s"] > 0 and s["long_ttft_s"] > 0


def test_the_simulated_stall_by_hand():
    # decode steps 0.1 s; a prefill step costs 1 s + 0.01 s per token; a mixed step pays both
    # parts' per-token terms and the larger fixed cost (step_fit.StepCosts.step_seconds)
    costs = StepCosts(1.0, 0.01, 0.0, 0.1, 0.0, 0.0)
    run = {"long_arrival_s": 2.5, "prompt_tokens": {"short-0": 10, "long": 100},
           "max_tokens": {"short-0": 40, "long": 1}, "times": {}}
    cfg = SimConfig(max_num_batched_tokens=512, long_prefill_token_threshold=0)
    colo = stall_summary(simulate_token_times(run, "colocated", costs, config=cfg))
    # the long prompt's one prefill step carries the short decode: max(1, 0.1) + 0.01 * 100 = 2 s
    assert colo["max_gap_s"] == pytest.approx(2.0)
    assert colo["median_gap_s"] == pytest.approx(0.1)
    dis = stall_summary(simulate_token_times(run, "disaggregated", costs, config=cfg))
    assert dis["max_gap_s"] == pytest.approx(0.1)                 # the decode engine never prefills
    assert dis["long_ttft_s"] == pytest.approx(2.0)               # 1 + 0.01 * 100 on its own engine


def test_bad_layout_and_injection_point():
    run = {"long_arrival_s": 0.0, "prompt_tokens": {"long": 5}, "max_tokens": {"long": 1}, "times": {}}
    with pytest.raises(ValueError, match="layout"):
        simulate_token_times(run, "split", StepCosts(0, 0, 0, 0.1, 0, 0))
    with pytest.raises(ValueError, match="inject_after"):
        token_times(None, [[1]], [2], inject_after=0)


def test_the_simulated_long_prompt_arrives_by_the_runs_rule():
    # a run slowed by other work: its long prompt came at 100 s, long after the simulated shorts
    # would have finished; the replay puts it where the rule puts it (each short has 4 tokens)
    costs = StepCosts(1.0, 0.01, 0.0, 0.1, 0.0, 0.0)
    run = {"long_arrival_s": 100.0, "prompt_tokens": {"short-0": 10, "short-1": 10, "long": 100},
           "max_tokens": {"short-0": 24, "short-1": 24, "long": 1}, "times": {}, "inject_after": 4}
    cfg = SimConfig(max_num_batched_tokens=512, long_prefill_token_threshold=0)
    for layout in ("colocated", "disaggregated"):
        sim = simulate_token_times(run, layout, costs, config=cfg)
        assert all(sum(t <= sim["long_arrival_s"] for t in sim["times"][k]) == 4 for k in ("short-0", "short-1"))
        assert stall_summary(sim)["max_gap_s"] > 0
