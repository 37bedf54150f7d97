"""Latency in steps, batch occupancy and the offered-load sweep (minillm/lab/workloads.py), checked
against schedules worked out by hand."""
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from minillm.lab.workloads import (WorkloadRequest, batch_occupancy, load_sweep, replay,
                                   step_latencies)
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.model.loading import tiny_model
from minillm.viz.serving import latency_cdfs, load_sweep_plot, occupancy_plot


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab_size=64, seed=0, dtype=torch.float64)


def test_one_slot_queue_by_hand(tiny):
    # max_num_seqs=1: request B waits for all of A's 5 tokens, then takes 3 steps of its own
    work = [WorkloadRequest(0.0, [1, 2, 3], 5), WorkloadRequest(0.0, [4, 5], 3)]
    eng = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=16, max_num_seqs=1))
    lat = step_latencies(replay(eng, work, time_unit="steps"))
    assert lat == {"ttft": [1.0, 6.0], "tpot": [1.0, 1.0], "e2e": [5.0, 8.0]}
    assert batch_occupancy(eng.trace, 1) == 1.0
    assert batch_occupancy(eng.trace, 4) == 0.25


def test_static_occupancy_by_hand(tiny):
    # one static batch of 2: lengths 4 and 1 -> steps hold 2, 1, 1, 1 live requests
    work = [WorkloadRequest(0.0, [1, 2], 4), WorkloadRequest(0.0, [3], 1)]
    eng = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=16, max_num_seqs=2, scheduling="static"))
    replay(eng, work, time_unit="steps")
    assert batch_occupancy(eng.trace, 2) == pytest.approx(5 / 8)


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_occupancy([{"num_seqs": 1}], 0)
    with pytest.raises(ValueError, match="trace"):
        batch_occupancy([], 4)
    with pytest.raises(ValueError, match="loads"):
        load_sweep(tiny, [], EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match="loads"):
        load_sweep(tiny, [math.inf], EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match="unit"):
        load_sweep_plot([{"load": 1.0}], unit="s")


def test_sweep_queueing_grows_with_load(tiny):
    cfg = EngineConfig(block_size=8, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=128)
    rows = load_sweep(tiny, [0.2, 1.5], cfg, num_requests=40, prompt_len=(4, 16), output_len=(2, 24))
    low, high = rows
    assert low["rate"] < high["rate"] and low["load"] == 0.2
    assert high["ttft_p99"] > 2 * low["ttft_p99"]           # the queue builds past saturation
    assert low["tpot_p50"] == high["tpot_p50"] == 1.0       # a running request decodes every step
    assert 0 < low["occupancy"] < high["occupancy"] <= 1
    for unit in ("steps", "ms"):
        load_sweep_plot(rows, unit=unit)


def test_plots_accept_old_and_new_arguments(tiny):
    eng = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=16, max_num_seqs=2))
    outs = replay(eng, [WorkloadRequest(0.0, [1, 2], 3)] * 3, time_unit="steps")
    occupancy_plot({"a": eng.trace}, num_blocks=16)
    occupancy_plot({"a": eng.trace}, num_blocks={"a": 16}, max_num_seqs=2)
    occupancy_plot({"a": eng.trace})
    with pytest.raises(ValueError, match="num_blocks"):
        occupancy_plot({"a": eng.trace}, num_blocks={"b": 16})
    latency_cdfs({"a": [o.metrics for o in outs]})


def test_requests_queued_behind_a_long_prompt_wait_for_its_chunks():
    """Head-of-line blocking, worked by hand: 4 decodes, then a 256-token prompt and three
    16-token prompts behind it at step 4, budget 64 (decode-first). Steps 4-7 carry 60 tokens of
    the long prompt each; step 8 its last 16 and 16 + 16 + 12 of the short ones; step 9 the last
    4. So TTFT in steps: long 5, shorts 5, 5, 6; the decodes never miss a step."""
    from minillm.lab.workloads import long_prompt_workload, request_latencies
    work = long_prompt_workload(256, num_running=4, output_len=16, long_prompt_len=256,
                                arrival=4, num_behind=3)
    assert [len(w.prompt_token_ids) for w in work] == [16] * 4 + [256] + [16] * 3
    assert [w.arrival for w in work] == [0.0] * 4 + [4.0] * 4
    assert work[:5] == long_prompt_workload(256, num_running=4, output_len=16,
                                            long_prompt_len=256, arrival=4)   # same draws
    model = tiny_model(vocab_size=256, seed=0, dtype=torch.float64, max_seq_len=1024)
    eng = LLMEngine(model, EngineConfig(max_num_batched_tokens=64))
    lat = request_latencies(replay(eng, work, time_unit="steps"), eng.trace)
    assert [r["ttft_steps"] for r in lat] == [1] * 4 + [5, 5, 5, 6]
    assert [r["max_gap_steps"] for r in lat[:4]] == [1] * 4
    assert all(len(r["itl"]) == 15 for r in lat[:4])
    with pytest.raises(ValueError, match="num_behind"):
        long_prompt_workload(256, num_behind=-1)
