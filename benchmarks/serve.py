"""`python -m benchmarks serve`: load-test any OpenAI-compatible server with the load generator
(`minillm.lab.loadgen`) and write what it measured to the results ledger.

    python -m benchmarks serve --base-url http://127.0.0.1:8000/v1 --model smollm2-135m \
        --dataset humaneval --num-prompts 32 --request-rate 2 --max-concurrency 8 \
        --max-tokens 64 --goodput ttft:2000 tpot:200

`write_record(run, label)` writes `serve_<label>_cpu.json` (the client machine's metadata: the
server may be elsewhere; its label says which) and a figure of the latency CDFs beside it.
"""
import argparse
import math

from benchmarks.records import save_figure_beside, write_result
from minillm.lab.datasets import DATASETS
from minillm.lab.loadgen import LoadRun, benchmark, jsonable, safe_label
from minillm.lab.serve_client import ENDPOINTS
from minillm.lab.serve_metrics import UNITS, format_table


def write_record(run: LoadRun, label: str, out_dir=None, extra: dict | None = None):
    """The JSON record (config, summary, per-request ttft/e2e/tokens) and its CDF figure."""
    from minillm.viz.serve import serve_run_plot        # matplotlib only when a record is drawn
    per_request = {"ok": [r.ok for r in run.results], "ttft_s": [r.ttft for r in run.results],
                   "e2e_s": [r.e2e for r in run.results],
                   "output_tokens": [r.output_tokens for r in run.results]}
    payload = {"label": label, "config": run.config, "summary": run.summary,
               "per_request": per_request, "units": {**UNITS, "per_request": "seconds, tokens"},
               **(extra or {})}
    name = f"serve_{safe_label(label)}"
    path = write_result(name, jsonable(payload), device="cpu", out_dir=out_dir)
    fig = serve_run_plot(run.results, title=f"{label}: rate {run.config['request_rate']} req/s")
    save_figure_beside(fig, path, name)
    return path


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 (inf: all at once), got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks serve",
                                description="Load-test an OpenAI-compatible server.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the name the server lists under /v1/models")
    p.add_argument("--dataset", default="chapters", choices=DATASETS)
    p.add_argument("--endpoint", default="chat", choices=list(ENDPOINTS))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--request-rate", type=rate, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="ttft:MS tpot:MS e2e:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="names the record (default: the model name)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--no-record", action="store_true", help="print the table only")
    return p


def main(argv=None) -> LoadRun:
    args = parser().parse_args(argv)
    try:
        run = benchmark(args.base_url, args.model, dataset=args.dataset, num_prompts=args.num_prompts,
                        request_rate=args.request_rate, burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, max_tokens=args.max_tokens,
                        ignore_eos=args.ignore_eos, endpoint=args.endpoint, goodput=args.goodput,
                        seed=args.seed, api_key=args.api_key)
    except ValueError as err:
        raise SystemExit(f"python -m benchmarks serve: error: {err}") from None
    label = args.label or args.model
    print(format_table(run.summary, label))
    if not args.no_record:
        from minillm.viz.plotting import use_headless_backend
        use_headless_backend()
        print("record:", write_record(run, label, args.out))
    return run
