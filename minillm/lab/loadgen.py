"""`python -m minillm.bench serve`: load-test any OpenAI-compatible server, in the style of vLLM's
serving benchmark, and write what it measured to the results ledger.

    python -m minillm.bench serve --base-url http://127.0.0.1:8000/v1 --model smollm2-135m \
        --dataset humaneval --num-prompts 32 --request-rate 2 --max-concurrency 8 \
        --max-tokens 64 --goodput ttft:2000 tpot:200

It talks only the OpenAI protocol (streamed /v1/chat/completions or /v1/completions), so the same
command measures minillm's server, `transformers serve` or a vLLM server. In Python:
`benchmark(base_url, model, ...) -> LoadRun` (safe inside Jupyter's running event loop) and
`write_record(run, label)`, which writes `serve_<label>_cpu.json` (the client machine's metadata:
the server may be elsewhere; its label says which) and a figure of the latency CDFs beside it.

Left out on purpose: client-side tokenization (token counts come from the server's `usage`),
warm-up requests (`serve_compare` sends its own), and result files for every request.
"""
import argparse
import asyncio
import concurrent.futures
import math
import re
from dataclasses import dataclass

from minillm.bench.datasets import DATASETS, load_prompts
from minillm.bench.serve_client import ENDPOINTS, run_load
from minillm.bench.serve_metrics import RequestResult, format_table, parse_goodput, summarize


@dataclass
class LoadRun:
    config: dict
    summary: dict
    results: list[RequestResult]


def _run_async(coro):
    """asyncio.run, or on a worker thread when an event loop already runs here (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def benchmark(base_url: str, model: str, *, dataset: str = "chapters", num_prompts: int = 16,
              request_rate: float = math.inf, burstiness: float = 1.0,
              max_concurrency: int | None = None, max_tokens: int = 64, ignore_eos: bool = False,
              endpoint: str = "chat", goodput=None, seed: int = 0, api_key: str | None = None,
              timeout_s: float = 600.0) -> LoadRun:
    """Run one load (every argument checked before anything is sent) and summarize it."""
    targets = parse_goodput(goodput) if goodput else {}
    prompts = load_prompts(dataset, num_prompts, seed)
    coro = run_load(base_url, model, prompts, endpoint=endpoint, request_rate=request_rate,
                    burstiness=burstiness, max_concurrency=max_concurrency, max_tokens=max_tokens,
                    ignore_eos=ignore_eos, seed=seed, api_key=api_key, timeout_s=timeout_s)
    results, duration = _run_async(coro)
    config = {"base_url": base_url, "model": model, "dataset": dataset, "num_prompts": num_prompts,
              "request_rate": "inf" if math.isinf(request_rate) else request_rate,
              "burstiness": burstiness, "max_concurrency": max_concurrency, "max_tokens": max_tokens,
              "ignore_eos": ignore_eos, "endpoint": endpoint, "seed": seed}
    return LoadRun(config, summarize(results, duration, targets), results)


def sweep(base_url: str, model: str, fractions=(0.25, 0.5, 1.0), rates=None, verbose: bool = False,
          label: str = "", **load) -> list[dict]:
    """Latency against offered load: one run at rate inf (saturation), then one at each rate in
    `rates` (default: each fraction of the saturation run's request throughput). -> rows
    {"offered_rate", "summary"}, lowest offered rate first and inf last."""
    if rates is None:
        for f in fractions:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
                raise ValueError(f"fractions must be numbers > 0, got {f!r}")
    rows = [{"offered_rate": math.inf, "summary": benchmark(base_url, model, **load).summary}]
    if verbose:
        print(format_table(rows[0]["summary"], f"{label} @ inf req/s"), flush=True)
    if rates is None:
        saturation = rows[0]["summary"]["request_throughput"]
        if not saturation > 0:
            raise RuntimeError(f"no request completed at saturation: {rows[0]['summary']['errors']}")
        rates = [f * saturation for f in fractions]
    for rate in rates:
        summary = benchmark(base_url, model, request_rate=rate, **load).summary
        rows.append({"offered_rate": rate, "summary": summary})
        if verbose:
            print(format_table(summary, f"{label} @ {rate:.3g} req/s"), flush=True)
    return sorted(rows, key=lambda r: r["offered_rate"])


def sweep_table(rows: list[dict]) -> str:
    """One line per run: offered and achieved req/s, output tok/s, TTFT and TPOT p50 / p99 (ms)."""
    head = f"{'offered/s':>10} {'done/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'TPOT p50':>9} {'TPOT p99':>9} {'failed':>6}"
    lines = [head]
    for r in rows:
        s = r["summary"]
        lines.append(f"{r['offered_rate']:>10.3g} {s['request_throughput']:>7.2f} {s['output_throughput']:>9.1f} "
                     f"{s['ttft_ms']['median']:>9.0f} {s['ttft_ms']['p99']:>9.0f} {s['tpot_ms']['median']:>9.1f} "
                     f"{s['tpot_ms']['p99']:>9.1f} {s['failed']:>6}")
    return "\n".join(lines)


def jsonable(value):
    """nan/inf -> None/"inf" so that records stay strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", label).strip("-") or "server"


def write_record(run: LoadRun, label: str, out_dir=None, extra: dict | None = None):
    """The JSON record (config, summary, per-request ttft/e2e/tokens) and its CDF figure."""
    from minillm.bench.common import save_figure_beside, write_result
    from minillm.viz.serve import serve_run_plot
    per_request = {"ok": [r.ok for r in run.results], "ttft_s": [r.ttft for r in run.results],
                   "e2e_s": [r.e2e for r in run.results],
                   "output_tokens": [r.output_tokens for r in run.results]}
    from minillm.bench.serve_metrics import UNITS
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
    p = argparse.ArgumentParser(prog="python -m minillm.bench serve",
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
        raise SystemExit(f"python -m minillm.bench serve: error: {err}") from None
    label = args.label or args.model
    print(format_table(run.summary, label))
    if not args.no_record:
        from minillm.viz.plotting import use_headless_backend
        use_headless_backend()
        print("record:", write_record(run, label, args.out))
    return run
