"""The SLO controller under a load step (chapter 8): Poisson arrivals at rate r, then 2r for
`step_s` seconds, then r again, replayed on the wall clock into one `LLMEngine`
(`workloads.replay`), with the controller on or with a fixed token budget.

    res = load_step(model, rate=0.5, targets_ms={"ttft": 4000, "tpot": 900}, budget=512)
    res["summary"]["goodput"], res["timeline"][10]["p95_tpot"]

`timeline` gives per second the requests sent, the budget and the rolling P95s; the summary gives
goodput and attainment (`minillm.analysis.slo`), P95 per phase, tokens/s and the recovery times.
`compare(model, ...)` is the whole measurement: r from this machine's decode step, targets from
two short steady runs (`calibrate`), then the controller and each fixed budget in interleaved
rounds. The notebook runs a short step; `python -m benchmarks slo_control` a minute-long one.

Left out on purpose: HTTP, real prompts (random ids), and a verdict under noise (the benchmark
records every round with the load average before it).
"""
import math
import os
import random
import statistics

from minillm.analysis.slo import goodput, percentile, slo_attainment
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.policies.slo_controller import over_target, p95, rolling_p95
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.workloads import WorkloadRequest, replay


def step_workload(rate: float, base_s: float, step_s: float, after_s: float, vocab_size: int,
                  seed: int = 0, prompt_len=(16, 64), output_len=(8, 16)) -> list[WorkloadRequest]:
    """Poisson arrivals: `rate`/s for base_s, 2 x rate for step_s, rate for after_s; lengths
    uniform in their ranges."""
    if not 0 < rate < math.inf or min(base_s, step_s, after_s) <= 0:
        raise ValueError(f"need a finite rate > 0 and phases > 0 s, got rate={rate}, "
                         f"{base_s}, {step_s}, {after_s}")
    rng, out, t = random.Random(seed), [], 0.0
    ends = (base_s, base_s + step_s, base_s + step_s + after_s)
    while True:
        t += rng.expovariate(rate * (2 if ends[0] <= t < ends[1] else 1))
        if t >= ends[2]:
            return out
        ids = [rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_len))]
        out.append(WorkloadRequest(t, ids, rng.randint(*output_len)))


