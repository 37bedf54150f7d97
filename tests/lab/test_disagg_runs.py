"""Chapter 11's instruments: step costs read off the engine's trace and fitted, the long-among-
short workload, and the measured-against-predicted comparison (no server started here: the
benchmark does that; no timing decides a test)."""
import math

import pytest

from minillm.analysis.disagg_sim import SimRequest, poisson_arrivals, simulate_colocated
from minillm.analysis.step_fit import StepCosts
from minillm.lab.disagg_runs import (Workload, compare, comparison_table, drive, long_among_short,
                                     predict, probe_step_costs, sim_requests)
from minillm.lab.serve_metrics import RequestResult
from minillm.lab.step_costs import costs_table, measure_step_costs
from minillm.model.loading import tiny_model

COSTS = StepCosts(0.01, 1e-4, 0.0, 0.01, 0.0, 0.0)


def test_step_costs_come_from_the_engines_steps(one_thread):
    res = measure_step_costs(tiny_model(vocab_size=64), prompt_lengths=(4, 8, 16),
                             batch_sizes=(1, 2), contexts=(4, 8), decode_steps=2, rounds=1)
    assert [ls for ls, _ in res["prefill"]] == [[4], [8], [16]]
    # B sequences at contexts S and S + 1 (the tokens each has cached as it decodes)
    assert sorted(tuple(cs) for cs, _ in res["decode"]) == sorted(
        tuple([s + j] * b) for b in (1, 2) for s in (4, 8) for j in range(2))
    assert all(t > 0 for _, t in res["prefill"] + res["decode"])
    assert isinstance(res["costs"], StepCosts) and "prefill" in costs_table(res)
    assert {tuple(c) for c, _, _ in res["mixed"]} <= {((4, 0),)}


def test_step_costs_refuse_too_few_cases():
    with pytest.raises(ValueError, match="prompt_lengths"):
        measure_step_costs(tiny_model(vocab_size=64), prompt_lengths=(4, 4, 8))


def test_long_among_short(tok):
    w = long_among_short(tok, n=8, rate=2.0, seed=1, long_fraction=0.25)
    longs = [n for n in w.prompt_tokens if n >= 300]
    assert len(longs) == 2 and all(395 <= n <= 805 for n in longs)
    assert all(15 <= n <= 65 for n in w.prompt_tokens if n < 300)
    assert w.arrivals == poisson_arrivals(2.0, 8, 1)
    assert long_among_short(tok, n=8, rate=2.0, seed=1).prompts == w.prompts
    with pytest.raises(ValueError, match="long_fraction"):
        long_among_short(tok, n=8, long_fraction=2.0)


def _as_measured(sim) -> list[RequestResult]:
    return [RequestResult(ok=True, ttft=r.ttft, itl=r.itls, e2e=r.finish_s - r.request.arrival_s,
                          prompt_tokens=r.request.prompt_tokens, output_tokens=r.request.output_tokens)
            for r in sim]


def test_a_perfect_prediction_has_no_error():
    w = Workload(1.0, 0, ["a"] * 4, [30, 500, 20, 40], 8)
    pred = predict("colocated", sim_requests(w), COSTS)
    duration = max(r.finish_s for r in pred)
    row = compare(_as_measured(pred), duration, pred, ttft_s=0.2, itl_s=0.05)
    assert all(v == 0 for v in row["error"].values() if v is not None)
    assert row["failed"] == 0
    row.update(layout="colocated", rate=1.0)
    assert "colocated" in comparison_table([row])


def test_sim_requests_take_the_servers_token_counts():
    w = Workload(1.0, 0, ["a", "b"], [30, 40], 8)
    got = sim_requests(w, [RequestResult(ok=True, prompt_tokens=31, output_tokens=8),
                           RequestResult(ok=False, error="boom")])
    assert got == [SimRequest(0.0, 31, 8), SimRequest(w.arrivals[1], 40, 8)]


def test_disaggregated_prediction_ships_the_kv():
    w = Workload(1.0, 0, ["a"] * 2, [100, 20], 4)
    from minillm.model.config import get_config
    pred = predict("disaggregated", sim_requests(w), COSTS, COSTS, 1e6, get_config("smollm2-135m"))
    # 100 tokens of fp32 KV (46,080 B each) over 1 MB/s: 4.6 s after the prefill
    assert pred[0].transfer_done_s - pred[0].prefill_done_s == pytest.approx(4.608)
    assert math.isnan(simulate_colocated([SimRequest(0, 5, 2)], COSTS)[0].transfer_done_s)
    with pytest.raises(ValueError, match="layout"):
        predict("mixed", sim_requests(w), COSTS)


def test_probe_and_drive_a_running_server(tok):
    """Through the HTTP API of a tiny model's server: the probes give one prefill sample per
    length and one decode sample per (batch, context); the workload comes back whole."""
    from minillm.serve import running
    from serve_tiny import MODEL, tiny_llm
    with running(tiny_llm(tok, max_seq_len=512), served_model_name=MODEL) as srv:
        probe = probe_step_costs(srv.base_url, MODEL, tok, prompt_lengths=(8, 16, 24),
                                 batch_sizes=(1, 2), contexts=(8, 16), max_tokens=6, rounds=1)
        w = long_among_short(tok, n=3, rate=50.0, long_fraction=0.0, max_tokens=4)
        results, duration = drive(srv.base_url, MODEL, w)
    assert len(probe["prefill"]) == 3 and len(probe["decode"]) == 4
    assert isinstance(probe["costs"], StepCosts)
    assert all(r.ok and r.output_tokens == 4 for r in results) and duration > 0
    row = compare(results, duration, predict("colocated", sim_requests(w, results), probe["costs"]),
                  ttft_s=10.0, itl_s=10.0)
    assert row["measured"]["attainment"] == 1.0 and row["failed"] == 0
