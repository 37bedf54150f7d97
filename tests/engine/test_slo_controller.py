"""The SLO controller (engine/policies/slo_controller.py): the P95 and the offline budget choice
by hand and against numpy; its rule on synthetic latencies and a fake clock (moves the right way,
hysteresis, bounds under any sequence of windows), the engine's wiring (the scheduler really runs
with the moved budget; queue bounds move with priority classes), and exactness: greedy tokens of
the real model identical with and without the controller while it moves the budget (chunked
prefill boundaries move, the tokens must not)."""
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.policies.priority import PriorityClass
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.policies.slo_controller import SLOController, choose_budget, p95, rolling_p95

TPOT_MS, TTFT_MS = 100.0, 1000.0


def test_p95_and_the_offline_budget_choice_by_hand():
    import numpy as np
    xs = [0.3, 0.1, 0.25, 0.12, 0.4, 0.05, 0.2]
    assert p95(xs) == pytest.approx(np.percentile(xs, 95)) and p95([]) is None
    assert rolling_p95([(1.0, 0.5), (2.0, 9.0)], 1.5, 1.0) == 0.5      # (0.5, 1.5] holds one point
    # P95 per budget against a 0.15 s target: 16 and 32 meet it (32 exactly), 64 is over
    assert choose_budget({64: 0.2, 16: 0.1, 32: 0.15}, 0.15) == 32
    assert choose_budget({16: 0.3, 32: 0.4}, 0.15) is None


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two threads fighting other processes made a
    16-token step ~10x slower. Tokens do not depend on it (both runs of a comparison share it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ctl(budget=64, seats=8, classes=(), **kw):
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=seats, slo_interval_s=1.0,
                       slo_tpot_p95_ms=kw.pop("tpot", TPOT_MS), slo_ttft_p95_ms=kw.pop("ttft", TTFT_MS),
                       scheduling_policy="priority" if classes else "fcfs", priority_classes=classes)
    sched = SimpleNamespace(max_num_batched_tokens=budget)
    return SLOController(cfg, sched, **kw), sched


def _interval(ctl, t, tpot=None, ttft=None, n=10):
    """n samples of each given latency (seconds) inside (t - 1, t), then the decision at t."""
    for i in range(n):
        at = t - 1 + (i + 1) / (n + 1)
        if tpot is not None:
            ctl.record("tpot", at, tpot)
        if ttft is not None:
            ctl.record("ttft", at, ttft)
    return ctl.tick(t)


def test_tpot_over_lowers_calm_raises_back():
    ctl, sched = _ctl()
    assert ctl.tick(0.0) is None and ctl.budget == 64            # the first tick only sets the due time
    assert _interval(ctl, 1.0, tpot=0.2)["action"] == "budget down"
    assert ctl.budget == sched.max_num_batched_tokens == 48 and ctl.p95["tpot"] == pytest.approx(0.2)
    for t in range(2, 12):
        _interval(ctl, t, tpot=0.2)
    assert ctl.budget == ctl.min_budget == 8                     # the floor: max_num_seqs
    ups = [_interval(ctl, t, tpot=0.01)["budget"] for t in range(12, 40)]
    assert ups[-1] == 64 and sorted(ups) == ups                  # back to the maximum, never past it
    assert ups[0] == 8                                           # the first calm decision holds (streak of 2)
    assert ctl.num_adjustments["down"] > 0 and ctl.num_adjustments["up"] > 0


def test_down_counts_from_the_largest_step():
    """A budget no step reached binds nothing: the first move down starts from the largest step."""
    ctl, _ = _ctl(budget=512)
    ctl.tick(0.0)
    for n in (40, 70, 12):
        ctl.observe([], step=0, num_tokens=n)
    assert _interval(ctl, 1.0, tpot=0.2)["budget"] == 52          # floor(0.75 x 70), not 384
    assert _interval(ctl, 2.0, tpot=0.2)["budget"] == 39          # no step seen: from the budget


def test_band_holds_no_flapping():
    ctl, _ = _ctl()
    ctl.tick(0.0)
    rows = [_interval(ctl, t, tpot=0.09 if t % 2 else 0.081) for t in range(1, 30)]
    assert {r["action"] for r in rows} == {"hold"} and ctl.budget == 64
    assert ctl.num_adjustments == {"down": 0, "up": 0}


def test_too_few_samples_moves_nothing():
    ctl, _ = _ctl(min_samples=8)
    ctl.tick(0.0)
    row = _interval(ctl, 1.0, tpot=5.0, ttft=50.0, n=5)
    assert row["action"] == "hold" and row["n_tpot"] == 5 and ctl.p95["tpot"] == 5.0


