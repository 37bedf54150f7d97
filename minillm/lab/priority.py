"""Priorities and SLOs (chapter 8): what `scheduling_policy="priority"` buys interactive traffic,
and choosing `max_num_batched_tokens` from P95 latency.

1. A mix of interactive (priority 0) and batch (priority 2) requests, Poisson arrivals on the
   step clock, served fcfs and by priority (`scaled_classes`); per class TTFT / TPOT percentiles
   and goodput. 2. `tune_budget`: the same mix over several budgets, keeping the largest whose P95
   TPOT meets the target. Targets are multiples of the solo step `t1` measured in the same run
   (`SLO_STEPS`), so no constant of one CPU decides anything. `overload_mix` and
   `try_seed_bounds` run the seed article's queue bounds (`SEED_CLASSES`) under sustained
   overload on a simulated clock. The benchmark is `python -m benchmarks priority [--quick]`.

Left out on purpose: retuning a live server (engine/policies/slo_controller.py does), and the standard
class (the mix has two kinds of traffic).
"""
import numpy as np

from minillm.lab.workloads import priority_mix_workload, replay
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.policies.priority import SEED_CLASSES
from minillm.engine.policies.slo_controller import choose_budget, over_target, p95
from minillm.engine.sampling_params import SamplingParams

SLO_STEPS = {"interactive": {"ttft": 8, "tpot": 3}, "batch": {"ttft": 400, "tpot": 6}}
CLASS_OF = {c.priority: c.name for c in SEED_CLASSES}
SEED_STEP_S = 0.025   # the step the seed's bounds are read against (an assumption, not a measurement)


def scaled_classes(solo_step: float, classes=SEED_CLASSES) -> tuple:
    """The classes with each bound multiplied by solo_step / SEED_STEP_S: the same number of
    steps on every machine."""
    from dataclasses import replace
    return tuple(replace(c, max_queue_wait=None if c.max_queue_wait is None else
                         c.max_queue_wait * solo_step / SEED_STEP_S) for c in classes)


def solo_step_seconds(model, prompt_len: int = 16, tokens: int = 12) -> float:
    """Median wall time of a decode step with one request alone (the SLOs' unit)."""
    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=1, max_num_batched_tokens=64))
    engine.generate([list(range(1, prompt_len + 1))], SamplingParams(max_tokens=tokens, ignore_eos=True))
    times = [r["t_end"] - r["t_start"] for r in engine.trace if r["num_prefill_tokens"] == 0]
    return float(np.median(times[2:] or times))      # the first decodes warm the caches


def mix(model, s: dict, seed: int = 0) -> list:
    """The workload: arrival rate = load x seats / mean output tokens (requests per step)."""
    probe = priority_mix_workload(s["num_requests"], 1.0, model.config.vocab_size, seed, **s["kinds"])
    rate = s["load"] * s["seats"] / np.mean([w.max_tokens for w in probe])
    return priority_mix_workload(s["num_requests"], rate, model.config.vocab_size, seed, **s["kinds"])


def serve(model, workload, policy: str, budget: int, seats: int, classes=SEED_CLASSES,
          step_seconds: float | None = None):
    """One replay on the step clock; returns (outputs, engine)."""
    cfg = EngineConfig(block_size=16, max_num_seqs=seats, max_num_batched_tokens=budget,
                       scheduling_policy=policy, priority_classes=classes if policy == "priority" else ())
    engine = LLMEngine(model, cfg)
    return replay(engine, workload, time_unit="steps", step_seconds=step_seconds), engine


def ttft_steps(out) -> int | None:
    """A request's TTFT in engine steps (1 = the step right after it arrived), None without one."""
    m = out.metrics
    return None if m.first_token_step is None else m.first_token_step - m.arrival_step + 1


def class_table(outs, workload, engine, targets: dict) -> dict:
    """Per class: percentiles of TTFT / TPOT (s), TTFT in steps, goodput and the share meeting."""
    wall = engine.trace[-1]["t_end"] - engine.trace[0]["t_start"]
    table = {}
    for prio, name in CLASS_OF.items():
        mine = [o for o, w in zip(outs, workload) if w.priority == prio]
        if not mine:
            continue
        ttft = [o.metrics.ttft for o in mine if o.metrics.ttft is not None]
        tpot = [o.metrics.tpot for o in mine if o.metrics.tpot is not None]
        steps = [n for n in map(ttft_steps, mine) if n is not None]
        t = targets[name]
        met = sum(o.metrics.ttft is not None and o.metrics.ttft <= t["ttft"] and
                  (o.metrics.tpot or 0.0) <= t["tpot"] for o in mine)
        row = {"n": len(mine), "met": met, "goodput_rps": met / wall, "rejected":
               sum(o.finish_reason == "abort" for o in mine),
               "promoted": sum(o.metrics.num_promotions for o in mine)}
        for key, vals in (("ttft", ttft), ("tpot", tpot), ("ttft_steps", steps)):
            for p in (50, 95, 99):
                row[f"{key}_p{p}"] = float(np.percentile(vals, p)) if vals else None
        table[name] = row
    return table


def ttft_steps_by_class(outs, workload) -> dict:
    """Per class: TTFT in engine steps (1 = the next step), p50 / p95 / max; deterministic."""
    table = {}
    for prio, name in CLASS_OF.items():
        steps = [n for o, w in zip(outs, workload) if w.priority == prio
                 for n in [ttft_steps(o)] if n is not None]
        if steps:
            table[name] = {"p50": float(np.percentile(steps, 50)), "p95": float(np.percentile(steps, 95)),
                           "max": max(steps)}
    return table


