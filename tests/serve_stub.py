"""A tiny OpenAI-protocol stub server for the load generator's tests: it streams known chunks.

The chat answer is CHUNKS (one of them a multi-byte character sent split across two writes),
then a usage-only chunk with empty choices, then `data: [DONE]`. A prompt "FAIL" gets HTTP 500;
"BREAK" gets a stream that stops after one chunk without [DONE] or usage. The stub counts
requests in flight (`peak` is the most at once) and keeps every request body.
"""
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

CHUNKS = ["Hello", ",", " caf", "\u00e9", " \u4e16\u754c", "!"]
USAGE = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


class Stub:
    def __init__(self, delay_s: float = 0.01):
        self.delay_s, self.in_flight, self.peak, self.bodies = delay_s, 0, 0, []

    async def stream(self, body, chat: bool):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            for i, text in enumerate(CHUNKS):
                await asyncio.sleep(self.delay_s)
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                data = _event({"object": "chunk", "choices": [choice]})
                if "\u00e9" in text:                # cut inside the two bytes of the character
                    cut = data.index("\u00e9".encode()) + 1
                    yield data[:cut]
                    await asyncio.sleep(self.delay_s)
                    data = data[cut:]
                yield data
                if prompt == "BREAK" and i == 0:
                    return
            yield b": a keep-alive comment\n\n"
            yield _event({"object": "chunk", "choices": [], "usage": USAGE})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def endpoint(chat: bool):
            async def handler(request):
                body = await request.json()
                self.bodies.append(body)
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                if prompt == "FAIL":
                    return JSONResponse({"error": {"message": "boom"}}, status_code=500)
                return StreamingResponse(self.stream(body, chat), media_type="text/event-stream")
            return handler
        return Starlette(routes=[Route("/v1/chat/completions", endpoint(True), methods=["POST"]),
                                 Route("/v1/completions", endpoint(False), methods=["POST"])])


@contextmanager
def running_stub(delay_s: float = 0.01):
    """(stub, base_url) with uvicorn serving it on a free loopback port in a thread."""
    import uvicorn
    stub = Stub(delay_s)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stub.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield stub, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