def test_window_forgets_old_and_pre_move_samples():
    ctl, _ = _ctl(window_intervals=3, max_window_intervals=10, min_samples=8)
    ctl.tick(0.0)
    _interval(ctl, 1.0, tpot=0.5)                                # a move: older samples no longer count
    assert _interval(ctl, 2.0, n=0)["n_tpot"] == 0 and ctl.p95["tpot"] is None
    _interval(ctl, 3.0, tpot=0.085)                              # in the band: no move
    assert ctl.num_samples["tpot"] == 10
    _interval(ctl, 6.0, tpot=0.09)                               # 10 in the last 3 intervals: enough
    assert ctl.num_samples["tpot"] == 10 and ctl.p95["tpot"] == pytest.approx(0.09)
    ctl.tick(10.0)                                               # none in the last 3: the newest 8
    assert ctl.num_samples["tpot"] == 8 and ctl.p95["tpot"] == pytest.approx(0.09)
    ctl.tick(17.0)                                               # 10 intervals later: gone
    assert ctl.num_samples["tpot"] == 0 and not ctl.samples["tpot"]


def test_slow_traffic_reaches_back_for_samples():
    """2 finished requests an interval: 3 intervals hold 6 < 8, the decision reads back further."""
    ctl, _ = _ctl(min_samples=8)
    ctl.tick(0.0)
    rows = [_interval(ctl, t, tpot=0.5, n=2) for t in range(1, 6)]
    assert [r["action"] for r in rows] == ["hold"] * 3 + ["budget down", "hold"]
    assert rows[3]["n_tpot"] == 8


def test_ttft_wants_budget_tpot_wins():
    ctl, _ = _ctl(budget=64)
    ctl.budget = 16
    ctl.tick(0.0)
    assert _interval(ctl, 1.0, tpot=0.2, ttft=5.0)["action"] == "budget down"      # TPOT wins
    assert _interval(ctl, 2.0, tpot=0.09, ttft=5.0)["action"] == "budget up"       # within target: TTFT
    assert _interval(ctl, 3.0, tpot=0.09, ttft=0.5)["action"] == "hold"            # both fine: hold
    calm, _ = _ctl(budget=64)
    calm.budget = 16
    calm.tick(0.0)
    assert _interval(calm, 1.0, tpot=0.01, ttft=5.0)["action"] == "budget up"      # calm: at once
    ttft_only, _ = _ctl(tpot=None)
    ttft_only.budget = 16
    ttft_only.tick(0.0)
    assert _interval(ttft_only, 1.0, ttft=5.0)["action"] == "budget up"


def test_queue_timeouts_move_within_bounds():
    classes = (PriorityClass("interactive", 0), PriorityClass("batch", 2, 2.0, "reject"))
    ctl, _ = _ctl(classes=classes, tpot=None)
    assert ctl.queue_timeouts == {2: 2.0}
    ctl.tick(0.0)
    for t in range(1, 12):
        _interval(ctl, t, ttft=5.0)
    assert ctl.queue_timeouts == {2: 0.5}                         # the floor: a quarter
    assert ctl.priority_classes[1].max_queue_wait == 0.5 and ctl.priority_classes[0] == classes[0]
    for t in range(12, 40):
        _interval(ctl, t, ttft=0.1)
    assert ctl.queue_timeouts == {2: 2.0}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1.0), st.floats(0, 10.0), st.integers(0, 12)), max_size=40),
       st.integers(1, 8), st.integers(0, 3), st.integers(8, 300))
def test_bounds_under_any_windows(windows, seats, k, budget):
    """Never below one decode step nor above the configured budget; bounds within [c/4, c]."""
    budget = max(budget, seats, 1 + k)
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=seats, num_speculative_tokens=k,
                       slo_tpot_p95_ms=100, slo_ttft_p95_ms=500, slo_interval_s=1.0,
                       scheduling_policy="priority", priority_classes=(PriorityClass("b", 1, 3.0),))
    ctl = SLOController(cfg, SimpleNamespace(max_num_batched_tokens=budget), min_samples=1)
    ctl.tick(0.0)
    for t, (tpot, ttft, n) in enumerate(windows, start=1):
        _interval(ctl, t, tpot=tpot, ttft=ttft, n=n)
        assert max(seats, 1 + k) == ctl.min_budget <= ctl.budget <= budget
        assert 0.75 <= ctl.queue_timeouts[1] <= 3.0


def _fake_clock(engine, slow_steps, slow_s=0.5, fast_s=0.005):
    """Steps last slow_s each until step `slow_steps`, fast_s after (the engine's own clock)."""
    def clock():
        k = engine.step_count
        return slow_s * min(k, slow_steps) + fast_s * max(0, k - slow_steps)
    engine.clock = clock


def test_engine_runs_the_moved_budget():
    model = tiny_model(vocab_size=64, seed=0, dtype=torch.float64)
    cfg = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=2, max_num_batched_tokens=16,
                       slo_tpot_p95_ms=100, slo_interval_s=1.0)
    engine = LLMEngine(model, cfg)
    engine.controller = SLOController(cfg, engine.scheduler, min_samples=1)
    _fake_clock(engine, slow_steps=10_000)
    prompts = [[1 + (i + j) % 60 for j in range(24)] for i in range(16)]
    engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    ctl = engine.controller
    assert ctl.budget == ctl.min_budget == 2 and ctl.num_adjustments["down"] >= 4
    late = [r for r in engine.trace if r["t_start"] >= ctl.timeline[-1]["t"]]
    assert late and all(r["num_prefill_tokens"] + r["num_decode_tokens"] <= 2 for r in late)