def try_queue_timeouts(model, workload, waits=(0.05, 0.2, 1.0), seats: int = 4, budget: int = 32,
                       step_seconds: float = 0.025) -> list[dict]:
    """Seed 001's queue timeouts on the batch class, each with on_timeout promote and reject, on
    a simulated clock of `step_seconds` per step (so 50 ms = 2 steps at 25 ms). Per trial: the
    classes' TTFT steps, batch promotions, rejections and the first rejection's error."""
    from minillm.engine.policies.priority import PriorityClass
    rows = []
    for wait in waits:
        for how in ("promote", "reject"):
            classes = (PriorityClass("interactive", 0), PriorityClass("batch", 2, wait, how))
            outs, engine = serve(model, workload, "priority", budget, seats, classes, step_seconds)
            errors = [o.error for o in outs if o.error]
            rows.append({"max_queue_wait": wait, "on_timeout": how,
                         "promoted": sum(o.metrics.num_promotions for o in outs),
                         "rejected": len(errors), "error": errors[0] if errors else None,
                         "steps": len(engine.trace), **{f"{k}_ttft_steps": v for k, v in
                                                        ttft_steps_by_class(outs, workload).items()}})
    return rows


def tune_budget(model, workload, budgets, sla_tpot_p95: float, seats: int, name="interactive",
                classes=SEED_CLASSES) -> dict:
    """Seed 001's rule: serve the workload at each budget (priority policy); the choice is the
    largest budget whose class `name` has P95 TPOT within `sla_tpot_p95` (None if none does):
    `choose_budget`, the rule the online controller applies too (engine/policies/slo_controller.py)."""
    rows = []
    for budget in sorted(budgets):
        outs, engine = serve(model, workload, "priority", budget, seats, classes)
        wall = engine.trace[-1]["t_end"] - engine.trace[0]["t_start"]
        prio = next(c.priority for c in SEED_CLASSES if c.name == name)
        mine = [o.metrics for o, w in zip(outs, workload) if w.priority == prio]
        rows.append({"budget": budget, "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
                     "tpot_p95": p95(m.tpot for m in mine if m.tpot is not None),
                     "ttft_p95": p95(m.ttft for m in mine), "steps": len(engine.trace)})
        rows[-1]["meets"] = not over_target(rows[-1]["tpot_p95"], sla_tpot_p95)
    return {"sla_tpot_p95": sla_tpot_p95, "rows": rows,
            "chosen": choose_budget({r["budget"]: r["tpot_p95"] for r in rows}, sla_tpot_p95)}


def overload_mix(model, seconds: float, step_seconds: float, seats: int = 4, load: float = 2.0,
                 kinds: dict | None = None, seed: int = 0, min_steps: int = 40,
                 max_requests: int = 2000) -> list:
    """Three classes of traffic (interactive, standard, batch: one third each) arriving at `load`
    times what `seats` can serve, for `seconds` of a simulated clock whose steps last
    `step_seconds` (and for at least `min_steps` steps): a sustained overload as long in seconds
    on every machine. Arrivals are in steps. kinds: name -> (prompt_len range, output_len range,
    priority)."""
    import math
    import random
    from minillm.lab.workloads import WorkloadRequest, _tokens
    kinds = kinds or {"interactive": ((8, 16), (2, 4), 0), "standard": ((8, 24), (4, 8), 1),
                      "batch": ((16, 32), (6, 12), 2)}
    if not (seconds > 0 and step_seconds > 0 and load > 0 and math.isfinite(seconds)):
        raise ValueError(f"need seconds, step_seconds and load > 0, got {seconds}, {step_seconds}, {load}")
    mean_out = np.mean([(lo + hi) / 2 for _, (lo, hi), _ in kinds.values()])
    rate = load * seats / mean_out                       # requests per step
    span = max(seconds / step_seconds, min_steps)        # steps of arrivals
    rng = random.Random(seed)
    t, out, names = 0.0, [], sorted(kinds, key=lambda k: kinds[k][2])
    while t < span and len(out) < max_requests:
        (plo, phi), (olo, ohi), prio = kinds[rng.choice(names)]
        out.append(WorkloadRequest(t, _tokens(rng, rng.randint(plo, phi), model.config.vocab_size),
                                   rng.randint(olo, ohi), prio))
        t += rng.expovariate(rate)
    return out


def try_seed_bounds(model, workload, step_seconds: float, on_timeout: str = "promote", seats: int = 4,
                    budget: int = 32, classes=SEED_CLASSES) -> dict:
    """Serve `workload` under priority with every class's bound as given (default: seed 001's
    50 / 200 / 1000 ms) and `on_timeout`, on a clock of `step_seconds` per step. Per class: n,
    how many passed their bound (promoted or rejected), TTFT p50 / p95 in simulated seconds of
    those served, and the longest wait for a first seat (s)."""
    from dataclasses import replace
    classes = tuple(replace(c, on_timeout=on_timeout) for c in classes)
    outs, engine = serve(model, workload, "priority", budget, seats, classes, step_seconds)
    table = {}
    for c in classes:
        mine = [(o, w) for o, w in zip(outs, workload) if w.priority == c.priority]
        if not mine:
            continue
        served = [ttft_steps(o) * step_seconds for o, _ in mine if ttft_steps(o) is not None]
        waits = [o.metrics.queue_time for o, _ in mine if o.metrics.queue_time is not None]
        table[c.name] = {"n": len(mine), "bound_s": c.max_queue_wait,
                         "promoted": sum(o.metrics.num_promotions > 0 for o, _ in mine),
                         "rejected": sum(bool(o.error) for o, _ in mine),
                         "ttft_p50_s": float(np.percentile(served, 50)) if served else None,
                         "ttft_p95_s": float(np.percentile(served, 95)) if served else None,
                         "max_wait_s": max(waits) if waits else None}
    return {"steps": len(engine.trace), "classes": table}
