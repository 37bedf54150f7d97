"""lab/slo_step.py: the load step's arrivals, the rolling P95 and recovery arithmetic against
hand-worked cases, and one small run end to end on a tiny model (timing decides nothing here:
only the shape of what comes back and the counts that do not depend on the clock)."""
import json

import pytest

from minillm import tiny_model
from minillm.engine.policies.slo_controller import rolling_p95
from minillm.lab.slo_step import calibrate, compare, recovery, step_workload


def test_step_workload_doubles_the_rate_in_the_step():
    work = step_workload(2.0, 100, 100, 100, vocab_size=64, seed=0)
    counts = [sum(a <= w.arrival < a + 100 for w in work) for a in (0, 100, 200)]
    assert 150 < counts[0] < 250 and 330 < counts[1] < 470 and 150 < counts[2] < 250
    assert all(16 <= len(w.prompt_token_ids) <= 64 and 8 <= w.max_tokens <= 16 for w in work)
    assert work == step_workload(2.0, 100, 100, 100, vocab_size=64, seed=0)    # seeded
    with pytest.raises(ValueError, match="rate"):
        step_workload(0, 1, 1, 1, 64)


def test_rolling_p95_and_recovery():
    points = [(0.5, 1.0), (1.5, 3.0), (2.5, 5.0)]
    assert rolling_p95(points, 2.0, 2.0) == pytest.approx(2.9)        # 1.0 and 3.0, linear
    assert rolling_p95(points, 10.0, 2.0) is None
    targets = {"tpot": 1.0}
    row = lambda t, v: {"t": t, "p95_tpot": v, "p95_ttft": None}       # noqa: E731
    over_then_back = [row(10, 0.5), row(11, 2.0), row(12, 1.5), row(13, 0.9), row(14, 0.8)]
    assert recovery(over_then_back, 10, 15, targets) == 3.0           # within from t=13 on
    assert recovery([row(10, 0.5), row(11, None)], 10, 12, targets) == 0.0
    assert recovery(over_then_back[:3], 10, 13, targets) is None      # still over at the end


def test_compare_small_run_on_a_tiny_model():
    model = tiny_model(vocab_size=64)
    res = compare(model, budgets=(16,), max_budget=64, rate=4.0, targets_ms={"ttft": 50, "tpot": 10},
                  base_s=0.3, step_s=0.6, after_s=0.3, seats=4, interval_s=0.2, rounds=2)
    assert set(res["runs"]) == set(res["mean"]) == {"controller", "fixed_16"}
    assert len(res["rounds"]) == 2 and res["rounds"][1]["fixed_16"]["requests"] == len(
        [r for r in res["runs"]["fixed_16"]["timeline"] for _ in range(r["sent"])])
    ctl, fixed = res["runs"]["controller"], res["runs"]["fixed_16"]
    assert ctl["summary"]["requests"] == fixed["summary"]["requests"] > 0     # one workload
    assert sum(r["sent"] for r in ctl["timeline"]) == ctl["summary"]["requests"]
    assert {r["budget"] for r in fixed["timeline"]} == {16} and fixed["decisions"] == []
    assert all(4 <= r["budget"] <= 64 for r in ctl["timeline"])
    assert 0 <= ctl["summary"]["attainment"] <= 1
    json.dumps(res)                                                    # a plain, JSON-ready dict


def test_calibrate_returns_targets_between_or_above():
    cal = calibrate(tiny_model(vocab_size=64), rate=8.0, budget=32, seconds=0.4, seats=4)
    for k in ("ttft", "tpot"):
        lo, hi = 1e3 * cal["p95_r"][k], 1e3 * cal["p95_2r"][k]
        assert cal[k] > 0 and (lo - 1 <= cal[k] <= hi + 1 if hi > lo else cal[k] == round(1.2 * lo))


def test_slo_step_plot_draws_every_run():
    from minillm.viz.plotting import use_headless_backend
    use_headless_backend()
    import matplotlib.pyplot as plt
    from minillm.viz.slo import slo_step_plot
    res = compare(tiny_model(vocab_size=64), budgets=(16,), max_budget=64, rate=4.0,
                  targets_ms={"ttft": 50, "tpot": 10}, base_s=0.3, step_s=0.6, after_s=0.3, seats=4)
    fig = slo_step_plot(res)
    assert len(fig.axes) == 4 and len(fig.axes[1].lines) == 3       # 2 runs + the target
    plt.close(fig)
