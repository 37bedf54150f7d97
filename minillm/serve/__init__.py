"""Chapter 8: serving over HTTP. An OpenAI-compatible server over the engine, in these parts:

- `protocol.py`      request bodies checked and mapped to SamplingParams
- `fields.py`        every OpenAI / vLLM field past the basics: honoured or refused with a 400
- `responses.py`     OpenAI's response and chunk shapes, logprobs included
- `streaming.py`     a streamed answer as server-sent events, text and logprobs held back together
- `async_engine.py`  one engine loop per server: commands in, per-request output queues out
- `app.py`           the Starlette routes; nothing slow on the event loop
- `errors.py`        OpenAI error objects, the status of each failure, the catch-all middleware
- `metrics.py`       `GET /metrics` by prometheus_client, vLLM's metric names
- `engine_metrics.py` what the engine keeps itself (SLO controller, speculation, KV tiers, priorities),
                     read at scrape time
- `dashboard.py`     `GET /dashboard`: a live page of /metrics, its files in `static/` (package data)
- `server.py`, `cli.py`  uvicorn in the foreground (`python -m minillm serve`) or in a thread

Chapter 11 adds disaggregated serving (`python -m minillm serve --disaggregated`):
- `kv_link.py`       a prefilled request's KV blocks from one process to another over a gloo pair
- `disagg_worker.py` the prefill worker and the decode worker processes, each with its own engine
- `router.py`        `DisaggregatedEngine`: the engine interface the app uses, over both workers
- `disaggregated.py` `start` / `running`: the router's HTTP server and both workers in one call

    from minillm import LLM
    from minillm.serve import running
    with running(LLM("smollm2-135m")) as srv:          # a free loopback port
        openai.OpenAI(base_url=srv.base_url, api_key="none").chat.completions.create(...)
    srv = start(llm); ...; srv.stop()                  # the same, across notebook cells

`import minillm` does not import this package (Starlette, uvicorn and prometheus_client load only
when you serve).
They come with the `serve` extra (`pip install "minillm[serve]"`); without it this import says so.
"""
try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"minillm.serve needs {e.name}, which comes with the 'serve' extra: "
                              f"pip install \"minillm[serve]\"", name=e.name) from e

from minillm.serve.server import RunningServer, running, serve, start


def build_app(engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
              max_body_bytes: int = 4 * 2**20, allowed_origins=None):
    """The Starlette app over an LLMEngine with a tokenizer (see app.py)."""
    from minillm.serve.app import build_app as _build
    return _build(engine, model_name, api_key, max_pending, max_body_bytes, allowed_origins)


__all__ = ["build_app", "running", "serve", "start", "RunningServer"]