def decode_step_seconds(model, seats: int = 8, prompt_len: int = 32, steps: int = 8,
                        repeats: int = 3) -> float:
    """Wall time of a decode-only step with `seats` sequences running: the median step of a run,
    the fastest of `repeats` runs (a shared machine's bursts only ever add time)."""
    runs = []
    for _ in range(repeats):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=seats, max_num_batched_tokens=max(64, seats)))
        for i in range(seats):
            engine.add_request([1 + (i * 31 + j) % 1000 for j in range(prompt_len)],
                               SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        times = [r["t_end"] - r["t_start"] for r in engine.trace
                 if r["num_prefill_tokens"] == 0 and r["num_seqs"] == seats]
        runs.append(statistics.median(times[2:] or times))   # the first decodes warm the caches
    return min(runs)


def _sample(m) -> dict:
    """analysis.slo's view of one request: ttft (inf without a first token) and its gaps."""
    t = m.token_times
    return {"ttft": math.inf if m.ttft is None else m.ttft,
            "itls": [b - a for a, b in zip(t, t[1:])]}


def recovery(timeline: list[dict], start: float, end: float, targets: dict):
    """Seconds after `start` from which every rolling P95 stays within its target until `end`;
    0 if none left it, None if still over at the last second before `end`."""
    rows = [r for r in timeline if start <= r["t"] < end]
    over = [r["t"] for r in rows if any(over_target(r[f"p95_{k}"], v) for k, v in targets.items())]
    if not over:
        return 0.0
    if rows and over[-1] == rows[-1]["t"]:
        return None
    return over[-1] + 1 - start


def load_step(model, *, rate: float, targets_ms: dict, budget: int = 512, controller: bool = True,
              base_s: float = 10, step_s: float = 20, after_s: float = 20, seats: int = 8,
              interval_s: float = 2.0, window_s: float | None = None, seed: int = 0,
              prompt_len=(16, 64), output_len=(8, 16)) -> dict:
    """One run (see the module docstring). `budget` is the fixed budget, or the controller's
    maximum; `targets_ms` {"ttft": ms, "tpot": ms} are the SLA (the controller's targets too)."""
    work = step_workload(rate, base_s, step_s, after_s, model.config.vocab_size, seed,
                         prompt_len, output_len)
    slo = ({"slo_ttft_p95_ms": targets_ms["ttft"], "slo_tpot_p95_ms": targets_ms["tpot"],
            "slo_interval_s": interval_s} if controller else {})
    cfg = EngineConfig(max_num_seqs=seats, max_num_batched_tokens=budget,
                       kv_cache_memory_bytes=256 * 2**20, **slo)
    engine = LLMEngine(model, cfg)
    load_avg = os.getloadavg()[0]
    outs = replay(engine, work)                             # in workload order
    t0 = outs[0].metrics.arrival_time - work[0].arrival     # replay's start, on the engine's clock
    end = max(o.metrics.finish_time for o in outs) - t0
    targets = {k: v / 1e3 for k, v in targets_ms.items()}
    window_s = 3 * interval_s if window_s is None else window_s
    ttfts = [(o.metrics.first_token_time - t0, o.metrics.ttft) for o in outs if o.metrics.ttft is not None]
    tpots = [(o.metrics.finish_time - t0, o.metrics.tpot) for o in outs if o.metrics.tpot is not None]
    moves = [] if engine.controller is None else [(r["t"] - t0, r["budget"]) for r in engine.controller.timeline]
    timeline = []
    for s in range(1, math.ceil(end) + 1):
        in_force = [b for at, b in moves if at <= s]
        timeline.append({"t": s, "sent": sum(s - 1 <= w.arrival < s for w in work),
                         "budget": in_force[-1] if in_force else budget,
                         "p95_ttft": rolling_p95(ttfts, s, window_s),
                         "p95_tpot": rolling_p95(tpots, s, window_s)})
    samples = [_sample(o.metrics) for o in outs]
    step_end = base_s + step_s
    phases = {"before": (0, base_s), "step": (base_s, step_end), "after": (step_end, math.inf)}
    by_phase = {}
    for name, (a, b) in phases.items():
        mine = [o.metrics for o, w in zip(outs, work) if a <= w.arrival < b]
        by_phase[name] = {"n": len(mine),                   # nan, not None, for an empty phase
                          "p95_ttft": percentile([m.ttft for m in mine if m.ttft is not None], 95),
                          "p95_tpot": percentile([m.tpot for m in mine if m.tpot is not None], 95)}
    ctl = engine.controller
    summary = {"requests": len(outs), "duration_s": end,
               "goodput": goodput(samples, targets["ttft"], targets["tpot"], end),
               "attainment": slo_attainment(samples, targets["ttft"], targets["tpot"]),
               "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / end,
               "recovery_after_start_s": recovery(timeline, base_s, step_end, targets),
               "recovery_after_end_s": recovery(timeline, step_end, math.inf, targets),
               "phases": by_phase, "num_preemptions": engine.scheduler.num_preemptions,
               "adjustments": None if ctl is None else dict(ctl.num_adjustments),
               "budget_min_seen": min([b for _, b in moves] or [budget])}
    return {"config": {"rate": rate, "targets_ms": dict(targets_ms), "budget": budget,
                       "controller": controller, "base_s": base_s, "step_s": step_s,
                       "after_s": after_s, "seats": seats, "interval_s": interval_s,
                       "window_s": window_s, "seed": seed, "prompt_len": list(prompt_len),
                       "output_len": list(output_len), "load_avg_before": load_avg},
            "timeline": timeline, "summary": summary,
            "decisions": [] if ctl is None else [{**r, "t": r["t"] - t0} for r in ctl.timeline]}


def _steady_p95(model, rate, budget, seconds, seats, seed, prompt_len, output_len) -> dict:
    """P95 TTFT and TPOT (s) of a steady run at `rate` with a fixed `budget`."""
    work = step_workload(rate, seconds, 1e-9, 1e-9, model.config.vocab_size, seed, prompt_len, output_len)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=seats, max_num_batched_tokens=budget,
                                           kv_cache_memory_bytes=256 * 2**20))
    ms = [o.metrics for o in replay(engine, work)]
    return {"ttft": p95(m.ttft for m in ms), "tpot": p95(m.tpot for m in ms if m.tpot is not None)}


