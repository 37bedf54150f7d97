"""`python -m benchmarks <name|all> [--quick] [--device cpu|cuda] [--out DIR]`, from the checkout's top.

`python -m benchmarks serve ...` (load-test a running OpenAI-compatible server) and
`python -m benchmarks serve_compare ...` (minillm's server against `transformers serve`) and
`python -m benchmarks serve_defaults ...` (the server's old scheduling defaults against its new
ones) and `python -m benchmarks disaggregation ...` (colocated against disaggregated serving, the
simulator's prediction beside each run) take their own flags (`--help` lists them); `all` leaves
them out: they need servers.

Each benchmark lives in its own module with `run(quick, device, out_dir) -> dict`, writes a JSON
record (machine metadata included) to benchmarks/results/ and its figures, and prints the ratios
it measured in that one run. `all` runs every one of them in turn.
"""
import argparse
import importlib
import json
import os
import time

# A benchmark measures the routes it is given: no background tuner beside it (minillm/kernels/background.py).
os.environ.setdefault("MINILLM_BACKGROUND_TUNING", "0")

BENCHMARKS = {
    "decode": "benchmarks.decode",       # ch 0: minillm vs transformers, batch 1 and 8
    "roofline": "benchmarks.roofline",   # ch 1: ceilings, matmul points, decode vs batch
    "kernels": "benchmarks.kernels",     # ch 1: CPU matmul routes, tuned table, decode per route
    "compile": "benchmarks.compile",     # ch 1: torch.compile vs eager, decode and verify steps
    "compiled_steps": "benchmarks.compiled_steps",   # ch 1, 4: the engine's compiled steps per size
    "serving": "benchmarks.serving",     # ch 4-5: continuous vs static, chunked-prefill stall
    "lockout": "benchmarks.lockout",     # ch 5: short requests behind a long prefill, knobs off / on
    "spec": "benchmarks.spec",           # ch 6: speculative decoding speedups vs theory
    "drafting": "benchmarks.drafting",   # ch 10: Medusa, EAGLE, lookahead vs n-gram, trees sized here
    "spec_replay": "benchmarks.spec_replay",   # ch 6: the real n-gram schedule timed on any weights
    "cuda_graphs": "benchmarks.cuda_graphs",   # ch 1, GPU only: launch overhead vs graph replay
    "cuda_graph_steps": "benchmarks.cuda_graph_steps",   # ch 1, 4, GPU only: piecewise graphs, engine
    "overhead": "benchmarks.overhead",   # ch 4: the engine's own cost per decode step
    "quant": "benchmarks.quant",         # ch 7: batch-1 decode per weight format vs its floor
    "priority": "benchmarks.priority",   # ch 8: priorities and SLOs, P95-driven token budget
    "spec_switch": "benchmarks.spec_switch",   # ch 8: speculation off / always / stepping aside under load
    "slo_control": "benchmarks.slo_control",   # ch 8: the SLO controller under a load step
    "kv_tier": "benchmarks.kv_tier",     # ch 8: host KV tier on a multi-turn chat, restore vs recompute
    "attention": "benchmarks.attention",  # ch 9: prefill attention, materialized vs tiled vs SDPA
    "attention_decode": "benchmarks.attention_decode",  # ch 9: paged / flash-decoding / SDPA decode, long context
    "parallel": "benchmarks.parallel",   # ch 11: gloo collectives, pipeline bubble, TP formulas at 70B
}


def run_one(name: str, quick: bool, device, out_dir) -> dict:
    module = importlib.import_module(BENCHMARKS[name])
    t0 = time.perf_counter()
    kwargs = {"out_dir": out_dir} if out_dir is not None else {}
    record = module.run(quick=quick, device=device, **kwargs)
    if hasattr(module, "report"):
        print(module.report(record))
    else:
        print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=1, default=str)[:3000])
    print(f"[{name}] done in {time.perf_counter() - t0:.0f}s\n")
    return record


CLIENTS = {"serve": "benchmarks.serve", "serve_compare": "benchmarks.serve_compare",
           "serve_defaults": "benchmarks.serve_defaults", "disaggregation": "benchmarks.disaggregation",
           "sitting": "benchmarks.sitting", "route_priors": "benchmarks.route_priors",
           "first_start": "benchmarks.first_start", "short_beside_long": "benchmarks.short_beside_long"}


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in CLIENTS:             # their own argparse gets the rest of the line
        importlib.import_module(CLIENTS[argv[0]]).main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks", epilog="also: serve ... and "
                                     "serve_compare ... (load tests of HTTP servers; see their --help)")
    parser.add_argument("name", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the suite")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the course's policy, one, as in every chapter)")
    args = parser.parse_args(argv)
    import torch
    from minillm.lab.machine import COURSE_THREADS
    threads = COURSE_THREADS if args.threads is None else args.threads
    if not 1 <= threads <= 1024:
        parser.error(f"--threads must be in [1, 1024], got {threads}")
    torch.set_num_threads(threads)
    from minillm.viz.plotting import use_headless_backend
    use_headless_backend()
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    for name in names:
        run_one(name, args.quick, args.device, args.out)


if __name__ == "__main__":
    main()
