"""The router of disaggregated serving: one engine-shaped object in front of two engine processes.

    DisaggregatedEngine.add_request -> prefill worker -> (KV link) -> decode worker
    DisaggregatedEngine.step()      <- first token (prefill) + later tokens (decode)

`DisaggregatedEngine` has the part of `LLMEngine`'s interface the server's loop uses
(`add_request`, `step`, `abort_request`, `has_unfinished_requests`, `tokenizer`, `model`,
`config`, `num_blocks`, `scheduler` / `block_manager` views), so `build_app` serves it
unchanged. Requests are checked here as an engine checks them; outputs carry the router's clock
(TTFT, inter-token times as a client sees them); `transfers[request_id]` holds {bytes, blocks,
header_bytes, seconds}. The workers are children (`spawn_workers`) or processes that dial in
(`listen=`, disagg_launch.py). A dead worker fails the requests it holds with `WorkerUnavailable`
(503 "worker_unavailable") and sets `dead` (the server's /health reads it: 503); `shutdown()`
stops both and leaves no process. A grammar is checked here against structured.py's cache (the
server compiled it off the event loop), then compiled again in each worker's process.

Left out on purpose: several prefill / decode workers and a policy to pick among them, n > 1 /
best_of and prompt logprobs (refused with a ValueError), restarting a dead worker.
"""
import atexit
import dataclasses
import time
import weakref
from collections import OrderedDict
from multiprocessing.connection import wait

from minillm.engine.requests import check_prompt, request_state
from minillm.engine.config import EngineConfig
from minillm.engine.sampling_params import SamplingParamError, SamplingParams
from minillm.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput
from minillm.serve.disagg_launch import Remote, Worker, accept_workers, spawn_workers, stop_workers
from minillm.serve.errors import WorkerUnavailable
from minillm.serve.kv_link import link_store

__all__ = ["DisaggregatedEngine", "WorkerUnavailable"]
_MAX_TRANSFERS = 4096


@dataclasses.dataclass
class _Flight:
    ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None
    stage: str = "prefill"              # "prefill" -> "transfer" (first token out) -> "decode"
    tokens: list[int] = dataclasses.field(default_factory=list)


class _Queues:
    """What the server's gauges read as `engine.scheduler`: prefilling requests wait, the rest run."""

    def __init__(self, owner):
        self.owner, self.swapped = owner, []

    @property
    def waiting(self) -> list[str]:
        return [r for r, f in self.owner._flights.items() if f.stage == "prefill"]

    @property
    def running(self) -> list[str]:
        return [r for r, f in self.owner._flights.items() if f.stage != "prefill"]


class _Pool:
    """What the gauges read as `engine.block_manager`: the decode worker's pool."""

    def __init__(self, worker: Worker):
        self.worker = worker

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.worker.num_blocks - self.worker.used_blocks


