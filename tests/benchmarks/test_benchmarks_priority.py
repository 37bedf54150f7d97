"""benchmarks.priority, minillm.lab.priority and the workload pieces they use: the record of a
--quick run (tiny model), goodput and percentiles against hand-made metrics and numpy, the budget rule, the mix workload and
replay's priorities and simulated clock. No speed is asserted."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.__main__ import main as bench_main
from benchmarks import priority as bp
from minillm import tiny_model
from minillm.lab import priority as lp
from minillm.lab.workloads import priority_mix_workload, replay
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.policies.priority import SEED_CLASSES
from minillm.engine.sequence import RequestMetrics


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=128, seed=0)


def test_quick_run_writes_a_record_a_figure_and_follows_the_budget_rule(monkeypatch, tmp_path, capsys):
    import minillm.model.loading
    monkeypatch.setattr(minillm.model.loading, "load_model", lambda *a, device=None, **k:
                        (tiny_model(vocab_size=128, device=device), None))
    torch.set_num_threads(1)
    bench_main(["priority", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "priority_cpu.json").read_text())
    assert (tmp_path / "priority_cpu.png").exists()
    assert set(rec["policies"]) == {"fcfs", "priority"}
    for policy in rec["policies"].values():
        assert sum(policy[c]["n"] for c in ("interactive", "batch")) == bp.SETTINGS[True]["num_requests"]
    t1 = rec["solo_step_s"]
    assert rec["targets_s"]["interactive"] == pytest.approx({"ttft": 8 * t1, "tpot": 3 * t1})
    tun = rec["tuning"]
    assert [r["budget"] for r in tun["rows"]] == sorted(bp.SETTINGS[True]["budgets"])
    ok = [r["budget"] for r in tun["rows"] if r["tpot_p95"] <= tun["sla_tpot_p95"]]
    assert tun["chosen"] == (max(ok) if ok else None)
    assert "chosen max_num_batched_tokens" in capsys.readouterr().out


def _out(prio_ttft_tpot, finish="length"):
    ttft, tpot = prio_ttft_tpot
    m = RequestMetrics(0.0, first_token_time=ttft, finish_time=ttft + 2 * tpot, first_token_step=0,
                       num_generated=3)
    return SimpleNamespace(metrics=m, finish_reason=finish, token_ids=[1, 2, 3])


def test_class_table_goodput_and_percentiles_by_hand():
    """Interactive targets ttft 1, tpot 1: of (0.5, 0.5), (2, 0.5), (0.5, 3) only the first meets
    both; the run lasted 4 s, so goodput 0.25 req/s. Percentiles are numpy's."""
    work = [SimpleNamespace(priority=0)] * 3 + [SimpleNamespace(priority=2)]
    outs = [_out((0.5, 0.5)), _out((2.0, 0.5)), _out((0.5, 3.0)), _out((9.0, 0.1))]
    engine = SimpleNamespace(trace=[{"t_start": 1.0, "t_end": 2.0}, {"t_start": 4.0, "t_end": 5.0}])
    targets = {"interactive": {"ttft": 1.0, "tpot": 1.0}, "batch": {"ttft": 10.0, "tpot": 1.0}}
    t = lp.class_table(outs, work, engine, targets)
    assert (t["interactive"]["met"], t["interactive"]["goodput_rps"]) == (1, 0.25)
    assert (t["batch"]["met"], t["batch"]["goodput_rps"]) == (1, 0.25)
    assert t["interactive"]["ttft_p95"] == pytest.approx(np.percentile([0.5, 2.0, 0.5], 95))
    assert t["interactive"]["tpot_p50"] == pytest.approx(0.5)