def test_engine_moves_queue_bounds():
    """6 interactive then 6 batch requests, one seat, 1 s a request: the batch class waits 6-11 s,
    under its configured 20 s bound; the controller (TTFT over target) tightens it and promotes."""
    model = tiny_model(vocab_size=64, seed=0, dtype=torch.float64)
    classes = (PriorityClass("interactive", 0), PriorityClass("batch", 2, 20.0))
    promotions = []
    for slo in (None, 100):
        cfg = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=1, max_num_batched_tokens=8,
                           scheduling_policy="priority", priority_classes=classes,
                           slo_ttft_p95_ms=slo, slo_interval_s=1.0)
        engine = LLMEngine(model, cfg)
        if slo is not None:
            engine.controller = SLOController(cfg, engine.scheduler, min_samples=1)
        _fake_clock(engine, slow_steps=10_000)
        outs = engine.generate([[5, 6, 7]] * 12, SamplingParams(max_tokens=2, ignore_eos=True),
                               priority=[0] * 6 + [2] * 6)
        promotions.append(sum(o.metrics.num_promotions for o in outs))
    assert 5.0 <= engine.controller.queue_timeouts[2] < 20.0
    assert promotions[0] == 0 and promotions[1] > 0     # the shorter bound promoted someone


def test_exact_with_budget_moving_both_ways(smollm2):
    """Greedy tokens of SmolLM2 identical with and without the controller, which takes the budget
    down to the floor and back up during the run: a decision every step (a fake clock of 20 ms a
    step, decisions due every 10 ms), fed a slow TPOT sample before each of the first 7 steps and a fast one after."""
    model, _ = smollm2
    base = dict(block_size=16, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    prompts = [[1 + (7 * i + 13 * j) % 4000 for j in range(20 + 20 * i)] for i in range(2)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LLMEngine(model, EngineConfig(**base)).generate(prompts, params)
    cfg = EngineConfig(**base, slo_tpot_p95_ms=100, slo_interval_s=0.01)
    engine = LLMEngine(model, cfg)
    ctl = engine.controller = SLOController(cfg, engine.scheduler, min_samples=1)
    engine.clock = lambda: engine.step_count * 0.02
    plain_step = engine.step

    def step():
        ctl.record("tpot", engine.clock() - 0.005, 0.5 if engine.step_count < 7 else 0.01)
        return plain_step()
    engine.step = step
    outs = engine.generate(prompts, params)
    budgets = [r["budget"] for r in ctl.timeline]
    floor = budgets.index(ctl.min_budget)                 # 2 = max_num_seqs, reached ...
    assert ctl.min_budget == 2 and max(budgets[floor:]) > 2, budgets    # ... and left again
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("kw, match", [
    (dict(slo_tpot_p95_ms=0), "slo_tpot_p95_ms"), (dict(slo_ttft_p95_ms=-5), "slo_ttft_p95_ms"),
    (dict(slo_ttft_p95_ms=math.nan), "slo_ttft_p95_ms"), (dict(slo_tpot_p95_ms=math.inf), "slo_tpot_p95_ms"),
    (dict(slo_tpot_p95_ms="100"), "slo_tpot_p95_ms"), (dict(slo_interval_s=0), "slo_interval_s"),
    (dict(slo_tpot_p95_ms=100, scheduling="static"), "continuous")])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_no_targets_no_controller():
    model = tiny_model(vocab_size=64, seed=0)
    assert LLMEngine(model, EngineConfig(num_blocks=16)).controller is None
    from minillm import LLM                       # the offline front door passes the fields on
    ctl = LLM(model, num_blocks=16, max_num_seqs=4, slo_tpot_p95_ms=50).llm_engine.controller
    assert ctl.targets == {"ttft": None, "tpot": 0.05} and ctl.min_budget == 4
    with pytest.raises(ValueError, match="down"):
        _ctl(down=1.5)


@pytest.mark.parametrize("flag, value", [("--slo-ttft-p95-ms", "0"), ("--slo-tpot-p95-ms", "-3"),
                                         ("--slo-tpot-p95-ms", "nan"), ("--slo-interval-s", "abc")])
def test_serve_flags(flag, value, capsys):
    from minillm.serve.cli import engine_options, parser
    with pytest.raises(SystemExit):
        parser().parse_args([flag, value])
    assert flag in capsys.readouterr().err
    opts = engine_options(parser().parse_args(["--slo-tpot-p95-ms", "150", "--slo-interval-s", "1"]))
    assert opts["slo_tpot_p95_ms"] == 150.0 and opts["slo_interval_s"] == 1.0
    assert EngineConfig(**opts).slo_ttft_p95_ms is None
