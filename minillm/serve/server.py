"""Running the app: in the foreground (`python -m minillm serve`) or in a background thread
(`running(llm)`, for notebooks and tests), always on uvicorn.

    with running(llm) as srv:                 # a free loopback port, stopped on exit
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")

`serve(app, host, port)` runs until SIGINT or SIGTERM; uvicorn then stops accepting, lets
in-flight requests finish for `graceful_s` seconds, cancels the rest (their streams' cleanup
aborts them in the engine) and the lifespan stops the engine loop; the port is freed on exit.

Left out on purpose: several worker processes (one engine per server), TLS, unix sockets.
"""
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


def _foreground_server(config):
    """uvicorn's Server, except that a SIGINT / SIGTERM that stopped it ends the process with
    status 0: uvicorn would raise the signal again after its graceful shutdown."""
    import uvicorn

    class Foreground(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()     # the stop was asked for
    return Foreground(config)


def serve(app, host: str = LOOPBACK, port: int = 8000, graceful_s: float = 5.0,
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Serve in the foreground until SIGINT / SIGTERM (uvicorn installs the handlers). Port 0
    picks a free one; the line "serving on URL" says which. `sock`: a socket already bound to
    host:port (the CLI binds before it loads the model), used instead of binding here."""
    sock = sock if sock is not None else _socket(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving on http://{shown}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        _foreground_server(_config(app, graceful_s, log_level)).run(sockets=[sock])
    finally:
        sock.close()


class RunningServer:
    """A server in a background thread: `url`, `base_url` (url + "/v1"), `stop()`."""

    def __init__(self, app, host: str, port: int, graceful_s: float, log_level: str):
        import uvicorn
        self.app = app
        self._sock = _socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        self.base_url = self.url + "/v1"
        self._server = uvicorn.Server(_config(app, graceful_s, log_level))
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
          log_level: str = "warning") -> RunningServer:
    """Serve an `LLM` (or an `LLMEngine` with a tokenizer) in a background thread until
    `.stop()`; port None picks a free one. The name clients send is `served_model_name`, else
    the name the LLM was loaded by ("smollm2-135m"), else the model config's name."""
    from minillm.serve.app import build_app
    engine = getattr(llm, "llm_engine", llm)
    name = served_model_name or getattr(llm, "model_name", None) or engine.model.config.name
    return RunningServer(build_app(engine, name, api_key, max_pending), host, port or 0,
                         graceful_s, log_level).start()


@contextlib.contextmanager
def running(llm, **options):
    """`start(llm, **options)` as a context manager: the server stops when the block ends."""
    srv = start(llm, **options)
    try:
        yield srv
    finally:
        srv.stop()
