"""`python -m benchmarks disaggregation`: colocated against disaggregated serving on this machine,
measured through HTTP and predicted by the simulator, side by side (chapter 11).

1. Calibrate: this machine's step costs (`lab/step_costs.py`) for the colocated engine (the
   front door's model, both cores) and for a one-thread engine (the plain loader's model, as each
   disaggregated worker runs it), and a gloo send's latency and bandwidth for the KV transfer.
2. For each layout, start the server as a subprocess (`python -m minillm serve`, and the same
   with `--disaggregated --threads-per-engine 1`), warm it with two short requests, drive it with
   `long_among_short` at each rate (chapter 8's load generator), and stop it.
3. Beside each run, the simulator's prediction for the same arrivals and token counts, and the
   SLO's attainment and goodput (DistServe's metric) for both.

The SLO is set from the one-thread costs: TTFT within `slo_scale` times an isolated prefill of
the longest prompt, mean ITL within `slo_scale` times an isolated decode step of 4 sequences.
Writes benchmarks/results/disaggregation_cpu.json (machine and load average included).
Defaults take about 5 minutes on 2 loaded cores; --quick about 3.

Read one run with care: on a 2-core machine shared with other work, a step's time swings with
the load, between calibration and the runs too; the load average is recorded before and after.
"""
import argparse
import gc
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.records import write_result
from benchmarks.server_process import free_port, server_process
from minillm.lab.disagg_runs import (LONG_TOKENS, comparison_table, compare, drive, long_among_short,
                                     predict, sim_requests)
from minillm.lab.loadgen import jsonable

NAME = "smollm2-135m"
LAYOUTS = {"colocated": [], "disaggregated": ["--disaggregated", "--threads-per-engine", "1"]}


def calibrate(quick: bool) -> dict:
    """Step costs of both engines and the gloo send, measured here before any server starts."""
    import torch

    import minillm
    from minillm.distributed.collectives import fit_alpha_beta, measure_collectives
    from minillm.lab.step_costs import costs_table, measure_step_costs
    from minillm.model.loading import load_model
    shape = dict(prompt_lengths=(32, 128, 384, 768), batch_sizes=(1, 4, 8),
                 contexts=(32, 384) if quick else (32, 256, 512), rounds=1 if quick else 2)
    out = {}
    for label, loader, threads in (("colocated", minillm.load_model, 2), ("one_thread", load_model, 1)):
        model, _ = loader()
        t0 = time.perf_counter()
        res = measure_step_costs(model, threads=threads, **shape)
        print(f"step costs, {label} ({threads} threads, {time.perf_counter() - t0:.0f}s):\n"
              f"{costs_table(res)}", flush=True)
        out[label] = res
        del model
        gc.collect()
    timings = measure_collectives(2, sizes=(4096, 1 << 20, 8 << 20), repeats=5, threads=1)
    send = fit_alpha_beta(timings)["send"]
    out["kv_link"] = send.as_link("gloo send, this machine")
    print(f"gloo send: {1e3 * send.latency_s:.2f} ms + {send.seconds_per_byte * 1e9:.3f} s/GB", flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    return out


def run_layout(layout: str, workloads: list, cal: dict, slo: tuple, log_dir: Path, tok) -> dict:
    from minillm.model.config import get_config
    port = free_port()
    argv = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--served-model-name",
            NAME, *LAYOUTS[layout]]
    url = f"http://127.0.0.1:{port}"
    rows = []
    with server_process(argv, url + "/health", log_dir / f"{layout}.log") as (_, startup_s):
        drive(url + "/v1", NAME, long_among_short(tok, 2, 100.0, seed=99, long_fraction=0))  # warm-up
        for w in workloads:
            results, duration = drive(url + "/v1", NAME, w)
            reqs = sim_requests(w, results)
            if layout == "colocated":
                pred = predict(layout, reqs, cal["colocated"]["costs"])
            else:
                pred = predict(layout, reqs, cal["one_thread"]["costs"], cal["one_thread"]["costs"],
                               cal["kv_link"], get_config(NAME))
            row = {"layout": layout, "rate": w.rate, "duration_s": round(duration, 2),
                   "requests": [{"arrival_s": round(r.arrival_s, 3), "prompt_tokens": r.prompt_tokens,
                                 "output_tokens": r.output_tokens} for r in reqs],
                   **compare(results, duration, pred, *slo),
                   "load_average": [round(x, 2) for x in os.getloadavg()]}
            rows.append(row)
            print(comparison_table([row]).splitlines()[-1], flush=True)
    return {"command": shlex.join(argv), "startup_s": round(startup_s, 1), "rows": rows}


def run(quick: bool = False, rates=(0.25, 0.5), num_prompts: int = 10, max_tokens: int = 16,
        slo_scale: float = 2.0, seed: int = 0, out_dir=None) -> dict:
    from minillm.model.loading import load_tokenizer
    tok = load_tokenizer()
    if quick:
        rates, num_prompts = rates[-1:], min(num_prompts, 6)
    load_before = [round(x, 2) for x in os.getloadavg()]
    cal = calibrate(quick)
    one = cal["one_thread"]["costs"]
    slo = (slo_scale * one.prefill_seconds([LONG_TOKENS[1]]),
           slo_scale * one.decode_seconds([LONG_TOKENS[1]] * 4))
    print(f"SLO: TTFT <= {slo[0]:.2f} s, mean ITL <= {1e3 * slo[1]:.0f} ms", flush=True)
    workloads = [long_among_short(tok, num_prompts, r, seed, max_tokens=max_tokens) for r in rates]
    layouts = {}
    with tempfile.TemporaryDirectory(prefix="minillm-disagg-") as logs:
        for layout in LAYOUTS:
            layouts[layout] = run_layout(layout, workloads, cal, slo, Path(logs), tok)
    rows = [r for lay in layouts.values() for r in lay["rows"]]
    print(comparison_table(rows))
    payload = {
        "workload": {"kind": "long_among_short", "num_prompts": num_prompts, "rates": list(rates),
                     "max_tokens": max_tokens, "seed": seed, "long_fraction": 0.25},
        "slo": {"ttft_s": round(slo[0], 3), "itl_s": round(slo[1], 4), "scale": slo_scale},
        "step_costs": {k: {"costs": vars(cal[k]["costs"]), "fit_error": cal[k]["error"],
                           "threads": cal[k]["threads"]} for k in ("colocated", "one_thread")},
        "kv_link": vars(cal["kv_link"]),
        "layouts": layouts, "table": comparison_table(rows),
        "load_average_before": load_before, "quick": quick,
        "units": {"ttft_ms / itl_ms / tpot_ms": "milliseconds", "goodput / throughput": "requests/s",
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
