"""`GET /dashboard`: a live page of the server's own `/metrics`, served by the server itself.

    GET /dashboard?window_s=300&poll_ms=1000&rate_s=10     the page (HTML)
    GET /dashboard/dashboard.js, /dashboard/dashboard.css  its script and style

The page, its script and its style ship inside the package (minillm/serve/static/, package data
in pyproject.toml); it loads nothing from anywhere else: the charts are plain <canvas> drawn by
dashboard.js, and a Content-Security-Policy forbids every other origin (scripts, styles and
fetches from this server only; no inline script, no frames). The script polls `/metrics` every
`poll_ms`, parses Prometheus' text format, and keeps `window_s` seconds of scrapes:

- numbers: each is one sample of `/metrics` as it was at the last poll (summed over labels other
  than model_name unless the element names one in `data-labels`), in an element with
  `data-metric="<its full Prometheus name>"`; numbers the page derives (rates, percentiles,
  acceptance) carry `data-metric` of their source and `data-derived` saying what was computed;
- charts over the window: requests/s and output tokens/s (counter deltas over `rate_s`),
  TTFT / TPOT / ITL P50, P95, P99 (from the histograms' bucket deltas over `rate_s`, linear
  inside the bucket, as Prometheus' `histogram_quantile`: a percentile resolves only to its
  bucket), running and waiting (per priority when the server has priorities), KV blocks used /
  cached / free and the host tier's, preemptions / rejections / queue timeouts, speculative
  acceptance, and the SLO controller's token budget.

Query parameters, each optional (a number in its range; anything else, or any other name, is a
400 OpenAI error naming `param`): `window_s` 10..3600 (default 300), `poll_ms` 200..60000
(default 1000), `rate_s` 1..600 (default 10). The route follows `/metrics`' rule: no API key
(the page shows what `/metrics` shows to anyone who can reach the port; put a proxy in front to
restrict both).

Left out on purpose: alerts, saved boards, several servers on one page (Grafana over
Prometheus does those), and any chart library (one would be a dependency to vendor and audit).
"""
import functools
from importlib import resources

from starlette.responses import Response

from minillm.serve.errors import error_response
from minillm.serve.protocol import APIError

PARAMS = {"window_s": (10, 3600, 300), "poll_ms": (200, 60000, 1000), "rate_s": (1, 600, 10)}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_TYPES = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}


@functools.cache
def asset(name: str) -> str:
    """One file of the page, from the installed package (minillm/serve/static/)."""
    return resources.files("minillm.serve").joinpath("static", name).read_text(encoding="utf-8")


def page_options(query) -> dict:
    """The page's query parameters -> {name: number}; raises APIError 400 naming the param."""
    out = {name: default for name, (_, _, default) in PARAMS.items()}
    seen = set()
    for name, raw in query.multi_items():
        if name not in PARAMS:
            raise APIError(400, f"unknown query parameter {ascii(name)}; /dashboard takes "
                                f"{', '.join(PARAMS)}", param=name)
        lo, hi, _ = PARAMS[name]
        if name in seen:
            raise APIError(400, f"{name} is given more than once", param=name)
        seen.add(name)
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not lo <= value <= hi:                      # NaN fails too
            raise APIError(400, f"{name} must be a number from {lo} to {hi}, got {ascii(raw)}",
                           param=name)
        out[name] = int(value) if value.is_integer() else value
    return out


async def dashboard(request):
    try:
        options = page_options(request.query_params)
    except APIError as err:
        return error_response(err)
    html = asset("dashboard.html")
    for name, value in options.items():
        html = html.replace("{{" + name + "}}", str(value))
    return Response(html, media_type="text/html; charset=utf-8", headers=_HEADERS)


def static(name: str):
    """The route of one of the page's files."""
    async def handler(request):
        return Response(asset(name), media_type=_TYPES[name], headers=_HEADERS)
    return handler
