"""Errors as OpenAI error objects: {"error": {"message", "type", "param", "code"}}, always
ASCII-only JSON (a lone surrogate echoed from a body cannot break the encoding), and the status
and code each failure maps to:

    the engine ended a request: queue timeout  -> 503 "queue_timeout" (its priority class gave up)
                                worker gone     -> 503 "worker_unavailable" (disaggregated serving)
                                anything else   -> 500 "sampling_error" (a token could not be drawn)
    the server is shutting down                 -> 503 "server_shutting_down"
    the engine loop failed                      -> 500 "engine_error"
    the engine is dead (a worker process gone)  -> 503 "engine_dead" (or "worker_unavailable")
    a bug anywhere else                         -> 500 "internal_error", `Connection: close`

`CatchAll` is the outermost ASGI middleware: whatever escapes a handler is logged once and
answered with an OpenAI 500 that closes the connection (the client's next request opens a fresh
one instead of meeting a reset), and a client that left mid-body is no error at all.

Left out on purpose: error codes beyond these, and retry hints other than 503's Retry-After.
"""
import json
import logging

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from minillm.serve.async_engine import EngineDead, ShuttingDown
from minillm.serve.protocol import APIError

log = logging.getLogger("minillm.serve")


class WorkerUnavailable(RuntimeError):
    """A worker process of a disaggregated server (router.py) is gone; the message names it.
    Requests it held end with this message as their error, which starts "worker unavailable"."""


def json_response(data, status: int = 200, headers=None) -> Response:
    return Response(json.dumps(data, ensure_ascii=True, separators=(",", ":")), status,
                    headers, media_type="application/json")


def error_response(err: APIError, headers=None) -> Response:
    return json_response(err.body(), err.status, headers)


def engine_error(message: str) -> APIError:
    """The error a request the engine ended carries: a queue timeout (its priority class gave
    up on it) or a token that could not be drawn."""
    if message.startswith("queue timeout"):
        return APIError(503, message, type="server_error", code="queue_timeout")
    if message.startswith("worker unavailable"):
        return APIError(503, message, type="server_error", code="worker_unavailable")
    return APIError(500, f"sampling failed: {message}", type="server_error", code="sampling_error")


def failure(err: BaseException) -> APIError:
    if isinstance(err, ShuttingDown):
        return APIError(503, str(err), type="server_error", code="server_shutting_down")
    if isinstance(err, WorkerUnavailable):
        return APIError(503, str(err), type="server_error", code="worker_unavailable")
    if isinstance(err, EngineDead):
        code = "worker_unavailable" if str(err).startswith("worker unavailable") else "engine_dead"
        return APIError(503, f"the engine is dead: {err}", type="server_error", code=code)
    return APIError(500, f"the engine failed: {type(err).__name__}: {err}", type="server_error",
                    code="engine_error")


class CatchAll:
    """Outermost ASGI middleware: a server bug becomes an OpenAI 500 with `Connection: close`
    (logged once), and a client that left mid-body is no error at all."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise                               # too late for a status: uvicorn closes
            body = json.dumps(APIError(500, "internal server error", type="server_error",
                                       code="internal_error").body()).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