def calibrate(model, rate: float, budget: int, seconds: float = 10, seats: int = 8, seed: int = 1,
              prompt_len=(16, 64), output_len=(8, 16)) -> dict:
    """Targets (ms) this machine meets at `rate` with `budget` and misses at 2 x rate: for each
    metric the geometric mean of its P95 in a steady run at r and one at 2r (`seconds` each);
    1.2 x the P95 at r where noise made 2r no slower. -> {"ttft", "tpot", "p95_r", "p95_2r"}."""
    at_r = _steady_p95(model, rate, budget, seconds, seats, seed, prompt_len, output_len)
    at_2r = _steady_p95(model, 2 * rate, budget, seconds, seats, seed, prompt_len, output_len)
    out = {k: round(1e3 * (math.sqrt(at_r[k] * at_2r[k]) if at_2r[k] > at_r[k] else 1.2 * at_r[k]))
           for k in ("ttft", "tpot")}
    return {**out, "p95_r": at_r, "p95_2r": at_2r}


def compare(model, *, budgets=(512,), max_budget: int = 512, load: float = 0.45, rate=None,
            targets_ms=None, base_s: float = 3, step_s: float = 8, after_s: float = 5,
            calib_s: float = 5, seats: int = 8, interval_s: float = 2.0, seed: int = 0,
            prompt_len=(16, 64), output_len=(8, 16), rounds: int = 1) -> dict:
    """The controller (budget <= max_budget) and each fixed budget under one load step, in
    `rounds` interleaved rounds (the order reversed every other round, so a machine that drifts
    slower or faster weighs on every setting alike). -> {"rate", "decode_step_s", "targets_ms",
    "runs": {"controller" | "fixed_<b>": load_step's dict of the first round}, "rounds": [{name:
    summary}, ...], "mean": {name: goodput, attainment, tokens/s averaged over the rounds}};
    `rate` / `targets_ms` given skip their measurement."""
    step = None
    if rate is None:
        step = decode_step_seconds(model, seats)
        rate = load * seats / (sum(output_len) / 2 * step)
    calibration = None
    if targets_ms is None:
        calibration = calibrate(model, rate, max_budget, calib_s, seats, seed + 1, prompt_len, output_len)
        targets_ms = {k: calibration[k] for k in ("ttft", "tpot")}
    kw = dict(rate=rate, targets_ms=targets_ms, base_s=base_s, step_s=step_s, after_s=after_s,
              seats=seats, interval_s=interval_s, seed=seed, prompt_len=prompt_len,
              output_len=output_len)
    settings = [("controller", max_budget, True)] + [(f"fixed_{b}", b, False) for b in budgets]
    runs, per_round = {}, []
    for i in range(rounds):
        this = {}
        for name, budget, ctl in (settings if i % 2 == 0 else settings[::-1]):
            run = load_step(model, budget=budget, controller=ctl, **kw)
            runs.setdefault(name, run)
            this[name] = {**run["summary"], "load_avg_before": run["config"]["load_avg_before"]}
        per_round.append(this)
    keys = ("goodput", "attainment", "output_tokens_per_s")
    mean = {name: {k: sum(r[name][k] for r in per_round) / rounds for k in keys} for name in runs}
    return {"rate": rate, "load": load, "decode_step_s": step, "targets_ms": targets_ms,
            "calibration": calibration, "runs": runs, "rounds": per_round, "mean": mean}
