"""The HTTP routes: an OpenAI-compatible API over one `AsyncEngine`, as a Starlette app.

    GET  /health                 200 "ok" while the engine can step, 503 once it cannot
    GET  /v1/models              the one served model, OpenAI's list shape
    POST /v1/completions         prompt -> text (OpenAI's legacy completions)
    POST /v1/chat/completions    messages -> the chat template -> the assistant's turn
    GET  /metrics, /dashboard    Prometheus text (metrics.py), its live page (dashboard.py)

A streamed answer is server-sent events (streaming.py) with exactly the non-streamed text.
Nothing slow runs on the event loop: parsing and tokenizing run in one worker thread
(`Server.parser`, keeping request order), grammars compile in another (`Server.grammars`: the
engine then finds them in structured.py's cache), the engine step in a third (async_engine.py).
Refusals are OpenAI error objects with ASCII-only JSON, never a bare 500: 400, 401, 404, 405,
413, 415 (non-JSON bodies), 503 (`max_pending` reached, a queue timeout, shutdown, a dead engine)
and 500 "sampling_error" for a token that cannot be drawn; `CatchAll` (errors.py) answers the rest.
`/metrics` and `/dashboard` take no API key; CORS is off unless `allowed_origins` lists origins.

Left out on purpose: TLS (put a proxy in front), per-user rate limits, the /tokenize,
/embeddings and responses APIs.
"""
import asyncio
import contextlib
import hmac
import json
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from minillm.serve import protocol, responses
from minillm.engine.structured import GrammarState
from minillm.serve.async_engine import AsyncEngine, EngineDead, QueueFull, ShuttingDown
from minillm.serve.dashboard import dashboard, static
from minillm.serve.errors import CatchAll, engine_error, error_response, failure, json_response
from minillm.serve.metrics import ServerMetrics
from minillm.serve.protocol import APIError
from minillm.serve.streaming import DONE, StreamWriter, sse
BIG_ANSWER_TOKENS = 2048            # answers past this many tokens are serialized off the loop


def _is_json(content_type: str) -> bool:
    """application/json or application/*+json, parameters allowed (FastAPI's rule)."""
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for: its vocabulary string's length (byte-level
    BPE writes each byte as one character, and a character takes at least one byte)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    return max(map(len, vocab()), default=0) or None if vocab else None


