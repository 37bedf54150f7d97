"""Chapter 8: serving over HTTP. An OpenAI-compatible server over the engine, in these parts:
`protocol.py` and `fields.py` (bodies checked, mapped to SamplingParams or refused with a 400),
`responses.py` and `streaming.py` (OpenAI's shapes, server-sent events), `async_engine.py` (one
engine loop per server), `app.py` (the Starlette routes), `errors.py` (OpenAI error objects),
`metrics.py` and `engine_metrics.py` (`GET /metrics`, vLLM's names), `dashboard.py` (a live
page of /metrics), `server.py` and `cli.py` (uvicorn in the foreground or in a thread).
Chapter 11 adds disaggregated serving (`python -m minillm serve --disaggregated`): `kv_link.py`,
`disagg_worker.py`, `router.py` (`DisaggregatedEngine`) and `disaggregated.py`.

    from minillm import LLM
    from minillm.serve import running
    with running(LLM("smollm2-135m")) as srv:          # a free loopback port
        openai.OpenAI(base_url=srv.base_url, api_key="none").chat.completions.create(...)
    srv = start(llm); ...; srv.stop()                  # the same, across notebook cells

`import minillm` does not import this package: Starlette, uvicorn and prometheus_client come with
the `serve` extra (`pip install "minillm[serve]"`), and without it this import says so.
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
