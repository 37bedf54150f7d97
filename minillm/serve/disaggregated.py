"""Disaggregated serving in one call: a router speaking OpenAI's API in front of a prefill process
and a decode process (chapter 11; `python -m minillm serve --disaggregated`).

    with running(model, tokenizer, threads_per_engine=1) as srv:      # a free loopback port
        openai.OpenAI(base_url=srv.base_url, api_key="none").chat.completions.create(...)
        srv.engine.transfers[request_id]          # {bytes, blocks, header_bytes, seconds}
    srv = start(model, tokenizer, port=8000); ...; srv.stop()      # stops the server, then both workers

The app is chapter 8's (`build_app`) over a `DisaggregatedEngine` (router.py) instead of an
`LLMEngine`: streaming, errors and metrics are the same code. Each engine process gets
`threads_per_engine` torch threads; on a 2-core machine, 1 each gives every engine a core of
its own, which is the point of disaggregating: a long prompt's prefill never stalls the decodes.
The port is checked before any process starts (`check_port`): a port in use is a ValueError
naming `port`.

Left out on purpose: more than one prefill or decode worker, and running the workers on other
machines (vLLM's `--kv-transfer-config`; the link here rendezvouses on 127.0.0.1).
"""
import contextlib
import errno
import socket

from minillm.engine.config import EngineConfig
from minillm.serve.router import DisaggregatedEngine
from minillm.serve.server import LOOPBACK, RunningServer


def check_port(host: str, port: int) -> None:
    """ValueError naming `port` if host:port cannot be bound now (in use, or not an int in
    [0, 65535]); port 0 (any free port) always passes."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            why = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be bound: {err.strerror}"
            raise ValueError(f"port {port} on {host} {why}; pass another port (or port=None for "
                             f"a free one)") from None


class DisaggregatedServer:
    """A running disaggregated server: `url`, `base_url`, `engine` (the router), `pids`, `stop()`."""

    def __init__(self, engine: DisaggregatedEngine, server: RunningServer):
        self.engine, self.server = engine, server
        self.url, self.base_url, self.port = server.url, server.base_url, server.port

    @property
    def pids(self) -> dict[str, int]:
        return self.engine.pids

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the HTTP server (in-flight requests end cleanly), then both workers. Idempotent."""
        try:
            self.server.stop(timeout_s)
        finally:
            self.engine.shutdown()


def start(model, tokenizer, threads_per_engine: int = 1, port: int | None = None,
          host: str = LOOPBACK, served_model_name: str | None = None, api_key: str | None = None,
          max_pending: int = 256, graceful_s: float = 2.0, log_level: str = "warning",
          config: EngineConfig | None = None, **engine_options) -> DisaggregatedServer:
    """Start the prefill and decode processes and the router's HTTP server in a thread.
    `config` or `engine_options` (EngineConfig fields) configure both engines alike."""
    from minillm.serve.app import build_app
    check_port(host, 0 if port is None else port)
    if tokenizer is None:
        raise ValueError("tokenizer must be given: the server needs one (chat templates, text)")
    if config is not None and engine_options:
        raise ValueError(f"pass config or engine options, not both (got {sorted(engine_options)})")
    config = config or EngineConfig(**engine_options)
    engine = DisaggregatedEngine(model, tokenizer, config, threads_per_engine)
    try:
        name = served_model_name or model.config.name
        app = build_app(engine, name, api_key, max_pending)
        server = RunningServer(app, host, port or 0, graceful_s, log_level).start()
    except BaseException:
        engine.shutdown()
        raise
    return DisaggregatedServer(engine, server)


@contextlib.contextmanager
def running(model, tokenizer, **options):
    """`start(model, tokenizer, **options)` as a context manager: all of it stops when the block ends."""
    srv = start(model, tokenizer, **options)
    try:
        yield srv
    finally:
        srv.stop()