class DisaggregatedEngine:
    """A prefill worker and a decode worker behind `LLMEngine`'s serving interface."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None,
                 threads_per_engine: int = 1, start_timeout_s: float | None = 120.0,
                 listen: tuple[str, int] | None = None, authkey: bytes = b"minillm",
                 on_listen=None):
        """Spawn both workers, or with `listen=(host, port)` wait there for a prefill and a decode
        worker started by hand (`disagg_worker.run_remote`, same `authkey`); `on_listen(address)`
        is called once the address is bound. `start_timeout_s`: for their "ready" (None: no limit)."""
        if isinstance(threads_per_engine, bool) or not isinstance(threads_per_engine, int) \
                or threads_per_engine < 1:
            raise ValueError(f"threads_per_engine must be an int >= 1, got {threads_per_engine!r}")
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if config.num_speculative_tokens or config.kv_cache_dtype != "auto":
            raise ValueError("disaggregated serving needs num_speculative_tokens=0 and "
                             f"kv_cache_dtype='auto', got {config.num_speculative_tokens} and "
                             f"{config.kv_cache_dtype!r}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.clock = time.perf_counter
        self.transfers: OrderedDict[str, dict] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._failed: list[RequestOutput] = []
        self._next_id = 0
        self.closed = False
        self._store = link_store()
        if listen is None:
            self.workers = spawn_workers({"model": model, "tokenizer": tokenizer, "config": config,
                                          "threads": threads_per_engine}, self._store.port,
                                         start_timeout_s)
        else:
            self.workers = accept_workers(listen, authkey, self._store.port, start_timeout_s, on_listen)
        self._pool_blocks = min(w.num_blocks for w in self.workers.values())   # what both hold
        self.scheduler, self.block_manager = _Queues(self), _Pool(self.workers["decode"])
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown(timeout_s=2))

    # ---- the engine interface the server uses ---------------------------------------------------
    @property
    def pids(self) -> dict[str, int]:
        return {role: w.process.pid for role, w in self.workers.items()}

    @property
    def num_blocks(self) -> int:
        return self._pool_blocks

    @property
    def dead(self) -> str | None:
        """Why this router can never serve again (a worker gone, found by `step` or now), or None."""
        if self.closed:
            return None
        gone = next((w.gone for w in self.workers.values() if w.gone), None)
        return gone or next((w.describe_exit() for w in self.workers.values()
                             if not w.process.is_alive()), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._flights or self._failed)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Check the request as an engine would, then send it to the prefill worker."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        bad = ("n" if params.n != 1 else "best_of" if (params.best_of or 1) != 1
               else "prompt_logprobs" if params.prompt_logprobs is not None else None)
        if bad is not None:                   # a ValueError whose `field` the server's 400 names
            raise SamplingParamError(bad, "disaggregated serving samples one completion without "
                                     f"prompt logprobs: n and best_of must be 1 and prompt_logprobs "
                                     f"None, got n={params.n}, best_of={params.best_of}, "
                                     f"prompt_logprobs={params.prompt_logprobs}")
        if priority != 0:
            raise SamplingParamError("priority", f"priority must be 0 in disaggregated serving "
                                                 f"(fcfs), got {priority!r}")
        ids = check_prompt(prompt, params, self.tokenizer, self.model.config, self.num_blocks,
                           self.config.block_size)
        request_state(params, self.tokenizer, self.model.config.vocab_size, self.eos_token_id,
                      self.config.enable_prefix_caching)           # its errors, here
        rid = str(self._next_id) if request_id is None else str(request_id)
        if rid in self._flights:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._next_id += 1
        now = self.clock() if arrival_time is None else arrival_time
        metrics = RequestMetrics(now, first_scheduled_time=now)
        self._flights[rid] = _Flight(ids, params, metrics, prompt if isinstance(prompt, str) else None)
        gone = next((w.gone for w in self.workers.values() if w.gone), None)
        if gone is not None:
            self._fail(rid, gone)
        else:
            self.workers["prefill"].inbox.put(("add", rid, ids, params))
        return rid

    def abort_request(self, request_id: str) -> None:
        rid = str(request_id)
        f = self._flights.pop(rid, None)
        if f is None:
            return                                   # finished, failed, or never added
        f.metrics.finish_time = self.clock()
        for w in self.workers.values():
            if w.gone is None:
                w.inbox.put(("abort", rid))

    def step(self, timeout_s: float = 0.01) -> list[RequestOutput]:
        """What the workers sent since the last call (waiting up to `timeout_s` for something),
        as RequestOutputs; a worker found dead fails its requests here."""
        outputs: dict[str, RequestOutput] = {o.request_id: o for o in self._failed}
        self._failed = []
        live = {w.outbox: w for w in self.workers.values() if w.gone is None}
        for conn in wait(list(live), timeout_s) if live else []:
            w = live[conn]
            try:
                while conn.poll():
                    self._on_message(w, conn.recv(), outputs)
            except (EOFError, OSError):
                self._gone(w, outputs)
        for w in self.workers.values():
            if w.gone is None and not w.process.is_alive():
                self._gone(w, outputs)
        return list(outputs.values())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop both workers (a stop message, then terminate and kill). Idempotent."""
        if self.closed:
            return
        self.closed = True
        stop_workers(self.workers, timeout_s)

    # ---- internals --------------------------------------------------------------------------------
    def _on_message(self, w: Worker, msg: tuple, outputs: dict) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "fatal":
            w.gone = f"worker unavailable: the {w.role} worker (pid {w.process.pid}) failed: {msg[2]}"
        elif kind == "pool":
            w.used_blocks = msg[2]
        elif kind == "sent":
            self.transfers[rid] = msg[2]
            while len(self.transfers) > _MAX_TRANSFERS:
                self.transfers.popitem(last=False)
            if rid in self._flights:
                self._flights[rid].stage = "decode"
        elif kind == "error" and rid in self._flights:
            outputs[rid] = self._fail(rid, msg[2], queue=False)
        elif kind == "out":
            w.used_blocks = msg[3] if w.role == "decode" else w.used_blocks
            if rid in self._flights:
                self._on_output(rid, msg[2], w.role, outputs)

    def _on_output(self, rid: str, out: RequestOutput, role: str, outputs: dict) -> None:
        f, tokens = self._flights[rid], out.outputs[0].token_ids
        if len(tokens) <= len(f.tokens) and not out.finished:
            return                                   # an older snapshot than one already seen
        now, m = self.clock(), f.metrics
        for _ in range(len(tokens) - len(f.tokens)):
            m.token_times.append(now)
        if m.first_token_time is None and tokens:
            m.first_token_time = now
        f.tokens, m.num_generated = list(tokens), len(tokens)
        if role == "prefill" and f.stage == "prefill":
            f.stage = "transfer"
        if out.finished:
            m.finish_time = now
            del self._flights[rid]
        outputs[rid] = dataclasses.replace(out, metrics=m, prompt=f.prompt)

    def _gone(self, w: Worker, outputs: dict) -> None:
        """Worker `w` is unavailable: fail what it holds (decode: everything; prefill: the
        requests it has not handed over)."""
        if isinstance(w.process, Remote):
            w.process.alive = False
        w.process.join(0.5)
        w.gone = w.gone or w.describe_exit()
        for rid, f in list(self._flights.items()):
            if w.role == "decode" or f.stage != "decode":
                outputs[rid] = self._fail(rid, w.gone, queue=False)

    def _fail(self, rid: str, message: str, queue: bool = True) -> RequestOutput:
        """End request `rid` with finish_reason "abort" and `message` as its error."""
        f = self._flights.pop(rid)
        f.metrics.finish_time = self.clock()
        out = RequestOutput(rid, list(f.ids), [CompletionOutput(0, list(f.tokens), "abort",
                                                                "" if self.tokenizer else None)],
                            True, f.metrics, "" if self.tokenizer else None, f.prompt,
                            error=message)
        for w in self.workers.values():
            if w.gone is None:
                w.inbox.put(("abort", rid))
        if queue:
            self._failed.append(out)
        return out

