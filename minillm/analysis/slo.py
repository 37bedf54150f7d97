"""Chapter 11: latency targets (SLOs), attainment and goodput, DistServe's metric.

A request meets its service-level objective when both its time to first token (TTFT) and its
mean inter-token latency (TPOT: the gaps after the first token, averaged over the request, as
DistServe and vLLM's benchmark define it) are within the targets. Then

    attainment = requests that meet the SLO / all requests
    goodput    = requests that meet the SLO / seconds of the run

Throughput counts every finished request; goodput only the ones a user was happy with, so a
layout can raise throughput and lower goodput at once (DistServe's point). DistServe's headline
form, the largest request rate at which at least 90% of requests meet the SLO, is
`disagg_scale.max_rate`.

A result is anything with `ttft` (seconds) and `itls` (seconds between consecutive tokens): the
simulator's `SimResult` or a dict with those keys. A request with one output token has no gaps
and meets any TPOT target.

Left out on purpose: per-percentile SLOs (P90 TTFT and P90 TPOT apart, as DistServe also
plots), end-to-end targets, and weighting requests by their length.
"""
import math

from minillm._validate import check_real


def percentile(values, p: float) -> float:
    """The p-th percentile (0..100), linear between order statistics (numpy's default); nan for
    no values."""
    check_real("p", p, 0, 100)
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_percentiles(values, ps=(50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of `values` (seconds stay seconds)."""
    values = [float(v) for v in values]
    out = {f"p{p:g}": percentile(values, p) for p in ps}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


def _get(result, name: str):
    return result[name] if isinstance(result, dict) else getattr(result, name)


def tpot(result) -> float:
    """Mean gap between a request's tokens after the first (0 with one token)."""
    itls = _get(result, "itls")
    return sum(itls) / len(itls) if itls else 0.0


def meets_slo(result, ttft_s: float, itl_s: float) -> bool:
    """TTFT <= ttft_s and mean ITL (TPOT) <= itl_s."""
    return _get(result, "ttft") <= ttft_s and tpot(result) <= itl_s


def _check_slo(ttft_s, itl_s) -> None:
    check_real("ttft_s", ttft_s, 0, low_open=True)
    check_real("itl_s", itl_s, 0, low_open=True)


def slo_attainment(results, ttft_s: float, itl_s: float) -> float:
    """Fraction of `results` that meet both targets (ValueError on an empty list)."""
    _check_slo(ttft_s, itl_s)
    results = list(results)
    if not results:
        raise ValueError("results must hold at least one request")
    return sum(meets_slo(r, ttft_s, itl_s) for r in results) / len(results)


def goodput(results, ttft_s: float, itl_s: float, duration_s: float) -> float:
    """Requests per second that met both targets over a run of `duration_s` seconds."""
    _check_slo(ttft_s, itl_s)
    check_real("duration_s", duration_s, 0, low_open=True)
    return sum(meets_slo(r, ttft_s, itl_s) for r in results) / duration_s


def summarize(results, ttft_s: float, itl_s: float, duration_s: float) -> dict:
    """TTFT and ITL percentiles (ms), TPOT percentiles (ms), attainment and goodput, for tables."""
    results = list(results)
    ms = lambda d: {k: round(1e3 * v, 2) if math.isfinite(v) else None for k, v in d.items()}  # noqa: E731
    return {"requests": len(results),
            "ttft_ms": ms(latency_percentiles([_get(r, "ttft") for r in results])),
            "itl_ms": ms(latency_percentiles([g for r in results for g in _get(r, "itls")])),
            "tpot_ms": ms(latency_percentiles([tpot(r) for r in results])),
            "attainment": round(slo_attainment(results, ttft_s, itl_s), 4),
            "goodput": round(goodput(results, ttft_s, itl_s, duration_s), 4),
            "throughput": round(len(results) / duration_s, 4)}
