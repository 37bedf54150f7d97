"""The HTTP load generator (chapter 8): load-test any OpenAI-compatible server, in the style of
vLLM's serving benchmark.

It talks only the OpenAI protocol (streamed /v1/chat/completions or /v1/completions), so the same
call measures minillm's server, `transformers serve` or a vLLM server:
`benchmark(base_url, model, ...) -> LoadRun` (safe inside Jupyter's running event loop) runs one
load and summarizes it; `sweep` runs several, from saturation down. From a shell, with a record
written to benchmarks/results/ of the checkout:

    python -m benchmarks serve --base-url http://127.0.0.1:8000/v1 --model smollm2-135m \
        --dataset humaneval --num-prompts 32 --request-rate 2 --max-concurrency 8 \
        --max-tokens 64 --goodput ttft:2000 tpot:200

Left out on purpose: client-side tokenization (token counts come from the server's `usage`),
warm-up requests (`serve_compare` sends its own), and result files for every request.
"""
import asyncio
import concurrent.futures
import math
import re
from dataclasses import dataclass

from minillm.lab.datasets import load_prompts
from minillm.lab.serve_client import run_load
from minillm.lab.serve_metrics import RequestResult, format_table, parse_goodput, summarize


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
