"""Running the app: in the foreground (`python -m minillm serve`) or in a background thread
(`running(llm)`, for notebooks and tests), always on uvicorn.

    with running(llm) as srv:                 # a free loopback port, stopped on exit
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")

`serve(app, host, port)` runs until SIGINT or SIGTERM; uvicorn then stops accepting and lets
in-flight requests finish for `graceful_s` seconds. Shortly before that time is up (`drain_s`),
the requests still running are ended by the app (`AsyncEngine.end_streams`): a stream gets an
error event and `data: [DONE]`, a whole answer a 503, instead of a cut connection; then the
lifespan stops the engine loop, and the port is freed on exit.

Left out on purpose: several worker processes (one engine per server), TLS, unix sockets.
"""
import asyncio
import contextlib
import socket
import threading
import time

LOOPBACK = "127.0.0.1"


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _config(app, graceful_s: float, log_level: str):
    import uvicorn
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_s,
                          access_log=False, lifespan="on")


def drain_s(graceful_s: float) -> float:
    """When, after the stop began, the app ends what still runs: a second (or half the grace
    time, if shorter) before uvicorn would cancel the handlers mid-write."""
    return max(0.0, graceful_s - min(1.0, graceful_s / 2))


def _draining_server(config, app, foreground: bool):
    """uvicorn's Server that ends the app's requests still in flight `drain_s` into its graceful
    shutdown. In the foreground a SIGINT / SIGTERM that stopped it ends the process with status
    0 (uvicorn would raise the signal again after its graceful shutdown)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if foreground:
                getattr(self, "_captured_signals", []).clear()     # the stop was asked for

        async def shutdown(self, sockets=None):
            ender = asyncio.ensure_future(self._end_streams_later())
            try:
                await super().shutdown(sockets)
            finally:
                ender.cancel()

        async def _end_streams_later(self):
            await asyncio.sleep(drain_s(self.config.timeout_graceful_shutdown or 0.0))
            state = getattr(app.state, "server", None)
            if state is not None:
                state.loop.end_streams()
    return Draining(config)


def serve(app, host: str = LOOPBACK, port: int = 8000, graceful_s: float = 5.0,
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve in the foreground until SIGINT / SIGTERM (uvicorn installs the handlers). Port 0
    picks a free one; the line "serving on URL" says which (the next line: the live dashboard's
    URL). `sock`: a socket already bound to host:port (the CLI binds before it loads the model),
    used instead of binding here."""
    sock = sock if sock is not None else _socket(host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    print(f"serving on {url}/v1", flush=True)
    print(f"dashboard: {url}/dashboard", flush=True)          # a live page of /metrics (dashboard.py)
    try:
        _draining_server(_config(app, graceful_s, log_level), app, True).run(sockets=[sock])
    finally:
        sock.close()


class RunningServer:
    """A server in a background thread: `url`, `base_url` (url + "/v1"), `stop()`."""

    def __init__(self, app, host: str, port: int, graceful_s: float, log_level: str):
        self.app = app
        self._sock = _socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        self.base_url = self.url + "/v1"
        self._server = _draining_server(_config(app, graceful_s, log_level), app, False)
        self._server.install_signal_handlers = lambda: None     # not the main thread
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"minillm-serve-{self.port}", daemon=True)

    @property
    def server(self):
        """The app's state: engine loop, metrics (`minillm.serve.app.Server`)."""
        return self.app.state.server

    def start(self, timeout_s: float = 30.0) -> "RunningServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()


def start(llm, host: str = LOOPBACK, port: int | None = None, served_model_name: str | None = None,
          api_key: str | None = None, max_pending: int = 256, graceful_s: float = 2.0,
          log_level: str = "warning", allowed_origins=None) -> RunningServer:
    """Serve an `LLM` (or an `LLMEngine` with a tokenizer) in a background thread until
    `.stop()`; port None picks a free one. The name clients send is `served_model_name`, else
    the name the LLM was loaded by ("smollm2-135m"), else the model config's name."""
    from minillm.serve.app import build_app
    engine = getattr(llm, "llm_engine", llm)
    name = served_model_name or getattr(llm, "model_name", None) or engine.model.config.name
    app = build_app(engine, name, api_key, max_pending, allowed_origins=allowed_origins)
    return RunningServer(app, host, port or 0,
                         graceful_s, log_level).start()


@contextlib.contextmanager
def running(llm, **options):
    """`start(llm, **options)` as a context manager: the server stops when the block ends."""
    srv = start(llm, **options)
    try:
        yield srv
    finally:
        srv.stop()
