"""Priorities and SLOs (chapter 8), the record: the priority mix of `minillm.lab.priority` on the
real model, fcfs against priority, then the P95-driven token budget; written to
priority_<device>.json with a figure beside it.

    python -m benchmarks priority [--quick]
"""
import time

from benchmarks.records import save_figure_beside, write_result
from minillm.lab.priority import (SLO_STEPS, class_table, mix, scaled_classes, serve,
                                  solo_step_seconds, tune_budget)

SETTINGS = {  # quick: a smoke run under a minute on 2 cores; full: the recorded numbers
    # kinds: (prompt_len range, output_len range, priority) of each kind of traffic
    False: dict(num_requests=64, seats=8, load=0.9, budget=64, budgets=(16, 32, 64, 128),
                kinds=dict(interactive=((8, 32), (4, 16), 0), batch=((32, 96), (32, 64), 2))),
    True: dict(num_requests=10, seats=4, load=0.9, budget=16, budgets=(8, 32),
               kinds=dict(interactive=((4, 12), (2, 4), 0), batch=((8, 24), (6, 10), 2))),
}

UNITS = {"solo_step_s / targets_s / seconds": "seconds", "ttft_* / tpot_*": "seconds per request (p50, p95, p99)",
         "*_steps*": "engine steps", "goodput_rps": "requests per second meeting both targets",
         "tokens_per_s": "generated tokens per second", "slo_steps": "targets in solo steps"}


def run(quick: bool = False, device=None, out_dir=None, model=None) -> dict:
    """Both parts; writes priority_<device>.json and a figure beside it; returns the record."""
    if model is None:
        from minillm.llm import load_model
        model, _ = load_model(device=device)
    s = SETTINGS[bool(quick)]
    t0 = time.perf_counter()
    t1 = solo_step_seconds(model)
    targets = {k: {m: v * t1 for m, v in d.items()} for k, d in SLO_STEPS.items()}
    work = mix(model, s)
    classes = scaled_classes(t1)
    res = {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items() if k != "kinds"},
           "kinds": {k: [list(x) if isinstance(x, tuple) else x for x in v] for k, v in s["kinds"].items()},
           "solo_step_s": t1, "slo_steps": SLO_STEPS, "targets_s": targets, "policies": {}}
    for policy in ("fcfs", "priority"):
        outs, engine = serve(model, work, policy, s["budget"], s["seats"], classes)
        res["policies"][policy] = class_table(outs, work, engine, targets)
        res["policies"][policy]["priority_preemptions"] = getattr(
            engine.scheduler, "num_priority_preemptions", 0)
    f, p = res["policies"]["fcfs"]["interactive"], res["policies"]["priority"]["interactive"]
    res["ratios"] = {"interactive_ttft_p95_fcfs_over_priority": f["ttft_p95"] / p["ttft_p95"],
                     "interactive_goodput_priority_over_fcfs":
                         p["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else None}
    res["tuning"] = tune_budget(model, work, s["budgets"], targets["interactive"]["tpot"], s["seats"],
                                classes=classes)
    res["classes"] = [c.__dict__ for c in classes]
    res["seconds"] = time.perf_counter() - t0
    res["units"] = UNITS
    path = write_result("priority", res, device=next(model.parameters()).device, out_dir=out_dir)
    from minillm.viz.serving import priority_plot        # matplotlib only when a record is drawn
    save_figure_beside(priority_plot(res), path, "priority")
    print(f"wrote {path}")
    return res


def report(res: dict) -> str:
    lines = [f"solo step {res['solo_step_s'] * 1e3:.1f} ms; targets (s): "
             + ", ".join(f"{k} ttft {v['ttft']:.3f} tpot {v['tpot']:.3f}" for k, v in res["targets_s"].items())]
    for policy, table in res["policies"].items():
        for name, r in table.items():
            if isinstance(r, dict):
                lines.append(f"{policy:8s} {name:11s} n={r['n']:3d} ttft p50/p95/p99 "
                             f"{r['ttft_p50']:.3f}/{r['ttft_p95']:.3f}/{r['ttft_p99']:.3f} s "
                             f"({r['ttft_steps_p50']:.0f}/{r['ttft_steps_p95']:.0f}/{r['ttft_steps_p99']:.0f} steps) "
                             f"tpot p95 {r['tpot_p95'] or 0:.3f} s  met {r['met']}/{r['n']} promoted {r['promoted']} "
                             f"goodput {r['goodput_rps']:.2f} req/s")
    lines += [f"{k}: {v:.2f}x" for k, v in res["ratios"].items() if v is not None]
    tun = res["tuning"]
    for r in tun["rows"]:
        lines.append(f"budget {r['budget']:4d}: {r['tokens_per_s']:.1f} tok/s, interactive p95 tpot "
                     f"{r['tpot_p95']:.3f} s (SLA {tun['sla_tpot_p95']:.3f}) {'ok' if r['meets'] else 'over'}")
    lines.append(f"chosen max_num_batched_tokens: {tun['chosen']}")
    return "\n".join(lines)


def main(args=None) -> dict:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    a = p.parse_args(args)
    res = run(quick=a.quick, device=a.device)
    print(report(res))
    return res


if __name__ == "__main__":
    main()
