"""`python -m benchmarks disaggregation`: colocated against disaggregated serving on this machine,
measured through HTTP and predicted by the simulator, side by side (chapter 11).

1. A gloo send's latency and bandwidth, for the KV transfer (`distributed.collectives`).
2. For each layout, start the server as a subprocess (`python -m minillm serve`, and the same
   with `--disaggregated --threads-per-engine 1`), warm it with two short requests, probe its
   step costs through its API (`probe_step_costs`: the costs of this process, its threads and
   this moment's load), drive it with `long_among_short` at each rate (chapter 8's load
   generator), and stop it.
3. Beside each run, the simulator's prediction for the same arrivals and token counts, and the
   SLO's attainment and goodput (DistServe's metric) for both.

The SLO is set from the colocated server's probed costs: TTFT within `slo_scale` times a lone
prefill of the longest prompt, mean ITL within `slo_scale` times a decode step of 4 sequences.
Writes benchmarks/results/disaggregation_cpu.json (machine and load average included).
Defaults take about 5 minutes on 2 loaded cores; --quick about 3.

Read one run with care: on a 2-core machine shared with other work, a step's time swings with
the load, between calibration and the runs too; the load average is recorded before and after.
"""
import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.records import write_result
from benchmarks.server_process import free_port, server_process
from minillm.lab.disagg_runs import (LONG_TOKENS, comparison_table, compare, drive, long_among_short,
                                     predict, probe_step_costs, sim_requests)
from minillm.lab.loadgen import jsonable

NAME = "smollm2-135m"
LAYOUTS = {"colocated": [], "disaggregated": ["--disaggregated", "--threads-per-engine", "1"]}


def kv_link():
    """This machine's gloo send (latency and bandwidth), measured before any server starts."""
    from minillm.distributed.collectives import fit_alpha_beta, measure_collectives
    timings = measure_collectives(2, sizes=(4096, 1 << 20, 8 << 20), repeats=5, threads=1)
    send = fit_alpha_beta(timings)["send"]
    print(f"gloo send: {1e3 * send.latency_s:.2f} ms + {send.seconds_per_byte * 1e9:.3f} s/GB", flush=True)
    return send.as_link("gloo send, this machine")


def slo_from(costs, scale: float) -> tuple[float, float]:
    """TTFT within `scale` x a lone prefill of the longest prompt, mean ITL within `scale` x a
    decode step of 4 sequences at that context."""
    return (scale * costs.prefill_seconds([LONG_TOKENS[1]]),
            scale * costs.decode_seconds([LONG_TOKENS[1]] * 4))


def run_layout(layout: str, workloads: list, link, slo, slo_scale: float, log_dir: Path, tok,
               quick: bool) -> dict:
    """Start the server, warm it, probe its step costs, run every workload beside its
    prediction, stop it. `slo` None: set it from this server's probed costs."""
    from minillm.lab.step_costs import costs_table
    from minillm.model.config import get_config
    port = free_port()
    argv = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--served-model-name",
            NAME, *LAYOUTS[layout]]
    url = f"http://127.0.0.1:{port}/v1"
    rows = []
    with server_process(argv, url[:-3] + "/health", log_dir / f"{layout}.log") as (_, startup_s):
        drive(url, NAME, long_among_short(tok, 2, 100.0, seed=99, long_fraction=0))  # warm-up
        t0 = time.perf_counter()
        probe = probe_step_costs(url, NAME, tok, rounds=1 if quick else 2)
        print(f"{layout}: step costs probed through the API ({time.perf_counter() - t0:.0f}s):\n"
              f"{costs_table(probe)}", flush=True)
        slo = slo or slo_from(probe["costs"], slo_scale)
        for w in workloads:
            results, duration = drive(url, NAME, w)
            reqs = sim_requests(w, results)
            pred = predict(layout, reqs, probe["costs"], probe["costs"], link, get_config(NAME))
            row = {"layout": layout, "rate": w.rate, "duration_s": round(duration, 2),
                   "requests": [{"arrival_s": round(r.arrival_s, 3), "prompt_tokens": r.prompt_tokens,
                                 "output_tokens": r.output_tokens} for r in reqs],
                   **compare(results, duration, pred, *slo),
                   "load_average": [round(x, 2) for x in os.getloadavg()]}
            rows.append(row)
            print(comparison_table([row]).splitlines()[-1], flush=True)
    return {"command": shlex.join(argv), "startup_s": round(startup_s, 1), "slo": slo,
            "step_costs": {"costs": vars(probe["costs"]), "fit_error": probe["error"],
                           "prefill_samples": probe["prefill"], "decode_samples": probe["decode"]},
            "rows": rows}


def run(quick: bool = False, rates=(0.25, 0.5), num_prompts: int = 10, max_tokens: int = 16,
        slo_scale: float = 2.0, seed: int = 0, out_dir=None) -> dict:
    from minillm.model.loading import load_tokenizer
    tok = load_tokenizer()
    if quick:
        rates, num_prompts = rates[-1:], min(num_prompts, 6)
    load_before = [round(x, 2) for x in os.getloadavg()]
    link = kv_link()
    workloads = [long_among_short(tok, num_prompts, r, seed, max_tokens=max_tokens) for r in rates]
    layouts, slo = {}, None
    with tempfile.TemporaryDirectory(prefix="minillm-disagg-") as logs:
        for layout in LAYOUTS:             # colocated first: its probed costs set the SLO
            layouts[layout] = run_layout(layout, workloads, link, slo, slo_scale, Path(logs), tok, quick)
            slo = layouts[layout]["slo"]
            print(f"SLO: TTFT <= {slo[0]:.2f} s, mean ITL <= {1e3 * slo[1]:.0f} ms", flush=True)
    rows = [r for lay in layouts.values() for r in lay["rows"]]
    print(comparison_table(rows))
    payload = {
        "workload": {"kind": "long_among_short", "num_prompts": num_prompts, "rates": list(rates),
                     "max_tokens": max_tokens, "seed": seed, "long_fraction": 0.25},
        "slo": {"ttft_s": round(slo[0], 3), "itl_s": round(slo[1], 4), "scale": slo_scale,
                "from": "the colocated server's probed costs"},
        "kv_link": vars(link), "layouts": layouts, "table": comparison_table(rows),
        "load_average_before": load_before, "quick": quick,
        "units": {"ttft_ms / itl_ms / tpot_ms": "milliseconds", "goodput / throughput": "requests/s",
                  "step costs": "seconds (a), s/token (b), s/token^2 (c)",
                  "error": "(predicted - measured) / measured"}}
    path = write_result("disaggregation", jsonable(payload), "cpu", out_dir)
    print(f"wrote {path}")
    return payload


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks disaggregation", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slo-scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    run(a.quick, tuple(a.rates), a.num_prompts, a.max_tokens, a.slo_scale, a.seed, a.out)


if __name__ == "__main__":
    main()
