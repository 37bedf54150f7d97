"""One engine loop per server: HTTP handlers never touch the engine, one coroutine does.

    handler --("add", ...)--> command queue --> loop: apply commands, engine.step() in a worker
    handler <-- RequestOutput snapshots -- per-request queue <-- loop: after each step

Only `_run` calls the engine (no lock needed): it applies waiting commands (add, abort) between
steps, runs `engine.step()` in a worker thread, and lets handlers write this step's chunks
(`_drain`) before the next. A request is pending from `submit` until it finishes; at
`max_pending` a new one gets `QueueFull` (503). `num_queued` counts those not yet handed to the
engine. At shutdown `end_streams` ends each request in flight with `ShuttingDown`; a handler
whose client left calls `abort`; a step that raises ends every request in flight with its error
and the loop goes on serving, unless the engine can never step again (a worker process died:
`WorkerDied`, a disaggregated worker gone): then `dead` says why, logged once, /health answers
503 and `submit` raises `EngineDead`.

Left out on purpose: several engines (data parallel), and waking early from a step to admit a
request (vLLM also admits new requests only between steps).
"""
import asyncio
import itertools
import logging
import secrets
import time

from minillm.distributed.group import WorkerDied

log = logging.getLogger("minillm.serve")


class QueueFull(Exception):
    """Too many requests pending: the server is overloaded."""


class ShuttingDown(Exception):
    """The server is stopping: requests still in flight end with this."""


class EngineDead(RuntimeError):
    """The engine can never step again (a worker process is gone); the message says which."""


