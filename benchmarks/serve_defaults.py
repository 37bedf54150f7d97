"""`python -m benchmarks serve_defaults`: minillm's server with its old scheduling defaults and
with its new ones, same client, same load, same offered rates, one after the other.

Old: a 256-token budget, no partial prefills (`--max-num-batched-tokens 256
--long-prefill-token-threshold 0 --max-num-partial-prefills 1`). New: the server's defaults
(`minillm.serve.cli.SERVER_DEFAULTS`). The load is `serve_compare`'s (HumanEval prompts on
/v1/completions, 24 prompts, 32 tokens): each server at rate inf, then at fractions of the *first*
run's saturation rate; `--rounds 3` runs old, new, old again, so drift of a shared machine shows
as a difference between the two old runs. The record `serve_defaults_cpu.json` holds every run's
summary, the command lines and the load average before each run.

Left out on purpose: `transformers serve` (serve_compare runs it), repeated loads per rate.
"""
import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.serve_compare import sweep_one
from minillm.lab.loadgen import jsonable, sweep_table
from minillm.serve.cli import SERVER_DEFAULTS

OLD = ["--max-num-batched-tokens", "256", "--long-prefill-token-threshold", "0",
       "--max-num-partial-prefills", "1", "--max-long-partial-prefills", "1"]


def run_ab(fractions=(0.5, 1.0), rounds: int = 2, num_prompts: int = 24, max_tokens: int = 32,
           out_dir=None) -> dict:
    load = {"dataset": "humaneval", "num_prompts": num_prompts, "max_tokens": max_tokens,
            "endpoint": "completions", "max_concurrency": None, "seed": 0}
    order = [("old", OLD), ("new", []), ("old", OLD)][:rounds]
    runs, rates = [], None
    with tempfile.TemporaryDirectory(prefix="minillm-serve-defaults-") as logs:
        for i, (name, extra) in enumerate(order):
            load_avg = os.getloadavg()[0]
            sweep = sweep_one("minillm", rates, tuple(sorted(fractions)), load, "cpu", Path("."),
                              extra, Path(logs))
            rates = sweep["rates"]
            runs.append({"config": name, "load_avg_before": load_avg, **sweep})
    from minillm.lab.serve_metrics import UNITS
    payload = {"units": {**UNITS, "load_avg_before": "1-minute load average"}, "runs": runs,
               "load": load, "fractions_of_first_saturation": sorted(fractions),
               "old_flags": OLD, "new_defaults": SERVER_DEFAULTS}
    from benchmarks.records import write_result
    path = write_result("serve_defaults", jsonable(payload), device="cpu", out_dir=out_dir)
    for r in runs:
        rows = sorted(r["runs"], key=lambda x: x["offered_rate"])
        print(f"{r['config']} (load {r['load_avg_before']:.1f}): {r['command']}\n{sweep_table(rows)}")
    print("record:", path)
    return payload


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks serve_defaults")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.5, 1.0])
    p.add_argument("--rounds", type=int, default=3, help="2: old, new; 3: old, new, old")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.rounds not in (2, 3):
        p.error("--rounds must be 2 or 3")
    return run_ab(tuple(a.fractions), a.rounds, out_dir=a.out)
