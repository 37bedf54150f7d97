"""`python -m benchmarks disaggregation`: colocated against disaggregated serving on this machine,
measured through HTTP and predicted by the simulator, side by side (chapter 11).

1. A gloo send's latency and bandwidth, for the KV transfer (`distributed.collectives`).
2. For each layout, start the server as a subprocess (`python -m minillm serve`, and the same
   with `--disaggregated --threads-per-engine 1`), warm it with two short requests, probe its
   step costs through its API (`probe_step_costs`: the costs of this process, its threads and
   this moment's load) before and after driving it with `long_among_short` at each rate
   (chapter 8's load generator), and stop it.
3. Beside each run, the simulator's prediction for the same arrivals and token counts, and the
   SLO's attainment and goodput (DistServe's metric) for both, also at tighter SLOs (0.25x,
   0.5x); every request's measured and predicted TTFT and gaps are kept in the record.
4. The same simulator on Llama-3-70B instances from the roofline (`extrapolation`): the best
   prefill:decode split of 8 TP=8 H100 instances beside the scaling book's ratio.

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
from minillm.analysis.slo import goodput, slo_attainment
from minillm.analysis.step_fit import fit_error, fit_step_costs
from minillm.lab.disagg_runs import (LONG_TOKENS, comparison_table, compare, drive, long_among_short,
                                     measured, predict, probe_step_costs, sim_requests)
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


def extrapolation() -> dict:
    """The simulator carried to Llama-3-70B on H100s (analysis/disagg_scale.py, its defaults:
    8 instances of TP=8, 2048-token prompts, 256-token answers, TTFT 0.4 s, ITL 25 ms) beside
    the scaling book's prefill:decode ratio."""
    from minillm.analysis.disagg_scale import best_split, scaling_book_ratio, split_table
    from minillm.analysis.roofline import get_hardware
    from minillm.model.config import get_config
    out = best_split(get_config("llama-3-70b"), get_hardware("h100-sxm"))
    print(split_table(out), flush=True)
    best = out["best"]
    return {"model": "llama-3-70b", "chip": "h100-sxm", "instances": 8, "tp": 8,
            "prompt_tokens": 2048, "output_tokens": 256, "ttft_s": 0.4, "itl_s": 0.025,
            "attainment": 0.9, "splits": out["splits"], "best": best, "colocated": out["colocated"],
            "best_over_colocated": round(best["max_rate"] / out["colocated"], 2),
            "best_ratio_prefill_per_decode": round(best["prefill"] / best["decode"], 2),
            "scaling_book_ratio": round(scaling_book_ratio(), 2), "costs": vars(out["costs"])}


def per_request(reqs, results, pred) -> list[dict]:
    """Each request's arrival, tokens, and measured / predicted TTFT and gaps in ms."""
    ms = lambda xs: [round(1e3 * x, 1) for x in xs]    # noqa: E731
    return [{"arrival_s": round(q.arrival_s, 3), "prompt_tokens": q.prompt_tokens,
             "output_tokens": q.output_tokens, "ok": r.ok,
             "measured": {"ttft_ms": round(1e3 * r.ttft, 1) if r.ok else None, "itl_ms": ms(r.itl)},
             "predicted": {"ttft_ms": round(1e3 * p.ttft, 1), "itl_ms": ms(p.itls)}}
            for q, r, p in zip(reqs, results, pred)]


def slo_sweep(results, duration: float, pred, costs_slo, scales=(0.25, 0.5, 1.0)) -> dict:
    """Attainment and goodput, measured / predicted, with the SLO's two targets times each scale
    (DistServe's "SLO scale" plot: tighter to the left)."""
    sim_duration = max(r.finish_s for r in pred)
    out = {}
    for k in scales:
        t, i = k * costs_slo[0], k * costs_slo[1]
        out[str(k)] = {"measured": {"attainment": slo_attainment(measured(results), t, i),
                                    "goodput": goodput(measured(results), t, i, duration)},
                       "predicted": {"attainment": slo_attainment(pred, t, i),
                                     "goodput": goodput(pred, t, i, sim_duration)}}
    return out


def run_layout(layout: str, workloads: list, link, slo, slo_scale: float, log_dir: Path, tok,
               quick: bool) -> dict:
    """Start the server, warm it, probe its step costs, run every workload, probe again, stop
    it; then predict every run. `slo` None: set it from this server's probed costs."""
    from minillm.lab.step_costs import costs_table
    from minillm.model.config import get_config
    port = free_port()
    argv = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--served-model-name",
            NAME, *LAYOUTS[layout]]
    url = f"http://127.0.0.1:{port}/v1"
    runs = []
    with server_process(argv, url[:-3] + "/health", log_dir / f"{layout}.log") as (_, startup_s):
        drive(url, NAME, long_among_short(tok, 2, 100.0, seed=99, long_fraction=0))  # warm-up
        t0 = time.perf_counter()
        before = probe_step_costs(url, NAME, tok, rounds=1)
        for w in workloads:
            results, duration = drive(url, NAME, w)
            runs.append((w, results, duration, [round(x, 2) for x in os.getloadavg()]))
        after = probe_step_costs(url, NAME, tok, rounds=1, seed=1)
    # load drifts: the costs are fitted to the probes before and after the runs together
    samples = {k: before[k] + after[k] for k in ("prefill", "decode")}
    costs = fit_step_costs(samples["prefill"], samples["decode"])
    probe = {**samples, "costs": costs, "error": fit_error(costs, samples["prefill"], samples["decode"])}
    print(f"{layout}: step costs probed through the API before and after its runs "
          f"({time.perf_counter() - t0:.0f}s in all):\n{costs_table(probe)}", flush=True)
    slo = slo or slo_from(costs, slo_scale)
    rows = []
    for w, results, duration, load in runs:
        reqs = sim_requests(w, results)
        pred = predict(layout, reqs, costs, costs, link, get_config(NAME))
        rows.append({"layout": layout, "rate": w.rate, "duration_s": round(duration, 2),
                     **compare(results, duration, pred, *slo), "load_average": load,
                     "slo_sweep": slo_sweep(results, duration, pred, costs_slo=slo),
                     "requests": per_request(reqs, results, pred)})
        print(comparison_table(rows[-1:]).splitlines()[-1], flush=True)
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
        "extrapolation": extrapolation(),
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