def engine_death(engine) -> str | None:
    """Why `engine` can never step again, or None, without stepping it: a disaggregated router's
    lost worker (`engine.dead`), or a tensor-parallel group with a rank gone."""
    dead = getattr(engine, "dead", None)
    if dead:
        return dead
    group = getattr(getattr(engine, "runner", None), "group", None)
    if group is None or getattr(group, "closed", True) or not hasattr(group, "check_alive"):
        return None
    try:
        group.check_alive()
    except WorkerDied as err:
        return f"WorkerDied: {err}"
    return None


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutput snapshots."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.owner, self.request_id = owner, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """The client is gone (or gave up): stop the request, free its blocks."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine, metrics=None, max_pending: int = 256):
        self.engine, self.metrics, self.max_pending = engine, metrics, max_pending
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)        # two servers may share one engine
        self._commands: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._tokens: dict[str, int | None] = {}   # tokens counted so far (None: still in prefill)
        self._params: dict[str, object] = {}       # each request's SamplingParams, for /metrics
        self.num_queued = 0                        # submitted, not yet added to the engine
        self.closing = False
        self._dead: str | None = None

    @property
    def dead(self) -> str | None:
        """Why the engine can never step again (None while it can)."""
        return self.find_death()

    def find_death(self, why: str | None = None) -> str | None:
        """`dead`, probing the engine's workers (or taking `why`) while none is known; a death
        is logged once."""
        if self._dead is None:
            why = why or engine_death(self.engine)
            if why is not None:
                self._dead = why
                log.error("the engine is dead, /health answers 503 from now on: %s", why)
        return self._dead

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._commands = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="minillm-engine-loop")

    async def stop(self) -> None:
        """Abort whatever is in flight and end the loop."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for rid in list(self._streams):
            self._finish_with(rid, ShuttingDown("the server is shutting down"))
            self._abort_in_engine(rid)

    def end_streams(self, message: str = "the server is shutting down") -> int:
        """End every request in flight with ShuttingDown (their handlers answer or close their
        streams with it) and refuse new ones; the loop aborts them in the engine between steps.
        Returns how many it ended."""
        self.closing = True
        rids = list(self._streams)
        for rid in rids:
            self._finish_with(rid, ShuttingDown(message))
            self._commands.put_nowait(("abort", rid, None, None))
            if self.metrics is not None:
                self.metrics.aborted()
        return len(rids)

    async def submit(self, prompt_token_ids, params, priority: int = 0, arrival_time=None) -> RequestStream:
        """Queue a request; raises QueueFull, or the engine's ValueError/TypeError for bad input."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.num_pending >= self.max_pending:
            raise QueueFull(f"{self.num_pending} requests are pending (max {self.max_pending})")
        rid = f"{self._prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid)
        self._streams[rid] = stream
        added = asyncio.get_running_loop().create_future()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.num_queued += 1
        await self._commands.put(("add", rid, (prompt_token_ids, params, priority, arrival), added))
        try:
            await added
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put_nowait(("abort", request_id, None, None))

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._apply(await self._commands.get())      # idle: sleep until a request comes
            while not self._commands.empty():
                self._apply(self._commands.get_nowait())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as err:
                if isinstance(err, WorkerDied):
                    self.find_death(f"{type(err).__name__}: {err}")
                elif self.dead is None:                        # should not happen; keep serving
                    log.exception("engine step failed; aborting the requests in flight")
                for rid in list(self._streams):
                    self._finish_with(rid, err)
                    self._abort_in_engine(rid)
                continue
            prefills, generated = [], 0
            for out in outputs:
                generated += self._deliver(out, prefills)
            if self.metrics is not None and outputs:
                self.metrics.step(prefills, generated)
            if any(getattr(o, "error", None) for o in outputs):
                self.find_death()                              # a lost worker: say so once
            await self._drain()

    async def _drain(self, max_rounds: int = 16) -> None:
        """Let the handlers turn this step's outputs into bytes on their sockets before the next
        step starts: Python code in the event loop during a step would fight the step's thread
        for the GIL (each handover can wait the interpreter's 5 ms switch interval)."""
        for _ in range(max_rounds):
            if all(s.queue.empty() for s in self._streams.values()):
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)                     # and their writes that follow the get()

    def _apply(self, command) -> None:
        kind, rid, args, fut = command
        if kind == "abort":
            if self._streams.pop(rid, None) is not None and self.metrics is not None:
                self.metrics.aborted()
            self._forget(rid)
            self._abort_in_engine(rid)
            return
        self.num_queued -= 1
        if fut.cancelled():                       # the handler went away before its turn
            self._streams.pop(rid, None)
            return
        ids, params, priority, arrival = args
        try:
            self.engine.add_request(ids, params, request_id=rid, arrival_time=arrival, priority=priority)
        except (TypeError, ValueError) as err:
            fut.set_exception(err)
            return
        if self.metrics is not None:
            self.metrics.prompt_tokens(len(ids))
        self._tokens[rid], self._params[rid] = None, params
        fut.set_result(rid)

    def _abort_in_engine(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except ValueError:
            pass                                  # never added (it failed its checks)

    def _forget(self, rid: str) -> None:
        self._tokens.pop(rid, None)
        self._params.pop(rid, None)

    def _deliver(self, out, prefills: list) -> int:
        """Hand `out` to its stream; returns the tokens it added, and appends (prompt tokens,
        cached) to `prefills` when its prefill ended in this step (its first tokens came, or it
        finished without any and without an error: a prompt scored only)."""
        rid, new = out.request_id, 0
        if self.metrics is not None and rid in self._tokens:
            before, total = self._tokens[rid], sum(len(c.token_ids) for c in out.outputs)
            new = total - (before or 0)
            self.metrics.generation_tokens(new)
            scored = out.finished and not getattr(out, "error", None)    # done, no token asked
            prefilled = before is not None or total > 0 or scored
            if before is None and prefilled:
                prefills.append((len(out.prompt_token_ids), out.metrics.num_cached_tokens))
            self._tokens[rid] = total if prefilled else None
        stream = self._streams.get(rid)
        if out.finished:
            self._streams.pop(rid, None)
            params = self._params.get(rid)
            self._forget(rid)
            if self.metrics is not None:
                self.metrics.finished(out, params)
        if stream is not None:
            stream.queue.put_nowait(out)
        return new

    def _finish_with(self, rid: str, err: BaseException) -> None:
        stream = self._streams.pop(rid, None)
        self._forget(rid)
        if stream is not None:
            stream.queue.put_nowait(err)
