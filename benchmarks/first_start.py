"""`python -m benchmarks first_start [--threads 1 2] [--processes 3]`: the speed a newcomer gets.

A newcomer's first processes find no tuned route table. This benchmark replays that on the
machine it runs on, with an empty tuning cache (a fresh MINILLM_CACHE holding only the converted
model), for each thread count:

1. `--processes` processes started back to back (each the moment the last one exits, so the
   load average still carries the previous one's work): each loads SmolLM2 through the front
   door (`minillm.load_model`: the quick probe, no background tuner) and times batch-1 decode,
   minillm's `generate` against transformers' `generate` on the same weights, in alternating
   rounds. Goals: the processes agree within 15%, and each is >= 1.6x transformers.
2. The full tuning (`python -m minillm.kernels`), then one process that times the tuned table
   against the quick probe's routes in the same rounds. Goal: the quick probe within 10%.
3. One process started while a 2-thread job runs beside it (a bounded matmul loop): nothing may
   be timed then, so it takes the untimed prior (`minillm.kernels.route_priors`); it times that
   against F.linear everywhere, the old fallback, in the same rounds.

Each child prints one JSON line; the record (benchmarks/results/first_start_cpu.json) keeps them,
the load average and the measured other work before each start, and the tuned table (which
`python -m benchmarks route_priors` reads).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import REPO_ROOT, machine_info, write_result

N_NEW, ROUNDS = 32, 5


def _child(mode: str, threads: int, n_new: int, rounds: int) -> dict:
    """One fresh process's measurement (see the module text); returns what it prints."""
    torch.set_num_threads(threads)
    from benchmarks.decode import _equal_length_prompts, _ms_per_token, transformers_run
    from minillm.kernels import cpu_tuning as ct
    from minillm.kernels.load_now import load_now
    from minillm.llm import load_model
    from minillm.model import loading
    from minillm.model.generate import generate
    from minillm.model.hf_convert import to_hf_model
    out = {"mode": mode, "threads": threads, "others_at_start": load_now(0.5).as_record(),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    t0 = time.perf_counter()
    model, tok = load_model(device="cpu")                         # the front door, as a user would
    out["ready_s"] = round(time.perf_counter() - t0, 2)
    out["source"] = model.linear_plan_source
    out["routes_at_1_row"] = {g: p["routes"][1] for g, p in model.linear_plan.items()}
    prompt = _equal_length_prompts(tok, 1)[0]
    runs = {"minillm": lambda n: generate(model, prompt, n)}
    if mode == "first":
        runs["transformers"] = transformers_run(to_hf_model(model), [prompt])
    else:                                                         # a second model, other routes
        other, _ = loading.load_model(device="cpu")
        if mode == "tuned":                                       # the quick probe's routes
            ct.accelerate(other, cache_dir=tempfile.mkdtemp())
        else:                                                     # busy: the old fallback
            ct.accelerate(other, route="F.linear")
        out["other_source"] = other.linear_plan_source
        runs["other"] = lambda n: generate(other, prompt, n)
    ms = _ms_per_token(runs, n_new, "cpu", rounds)
    out["ms_per_token"] = {k: round(v, 2) for k, v in ms.items()}
    if mode == "tuned":
        out["tuned_report"] = ct.kernel_report(model)
    return out


def _burner(threads: int, seconds: float) -> subprocess.Popen:
    code = (f"import time, torch\ntorch.set_num_threads({threads})\na = torch.randn(1024, 1024)\n"
            f"t = time.time()\nwhile time.time() - t < {seconds}: a @ a")
    return subprocess.Popen([sys.executable, "-c", code])


def _spawn(mode: str, threads: int, env: dict, n_new: int, rounds: int) -> dict:
    from minillm.kernels.load_now import load_now
    before = {"load_average": [round(x, 2) for x in os.getloadavg()], "others": load_now(0.5).others}
    cmd = [sys.executable, "-m", "benchmarks.first_start", "--child", mode, "--threads", str(threads),
           "--new-tokens", str(n_new), "--rounds", str(rounds)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{done.stderr[-3000:]}")
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    rec["before_start"] = before
    return rec


def _one_thread_count(threads: int, processes: int, n_new: int, rounds: int, cache: Path) -> dict:
    env = {**os.environ, "MINILLM_CACHE": str(cache), "MINILLM_BACKGROUND_TUNING": "0"}
    firsts = []
    for i in range(processes):
        print(f"[first_start] {threads} thread(s): fresh process {i + 1} of {processes}", flush=True)
        firsts.append(_spawn("first", threads, env, n_new, rounds))
    t0 = time.perf_counter()
    print(f"[first_start] {threads} thread(s): the full tuning (python -m minillm.kernels)", flush=True)
    tuning = subprocess.run([sys.executable, "-m", "minillm.kernels", "--threads", str(threads)],
                            cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True, timeout=1800)
    tune_s = time.perf_counter() - t0
    print(f"[first_start] {threads} thread(s): tuned table against the quick probe", flush=True)
    tuned = _spawn("tuned", threads, env, n_new, rounds)
    tuned["tune_s"] = round(tune_s, 1)
    tuned["tuning_said"] = [line for line in tuning.stderr.splitlines() if line.startswith("minillm:")]
    for f in (cache / "kernels").glob("linear_*.json"):         # no table for the busy start
        f.unlink()
    print(f"[first_start] {threads} thread(s): a start beside a 2-thread job", flush=True)
    burner = _burner(2, 600)
    try:
        time.sleep(2.0)
        busy = _spawn("busy", threads, env, n_new, rounds)
    finally:
        burner.kill()
        burner.wait()
    ms = [f["ms_per_token"]["minillm"] for f in firsts]
    ratios = [f["ms_per_token"]["transformers"] / f["ms_per_token"]["minillm"] for f in firsts]
    return {"threads": threads, "first_starts": firsts, "tuned": tuned, "busy": busy,
            "summary": {"minillm_ms": ms, "spread_max_over_min": round(max(ms) / min(ms), 3),
                        "x_transformers": [round(r, 2) for r in ratios],
                        "quick_over_tuned": round(tuned["ms_per_token"]["other"]
                                                  / tuned["ms_per_token"]["minillm"], 3)
                        if tuned["source"] == "tuned" else None,     # the tuning refused: busy
                        "busy_prior_over_f_linear": round(busy["ms_per_token"]["minillm"]
                                                          / busy["ms_per_token"]["other"], 3)}}


def run(threads=(1, 2), processes: int = 3, n_new: int = N_NEW, rounds: int = ROUNDS, out_dir=None) -> dict:
    from minillm.model.loading import cache_dir
    from minillm.llm import load_model
    load_model(device="cpu", kernels="plain")                    # the converted model, cached once
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        for item in cache_dir().iterdir():                        # everything but the tuning tables
            if item.name != "kernels":
                (cache / item.name).symlink_to(item)
        runs = [_one_thread_count(t, processes, n_new, rounds, cache) for t in threads]
    record = {"model": "SmolLM2-135M-Instruct", "new_tokens": n_new, "rounds": rounds,
              "units": {"ms_per_token": "ms per batch-1 decode step, median of alternating rounds",
                        "others": "cores' worth of other work over 0.5 s (minillm.kernels.load_now)"},
              "goals": {"spread_max_over_min": "<= 1.15", "x_transformers": ">= 1.6",
                        "quick_over_tuned": "<= 1.10", "busy_prior_over_f_linear": "< 1"},
              "runs": runs, "machine": machine_info("cpu")}
    record["path"] = str(write_result("first_start", record, "cpu", out_dir))
    return record


def report(r: dict) -> str:
    lines = [f"first start on {r['machine']['cpu']} ({r['machine']['cpu_cores']} cores), batch-1 decode, "
             f"{r['new_tokens']} new tokens, medians of {r['rounds']} alternating rounds:"]
    for run in r["runs"]:
        s = run["summary"]
        lines.append(f"  {run['threads']} thread(s): fresh processes {s['minillm_ms']} ms/token "
                     f"(max/min {s['spread_max_over_min']}), x transformers {s['x_transformers']}; "
                     f"quick/tuned {s['quick_over_tuned']} (tuning {run['tuned']['tune_s']} s); beside a "
                     f"2-thread job the prior/F.linear {s['busy_prior_over_f_linear']} "
                     f"({run['busy']['source'][:60]}...)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks first_start", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=N_NEW)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["first", "tuned", "busy"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(t < 1 for t in args.threads) or args.processes < 1 or args.new_tokens < 2 or args.rounds < 1:
        p.error("--threads and --processes must be >= 1, --new-tokens >= 2, --rounds >= 1")
    if args.child:
        print(json.dumps(_child(args.child, args.threads[0], args.new_tokens, args.rounds)))
        return
    r = run(tuple(args.threads), args.processes, args.new_tokens, args.rounds, args.out)
    print(report(r))
    print(f"wrote {r['path']}")


if __name__ == "__main__":
    main()
