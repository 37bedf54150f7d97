"""The SLO controller under a load step, the record: `minillm.lab.slo_step.compare`
on the real model, rate r for 15 s, 2r for the issue's minute, r for 30 s, with the controller
(budget <= the server's default 512) against the best fixed budget of chapter 8's sweep (read
from priority_<device>.json: the largest budget whose interactive P95 TPOT met the SLA,
`minillm.lab.priority.tune_budget`) and against the server's default budget; written to
slo_control_<device>.json.

    python -m benchmarks slo_control [--quick]

r comes from this machine's decode step (load 0.45 of what `seats` decodes can carry), the
targets from two 20 s steady runs with budget 512, at r and at 2r (per metric the geometric mean
of their P95s: met at r, missed at 2r, with the big budget; `calibration` in the record). Two
rounds, the second in reverse order (the record keeps every round's summary, their mean, and the
first round's timelines for the figure: a machine shared with other work drifts, and one run
per setting showed it). Runs use one torch thread (`--threads`): on a
shared 2-core machine two threads fighting the other processes made steps several times slower.
The load average before each run is in its config.
"""
import json
import time

import torch

from benchmarks.records import results_dir, write_result
from minillm.lab.slo_step import compare
from minillm.serve.cli import SERVER_DEFAULTS

SETTINGS = {False: dict(base_s=15, step_s=60, after_s=30, calib_s=20, rounds=2),
            True: dict(base_s=3, step_s=6, after_s=4, calib_s=3, rounds=1)}
UNITS = {"rate": "requests per second (r; the step offers 2r)", "targets_ms": "milliseconds (P95)",
         "decode_step_s": "seconds", "goodput": "requests per second meeting both targets",
         "attainment": "fraction of requests meeting both targets", "p95_*": "seconds",
         "recovery_after_*_s": "seconds (0: never over the SLA; null: not back in the phase)",
         "output_tokens_per_s": "tokens per second", "t / duration_s / *_s": "seconds",
         "sent": "requests sent in that second", "budget": "max_num_batched_tokens in force"}


def best_fixed_budget(device_tag: str = "cpu") -> int:
    """Chapter 8's sweep choice (priority record's tuning.chosen), 128 when there is no record."""
    path = results_dir() / f"priority_{device_tag}.json"
    if path.exists():
        chosen = json.loads(path.read_text()).get("tuning", {}).get("chosen")
        if chosen:
            return int(chosen)
    return 128


def run(quick: bool = False, device=None, out_dir=None, model=None, threads: int = 1) -> dict:
    if model is None:
        from minillm.llm import load_model
        model, _ = load_model(device=device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    best, default = best_fixed_budget(), SERVER_DEFAULTS["max_num_batched_tokens"]
    try:
        res = compare(model, budgets=(best, default), max_budget=default, **SETTINGS[bool(quick)])
    finally:
        torch.set_num_threads(before)
    res.update(quick=bool(quick), threads=threads, best_fixed_budget=best, default_budget=default,
               best_fixed_from="benchmarks/results/priority_cpu.json tuning.chosen",
               seconds=time.perf_counter() - t0, units=UNITS)
    path = write_result("slo_control", res, device=next(model.parameters()).device, out_dir=out_dir)
    print(f"wrote {path}")
    return res


def report(res: dict) -> str:
    lines = [f"rate r {res['rate']:.2f}/s (2r in the step), targets P95 TTFT {res['targets_ms']['ttft']} ms, "
             f"TPOT {res['targets_ms']['tpot']} ms"]
    for name, m in res["mean"].items():
        lines.append(f"{name:12s} mean of {len(res['rounds'])} rounds: goodput {m['goodput']:.3f}/s "
                     f"attainment {m['attainment']:.2f} {m['output_tokens_per_s']:.1f} tok/s")
    for i, rnd in enumerate(res["rounds"]):
        for name, s in rnd.items():
            ph = s["phases"]
            lines.append(f"{name:12s} goodput {s['goodput']:.3f}/s attainment {s['attainment']:.2f} "
                         f"{s['output_tokens_per_s']:.1f} tok/s; P95 TPOT before/step/after "
                         + "/".join(f"{ph[p]['p95_tpot']:.3f}" for p in ph) + " s; back within SLA "
                         f"{s['recovery_after_start_s']} s after the step starts, "
                         f"{s['recovery_after_end_s']} s after it ends; min budget {s['budget_min_seen']}"
                         f" (round {i}, load {s['load_avg_before']:.1f})")
    return "\n".join(lines)


def main(args=None) -> dict:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(args)
    res = run(quick=a.quick, device=a.device, threads=a.threads)
    print(report(res))
    return res


if __name__ == "__main__":
    main()
