"""`GET /dashboard`: a live page of the server's own `/metrics`, served by the server itself.

    GET /dashboard?window_s=300&poll_ms=1000&rate_s=10     the page (HTML)
    GET /dashboard/dashboard.js, /dashboard/dashboard.css  its script and style

The page, script and style ship in the package (minillm/serve/static/) and load nothing from
elsewhere: plain <canvas> charts, and a Content-Security-Policy that allows this server only.
The script polls `/metrics` every `poll_ms`, keeps `window_s` seconds of scrapes, and shows each
number in an element with `data-metric="<its Prometheus name>"` (derived ones add `data-derived`),
and charts of rates and TTFT / TPOT / ITL percentiles over `rate_s` (resolved to their histogram
bucket, as `histogram_quantile`), queues, KV blocks, refusals, acceptance and the SLO budget.

Query parameters, each optional (anything else is a 400 naming `param`): `window_s` 10..3600
(default 300), `poll_ms` 200..60000 (default 1000), `rate_s` 1..600 (default 10). Like
`/metrics` it takes no API key.

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
