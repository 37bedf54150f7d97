"""The HTTP routes: an OpenAI-compatible API over one `AsyncEngine`, as a Starlette app.

    GET  /health                 200 "ok" once the engine loop runs
    GET  /v1/models              the one served model, OpenAI's list shape
    POST /v1/completions         prompt -> text (OpenAI's legacy completions)
    POST /v1/chat/completions    messages -> the chat template -> the assistant's turn
    GET  /metrics                Prometheus text (metrics.py)

A streamed answer is server-sent events: one `data: {json}` line per chunk of new text, a last
chunk per completion with its `finish_reason`, the `usage` chunk when `stream_options.
include_usage` is set, then `data: [DONE]`. The text of a stream is exactly the non-streamed
text: the detokenizer already holds back an incomplete UTF-8 character, and with stop strings the
stream also holds back the last len(stop) - 1 characters until the request ends, since those may
turn out to be the start of a stop string that is cut.

Refusals are OpenAI error objects, never a 500: 400 bad field (protocol.py), 401 wrong or missing
key (compared in constant time), 404 unknown model or route, 405 wrong method, 413 body too
large, 503 when `max_pending` requests are already pending (with Retry-After), or when a
request's priority class refuses it after its queue-wait bound.

Left out on purpose: TLS (put a proxy in front), CORS, per-user rate limits, the /tokenize,
/embeddings and responses APIs.
"""
import asyncio
import contextlib
import hmac
import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from minillm.serve import protocol
from minillm.serve.async_engine import AsyncEngine, QueueFull
from minillm.serve.metrics import ServerMetrics
from minillm.serve.protocol import APIError


def _error(err: APIError, headers=None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
    """The app's state: engine loop, metrics and options (`app.state.server`)."""

    def __init__(self, engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
                 max_body_bytes: int = 4 * 2**20):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(model_name)
        self.loop = AsyncEngine(engine, self.metrics, max_pending)
        cfg = engine.model.config
        self.limits = dict(context=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                           pool_tokens=engine.num_blocks * engine.config.block_size,
                           max_n=engine.config.max_num_seqs)

    def check_key(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    async def read_json(self, request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise APIError(413, f"the body is {size} bytes; at most {self.max_body_bytes} are accepted")
        chunks, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > self.max_body_bytes:
                raise APIError(413, f"the body exceeds {self.max_body_bytes} bytes")
            chunks.append(part)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}") from None


def _server(request) -> Server:
    return request.app.state.server


async def health(request):
    task = _server(request).loop._task
    ok = task is not None and not task.done()
    return PlainTextResponse("ok" if ok else "engine loop not running", status_code=200 if ok else 503)


async def models(request):
    s = _server(request)
    try:
        s.check_key(request)
    except APIError as err:
        return _error(err)
    return JSONResponse({"object": "list", "data": [
        {"id": s.model_name, "object": "model", "created": 0, "owned_by": "minillm",
         "max_model_len": s.limits["context"]}]})


async def metrics(request):
    s = _server(request)
    return PlainTextResponse(s.metrics.render(s.engine, s.loop.num_pending),
                             media_type="text/plain; version=0.0.4")


def _endpoint(kind: str):
    async def handler(request):
        s = _server(request)
        try:
            s.check_key(request)
            body = await s.read_json(request)
            req = protocol.parse_request(body, kind, s.model_name, s.engine.tokenizer, **s.limits)
            stream = await s.loop.submit(req.prompt_token_ids, req.params, req.priority)
        except APIError as err:
            return _error(err)
        except QueueFull as err:
            s.metrics.add("request_rejected_total")
            return _error(APIError(503, f"the server is overloaded: {err}; retry later",
                                   type="server_error", code="overloaded"), {"Retry-After": "1"})
        except (TypeError, ValueError) as err:              # the engine's own checks
            return _error(APIError(400, str(err)))
        rid = protocol.new_id(kind)
        if req.stream:
            return StreamingResponse(_events(req, rid, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, req, rid, stream)
    return handler


async def _whole(request, req, rid, stream):
    """Wait for the whole answer, aborting the request if the client leaves first."""
    async def last():
        out = None
        async for out in stream:
            pass
        return out
    answer = asyncio.ensure_future(last())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
            stream.abort()
    if not answer.done() or answer.cancelled():
        return PlainTextResponse("", status_code=499)         # nobody is listening
    try:
        out = answer.result()
    except Exception as err:
        return _error(APIError(500, f"the engine failed: {err}", type="server_error"))
    if getattr(out, "error", None):
        return _error(APIError(503, out.error, type="server_error", code="queue_timeout"))
    texts = [c.text or "" for c in out.outputs]
    reasons = [c.finish_reason for c in out.outputs]
    return JSONResponse(protocol.response(req, rid, texts, reasons,
                                          sum(len(c.token_ids) for c in out.outputs)))


async def _disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def holdback(stop) -> int:
    """Characters a stream keeps back while a stop string might still be forming."""
    return max(map(len, stop)) - 1 if stop else 0


def _choice_events(req, rid, c, sent: dict, ended: set, keep: int) -> list[str]:
    """Events for one completion's new state: the role (chat, once), new text, the finish."""
    if c.index in ended:
        return []
    events, done, text = [], c.finish_reason is not None, c.text or ""
    if c.index not in sent:
        sent[c.index] = 0
        if req.kind == "chat":
            events.append(_sse(protocol.chunk(req, rid, c.index, None, first=True)))
    upto = len(text) if done else max(sent[c.index], len(text) - keep)
    if upto > sent[c.index]:
        events.append(_sse(protocol.chunk(req, rid, c.index, text[sent[c.index]:upto])))
        sent[c.index] = upto
    if done:
        events.append(_sse(protocol.chunk(req, rid, c.index, None, c.finish_reason)))
        ended.add(c.index)
    return events


async def _events(req, rid, stream):
    """The SSE body of a streamed request; aborts the request if the client leaves."""
    keep = holdback(req.params.stop)
    sent, ended, out = {}, set(), None
    try:
        try:
            async for out in stream:
                for c in out.outputs:
                    for event in _choice_events(req, rid, c, sent, ended, keep):
                        yield event
        except Exception as err:
            yield _sse(APIError(500, f"the engine failed: {err}", type="server_error").body())
        else:
            if getattr(out, "error", None):
                yield _sse(APIError(503, out.error, type="server_error", code="queue_timeout").body())
            elif req.include_usage and out is not None:
                yield _sse(protocol.usage_chunk(req, rid, sum(len(c.token_ids) for c in out.outputs)))
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()                         # a no-op once finished; frees blocks if not


async def _http_error(request, exc: HTTPException):
    return _error(APIError(exc.status_code, exc.detail or "error", type="invalid_request_error"))


def build_app(engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
              max_body_bytes: int = 4 * 2**20) -> Starlette:
    """The ASGI app over an LLMEngine that has a tokenizer (`LLM(...).llm_engine`)."""
    if engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer (chat templates, text)")
    server = Server(engine, model_name, api_key, max_pending, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.loop.start()
        yield
        await server.loop.stop()

    app = Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/completions", _endpoint("completion"), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("chat"), methods=["POST"])],
        exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.server = server
    return app
