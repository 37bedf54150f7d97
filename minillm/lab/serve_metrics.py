"""What one load-test run measured, per request and in summary, in the terms of vLLM's serving
benchmark so that numbers from minillm, `transformers serve` or vLLM read the same way.

Per request (`RequestResult`): TTFT (request sent -> first chunk with text), every inter-token
latency (ITL: the gap between two consecutive chunks with text), end-to-end latency (e2e), and
the output token count (the server's `usage` when it sends one, else the number of text chunks).
TPOT is per request: (e2e - TTFT) / (output tokens - 1), defined only with >= 2 output tokens.

Summary (`summarize`): completed and failed counts, request throughput, output and total token
throughput over the run's wall time, mean / median / p95 / p99 of TTFT, TPOT, ITL and e2e in ms
(percentiles interpolate linearly between order statistics, as numpy's default does), and goodput:
completed requests per second that met every target given (`ttft`, `tpot`, `e2e` in ms).

Left out on purpose: per-token timing inside a chunk (a chunk carrying several tokens is one ITL
gap), standard deviations, and client-side tokenization of the output.
"""
import math
from dataclasses import dataclass, field

from minillm._validate import check_real
from minillm.analysis.slo import percentile   # linear between order statistics, as numpy

STATS = ("mean", "median", "p95", "p99")
GOODPUT_KEYS = ("ttft", "tpot", "e2e")

UNITS = {"ttft_ms / tpot_ms / itl_ms / e2e_ms": "milliseconds (mean, median, p95, p99 over requests)",
         "request_throughput / goodput": "requests per second", "output_throughput": "tokens per second",
         "offered_rate / rates": "requests per second offered (inf: all at once)",
         "duration_s": "seconds of wall clock for the whole load"}


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0                              # perf_counter seconds when the request was sent
    ttft: float = math.nan                          # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    e2e: float = math.nan                           # seconds
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; nan with fewer than 2 output tokens."""
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def describe_ms(values_s) -> dict:
    """mean, median, p95, p99 of seconds values, in milliseconds (nan values dropped)."""
    ms = [1e3 * v for v in values_s if not math.isnan(v)]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "median": percentile(ms, 50), "p95": percentile(ms, 95),
            "p99": percentile(ms, 99)}


def parse_goodput(items) -> dict:
    """["ttft:500", "tpot:50"] (or one "ttft:500 tpot:50" string) -> {"ttft": 500.0, ...} in ms."""
    if isinstance(items, str):
        items = items.split()
    targets = {}
    for item in items or ():
        key, sep, value = str(item).partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput targets are KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}, "
                             f"got {item!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"goodput target {key} must be a number of ms, got {value!r}") from None
        targets[key] = check_real(f"goodput target {key}", number, low=0, low_open=True)
    return targets


def meets(result: RequestResult, targets: dict) -> bool:
    """Whether a completed request met every target (ms); a nan TPOT meets a TPOT target."""
    if not result.ok:
        return False
    got = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
    for key, ms in targets.items():
        if key == "tpot" and math.isnan(got[key]):      # one output token: no decode gap to judge
            continue
        if not 1e3 * got[key] <= ms:
            return False
    return True


def summarize(results: list[RequestResult], duration_s: float, goodput: dict | None = None) -> dict:
    """The run's summary (see the module docstring); `duration_s` is the run's wall time."""
    check_real("duration_s", duration_s, low=0, low_open=True)
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
        "request_throughput": len(done) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": describe_ms([r.ttft for r in done]), "tpot_ms": describe_ms([r.tpot for r in done]),
        "itl_ms": describe_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": describe_ms([r.e2e for r in done]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if goodput:
        summary["goodput_targets_ms"] = dict(goodput)
        summary["goodput"] = sum(meets(r, goodput) for r in done) / duration_s
    return summary


def format_table(summary: dict, label: str = "") -> str:
    """A plain-text table of one summary, in the layout of vLLM's serving benchmark."""
    rows = [("Successful requests", f"{summary['completed']}"), ("Failed requests", f"{summary['failed']}"),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", f"{summary['total_input_tokens']}"),
            ("Total generated tokens", f"{summary['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")]
    if "goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['goodput']:.2f}"))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        rows += [(f"{stat.capitalize()} {name} (ms)",
                  f"{summary[key][stat]:.1f}") for stat in STATS]
    width = max(len(k) for k, _ in rows) + 2
    title = f" Serving benchmark: {label} " if label else " Serving benchmark "
    lines = [title.center(width + 12, "=")] + [f"{k:<{width}}{v:>12}" for k, v in rows]
    lines += [f"error: {e}" for e in summary.get("errors", [])]     # why requests failed, if any did
    return "\n".join(lines + ["=" * (width + 12)])