class Server:
    """The app's state: engine loop, metrics and options (`app.state.server`)."""

    def __init__(self, engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
                 max_body_bytes: int = 4 * 2**20):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(model_name, engine)
        self.loop = AsyncEngine(engine, self.metrics, max_pending)
        self.metrics.loop = self.loop
        self.tokens = responses.TokenText(engine.tokenizer)
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-parse")
        self.grammars = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-grammar")
        cfg = engine.model.config
        self.limits = dict(context=cfg.max_seq_len, vocab_size=cfg.vocab_size,
                           pool_tokens=engine.num_blocks * engine.config.block_size,
                           max_n=engine.config.max_num_seqs,
                           max_token_chars=max_token_chars(engine.tokenizer))

    def check_key(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(self, request) -> bytes:
        ctype = request.headers.get("content-type")
        if ctype is not None and not _is_json(ctype):
            raise APIError(415, f"the body must be JSON (Content-Type: application/json), got "
                                f"Content-Type {ascii(ctype)}", code="unsupported_media_type")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise APIError(413, f"the body is {size} bytes; at most {self.max_body_bytes} are accepted")
        chunks, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > self.max_body_bytes:
                raise APIError(413, f"the body exceeds {self.max_body_bytes} bytes")
            chunks.append(part)
        return b"".join(chunks)

    def parse(self, raw: bytes, kind: str) -> protocol.GenRequest:
        """The body's JSON -> GenRequest (runs in the parser thread)."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}") from None
        try:
            return protocol.parse_request(body, kind, self.model_name, self.engine.tokenizer,
                                          **self.limits)
        except RecursionError:
            raise APIError(400, "the request is nested too deeply") from None
        except (TypeError, ValueError) as err:                 # the tokenizer's own checks
            raise APIError(400, str(err)) from None


    def compile_grammar(self, req: protocol.GenRequest) -> None:
        """Compile (or find cached) the request's grammar, in the grammar thread: the engine's
        `add_request` on the event loop then only copies it. A grammar that does not compile, or
        whose language is found empty, is a 400 naming its field."""
        try:
            GrammarState.start(req.params.structured_outputs, self.engine.tokenizer,
                               self.limits["vocab_size"])
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), req.structured_param) from None


def _server(request) -> Server:
    return request.app.state.server


async def health(request):
    loop = _server(request).loop
    if loop._task is None or loop._task.done():
        return PlainTextResponse("engine loop not running", status_code=503)
    if loop.dead is not None:
        return PlainTextResponse(f"engine dead: {loop.dead}", status_code=503)
    return PlainTextResponse("ok")


async def models(request):
    s = _server(request)
    try:
        s.check_key(request)
    except APIError as err:
        return error_response(err)
    return json_response({"object": "list", "data": [
        {"id": s.model_name, "object": "model", "created": 0, "owned_by": "minillm",
         "max_model_len": s.limits["context"]}]})


async def metrics(request):
    s = _server(request)
    body, media_type = s.metrics.render()
    return Response(body, media_type=media_type)


def _endpoint(kind: str):
    async def handler(request):
        s, req = _server(request), None
        try:
            s.check_key(request)
            raw = await s.read_body(request)
            req = await asyncio.get_running_loop().run_in_executor(s.parser, s.parse, raw, kind)
            if req.params.structured_outputs is not None:
                await asyncio.get_running_loop().run_in_executor(s.grammars, s.compile_grammar, req)
            stream = await s.loop.submit(req.prompt_token_ids, req.params, req.priority)
        except APIError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=499)          # gone mid-body: nobody to answer
        except QueueFull as err:
            s.metrics.rejected()
            return error_response(APIError(503, f"the server is overloaded: {err}; retry later",
                                   type="server_error", code="overloaded"), {"Retry-After": "1"})
        except (ShuttingDown, EngineDead) as err:
            return error_response(failure(err))
        except (TypeError, ValueError) as err:              # the engine's own checks
            return error_response(APIError(400, str(err), _param(err, req)))
        rid = responses.new_id(kind)
        if req.stream:
            return StreamingResponse(_events(s, req, rid, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, s, req, rid, stream)
    return handler


def _param(err: Exception, req: protocol.GenRequest | None) -> str | None:
    """The body field an engine's refusal is about: a SamplingParamError's field by the body's
    name for it (echo asked for the prompt's logprobs), or the field of a grammar's error."""
    field = getattr(err, "field", None)
    if req is None:
        return None
    if field == "prompt_logprobs" and req.echo is not None and not req.show_prompt_logprobs:
        return "echo"
    if field is not None:
        return protocol.HTTP_NAMES[req.kind].get(field, field)
    return req.structured_param if str(err).startswith("structured_outputs") else None


async def _whole(request, s, req, rid, stream):
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
        return Response(status_code=499)                    # nobody is listening
    if answer.exception() is not None:
        return error_response(failure(answer.exception()))
    out = answer.result()
    if getattr(out, "error", None):
        return error_response(engine_error(out.error))
    size = sum(len(c.token_ids) for c in out.outputs) + (len(out.prompt_token_ids) if req.echo else 0)
    if size <= BIG_ANSWER_TOKENS:
        return json_response(responses.response(req, rid, out, s.tokens))
    data = await asyncio.to_thread(lambda: json.dumps(responses.response(req, rid, out, s.tokens),
                                                      ensure_ascii=True, separators=(",", ":")))
    return Response(data, media_type="application/json")


async def _disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(s, req, rid, stream):
    """The SSE body of a streamed request: chunks, then an error event or the usage chunk, then
    [DONE] always (also when the engine fails or the server shuts down mid-stream); aborts the
    request if the client leaves."""
    writer, out = StreamWriter(req, rid, s.tokens), None
    try:
        try:
            async for out in stream:
                if getattr(out, "error", None):
                    break                        # refused or failed: the error event follows
                for event in writer.events(out):
                    yield event
        except Exception as err:                 # ShuttingDown, or the engine loop failed
            yield sse(failure(err).body())
        else:
            if getattr(out, "error", None):
                yield sse(engine_error(out.error).body())
            elif req.include_usage and out is not None:
                yield sse(responses.usage_chunk(req, rid, sum(len(c.token_ids) for c in out.outputs)))
        yield DONE
    finally:
        stream.abort()                         # a no-op once finished; frees blocks if not


async def _http_error(request, exc: HTTPException):
    return error_response(APIError(exc.status_code, exc.detail or "error", type="invalid_request_error"),
                  getattr(exc, "headers", None))


def build_app(engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
              max_body_bytes: int = 4 * 2**20, allowed_origins=None) -> Starlette:
    """The ASGI app over an LLMEngine that has a tokenizer (`LLM(...).llm_engine`).
    `allowed_origins`: origins a browser may call from (CORS); None or [] keeps CORS off."""
    if engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer (chat templates, text)")
    server = Server(engine, model_name, api_key, max_pending, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.loop.start()
        yield
        await server.loop.stop()
        server.parser.shutdown(wait=False, cancel_futures=True)
        server.grammars.shutdown(wait=False, cancel_futures=True)

    middleware = [Middleware(CatchAll)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["*"], allow_headers=["*"]))
    app = Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/dashboard", dashboard), Route("/dashboard/dashboard.js", static("dashboard.js")),
        Route("/dashboard/dashboard.css", static("dashboard.css")),
        Route("/v1/completions", _endpoint("completion"), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("chat"), methods=["POST"])],
        exception_handlers={HTTPException: _http_error}, middleware=middleware, lifespan=lifespan)
    app.state.server = server
    return app