def test_mix_workload_and_replay_pass_priorities_only_under_priority(model):
    work = priority_mix_workload(40, 2.0, 128, seed=1, interactive_share=0.5,
                                 interactive=((2, 4), (1, 3), 0), batch=((5, 8), (6, 9), 2))
    arrivals = [w.arrival for w in work]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    for w in work:
        lo_p, lo_o = ((2, 4), (1, 3)) if w.priority == 0 else ((5, 8), (6, 9))
        assert w.priority in (0, 2) and lo_p[0] <= len(w.prompt_token_ids) <= lo_p[1]
        assert lo_o[0] <= w.max_tokens <= lo_o[1]
    assert 0 < sum(w.priority == 0 for w in work) < 40
    small = work[:8]
    fcfs = replay(LLMEngine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16)), small, "steps")
    prio = replay(LLMEngine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                                scheduling_policy="priority",
                                                priority_classes=SEED_CLASSES)), small, "steps")
    assert [o.metrics.priority for o in fcfs] == [0] * 8
    assert [o.metrics.priority for o in prio] == [w.priority for w in small]
    with pytest.raises(ValueError):
        priority_mix_workload(4, 1.0, 128, interactive_share=1.5)


def test_replay_step_seconds_is_a_simulated_clock(model):
    """Every step lasts dt: TTFT = (first-token step - arrival step) x dt exactly."""
    work = priority_mix_workload(6, 0.5, 128, seed=2, interactive=((2, 4), (2, 3), 0),
                                 batch=((2, 4), (2, 3), 0))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=8))
    outs = replay(engine, work, "steps", step_seconds=0.25)
    for o in outs:
        m = o.metrics
        assert m.ttft == pytest.approx((m.first_token_step - m.arrival_step) * 0.25)
    for bad, unit in ((0, "steps"), (-1.0, "steps"), (True, "steps"), (0.1, "seconds")):
        with pytest.raises(ValueError, match="step_seconds"):
            replay(engine, work, unit, step_seconds=bad)


def test_overload_mix_spans_the_seconds_asked_with_three_classes(model):
    work = lp.overload_mix(model, seconds=1.0, step_seconds=0.02, seats=4, load=2.0, seed=0)
    assert {w.priority for w in work} == {0, 1, 2}
    assert 0 < work[-1].arrival < 50 and [w.arrival for w in work] == sorted(w.arrival for w in work)
    slow = lp.overload_mix(model, seconds=1.0, step_seconds=0.5, seats=4, load=2.0, seed=0)
    assert slow[-1].arrival < 40 <= slow[-1].arrival + 5          # at least min_steps=40 steps of arrivals
    with pytest.raises(ValueError):
        lp.overload_mix(model, seconds=0, step_seconds=0.02)


def test_seed_bounds_fire_under_sustained_overload_and_reject_keeps_interactive_first(model):
    """Three classes at twice what 4 seats serve for 60 steps of 50 ms: the 200 ms and 1000 ms
    bounds fire (as rejections or promotions), and promotion never helps the interactive tail."""
    work = lp.overload_mix(model, seconds=3.0, step_seconds=0.05, seats=4, load=2.0, seed=0)
    rej = lp.try_seed_bounds(model, work, 0.05, "reject")["classes"]
    pro = lp.try_seed_bounds(model, work, 0.05, "promote")["classes"]
    assert sum(c["n"] for c in rej.values()) == len(work)
    assert rej["standard"]["rejected"] > 0 and rej["batch"]["rejected"] > 0
    assert all(c["promoted"] == 0 for c in rej.values())
    assert pro["batch"]["promoted"] > 0 and all(c["rejected"] == 0 for c in pro.values())
    assert rej["interactive"]["ttft_p95_s"] <= pro["interactive"]["ttft_p95_s"]
    assert [rej[n]["bound_s"] for n in ("interactive", "standard", "batch")] == [0.05, 0.2, 1.0]


def test_offered_load_plot_draws_three_panels_with_the_burst_at_the_edge():
    import matplotlib
    matplotlib.use("Agg")
    from minillm.viz.serve import offered_load_plot
    summ = lambda r: {"request_throughput": r, "ttft_ms": {"median": 1.0, "p99": 2.0},
                      "tpot_ms": {"median": 1.0, "p99": 2.0}}
    rows = [{"offered_rate": 0.5, "summary": summ(0.5)}, {"offered_rate": float("inf"), "summary": summ(2.0)}]
    fig = offered_load_plot(rows, capacity=2.0)
    assert len(fig.axes) == 3 and fig.axes[0].get_xticklabels()[-1].get_text() == "all at\nonce"
