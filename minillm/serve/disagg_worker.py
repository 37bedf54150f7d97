"""The two engine processes of disaggregated serving: a prefill worker and a decode worker.

    router --inbox (mp.Queue)--> prefill: add_request, step() -> first token -> KV link -> decode
    router --inbox (mp.Queue)--> decode:  import the handoff, step() ... -> tokens
    each worker --outbox (its own pipe)--> router: ("ready" | "out" | "sent" | "pool" | "error"
                                                    | "fatal", ...)

Each worker owns a whole `LLMEngine` on `threads` torch threads. The prefill worker runs a
request to its first token, sends that token to the router at once, exports the prompt's KV
(`export_prompt_kv`), frees its blocks and sends the KV over the link (kv_link.py); a request
that ends with its first token ends there. The decode worker receives handoffs in a thread,
imports each when its pool has room (`can_import`, in order) and steps its engine. Each worker
writes to its own pipe, dies with the router (PR_SET_PDEATHSIG) and leaves with `os._exit`.
`run_remote` is the same worker started by hand (`python -m minillm serve --disaggregated --role
prefill`), dialing the router's control address (loopback and a key: its messages are pickles).

Left out on purpose: several prefill or decode workers, and overlapping the send with the next
prefill (the prefill loop waits for the link; the decode side receives while it steps).
"""
import dataclasses
import os
import queue
import threading
import traceback
from collections import OrderedDict, deque
from multiprocessing.connection import Client

import torch

from minillm.distributed.group import die_with_parent
from minillm.distributed.kv_transfer import can_import, export_prompt_kv, import_prefilled
from minillm.engine.llm_engine import LLMEngine
from minillm.serve.kv_link import DECODE_RANK, PREFILL_RANK, KVLink

_MAX_REMEMBERED_ABORTS = 4096


def _setup(spec: dict, port: int, rank: int):
    die_with_parent()
    torch.set_num_threads(spec["threads"])
    link = KVLink.connect(port, rank)
    engine = LLMEngine(spec["model"], spec["config"], tokenizer=spec["tokenizer"])
    return engine, link


def _drain(q) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
        except (EOFError, OSError):                   # the router went away: stop
            return items + [("stop",)]


def _next(inbox) -> tuple:
    try:
        return inbox.get()
    except (EOFError, OSError):
        return ("stop",)


class ConnInbox:
    """A duplex Connection read like the mp.Queue inbox (`get`, `get_nowait`)."""

    def __init__(self, conn):
        self.conn = conn

    def get(self):
        return self.conn.recv()

    def get_nowait(self):
        if self.conn.poll():
            return self.conn.recv()
        raise queue.Empty


def _run(role: str, outbox, body) -> None:
    """Run a worker's loop; an unexpected error goes to the router as ("fatal", role, text)."""
    code = 0
    try:
        body()
    except BaseException as err:                      # noqa: BLE001 (reported, then exit 1)
        code = 1
        try:
            outbox.send(("fatal", role, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=5)}"))
        except OSError:
            pass
    finally:
        outbox.close()
        os._exit(code)


def prefill_main(port: int, inbox, outbox, spec: dict) -> None:
    """The prefill worker's process: prompts in, first tokens out, KV blocks onto the link."""
    def body():
        engine, link = _setup(spec, port, PREFILL_RANK)
        outbox.send(("ready", "prefill", os.getpid(), engine.num_blocks))
        try:
            while True:
                msgs = [] if engine.has_unfinished_requests() else [_next(inbox)]
                msgs += _drain(inbox)
                if any(m[0] == "stop" for m in msgs):
                    return
                for kind, rid, *args in msgs:
                    if kind == "add":
                        try:
                            engine.add_request(*args, request_id=rid)
                        except (TypeError, ValueError) as err:
                            outbox.send(("error", rid, str(err)))
                    elif kind == "abort" and rid in engine.requests:
                        engine.abort_request(rid)
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        _hand_off(engine, link, out, outbox)
        finally:
            if not link.closed:
                try:
                    link.send(None)                   # the decode side's receiver ends
                except Exception:                     # noqa: BLE001 (the peer is gone already)
                    pass
    _run("prefill", outbox, body)


def _hand_off(engine, link: KVLink, out, outbox) -> None:
    """First token to the router; if the request goes on, its KV to the decode worker."""
    rid = out.request_id
    outbox.send(("out", rid, _slim(out), engine.block_manager.num_used_blocks))
    if out.finished or len(out.outputs[0].token_ids) != 1:
        return                                        # it ended here (or failed): nothing to send
    handoff = export_prompt_kv(engine, rid)
    engine.abort_request(rid)                         # its blocks go back to this pool
    if link.closed:
        outbox.send(("error", rid, "worker unavailable: the KV link to the decode worker is down"))
        return
    try:
        stats = link.send(handoff)
    except Exception as err:                          # noqa: BLE001 (gloo: the peer is gone)
        link.closed = True
        outbox.send(("error", rid, f"worker unavailable: the KV link to the decode worker "
                                   f"failed: {type(err).__name__}: {err}"))
        return
    outbox.send(("sent", rid, stats))


def decode_main(port: int, inbox, outbox, spec: dict) -> None:
    """The decode worker's process: handoffs in (a receiver thread), tokens out."""
    def body():
        engine, link = _setup(spec, port, DECODE_RANK)
        events: queue.Queue = queue.Queue()
        threading.Thread(target=_pump_inbox, args=(inbox, events), daemon=True).start()
        threading.Thread(target=_pump_link, args=(link, events), daemon=True).start()
        outbox.send(("ready", "decode", os.getpid(), engine.num_blocks))
        pending, aborted, used = deque(), OrderedDict(), 0
        while True:
            busy = engine.has_unfinished_requests()
            evs = ([] if busy else [events.get()]) + _drain(events)
            for kind, item in evs:
                if kind == "ctl" and item[0] == "stop":
                    return
                if kind == "ctl" and item[0] == "abort":
                    _abort(engine, pending, aborted, item[1])
                elif kind == "kv" and item.request_id in aborted:
                    del aborted[item.request_id]      # aborted before it arrived: dropped
                elif kind == "kv":
                    pending.append(item)
            while pending and can_import(engine, pending[0]):
                h = pending.popleft()
                try:
                    import_prefilled(engine, h)
                except (TypeError, ValueError) as err:
                    outbox.send(("error", h.request_id, str(err)))
            if engine.has_unfinished_requests():
                for out in engine.step():
                    outbox.send(("out", out.request_id, _slim(out),
                                 engine.block_manager.num_used_blocks))
            if engine.block_manager.num_used_blocks != used:
                used = engine.block_manager.num_used_blocks
                outbox.send(("pool", None, used))
    _run("decode", outbox, body)


def _slim(out):
    """A snapshot without its metrics: the router keeps its own clock, and a long request's
    per-token times would otherwise travel again with every token."""
    return dataclasses.replace(out, metrics=None)


def _abort(engine, pending: deque, aborted: OrderedDict, rid: str) -> None:
    """Abort wherever the request is: running here, waiting for room, or not yet arrived."""
    if rid in engine.requests:
        engine.abort_request(rid)
        return
    for h in pending:
        if h.request_id == rid:
            pending.remove(h)
            return
    aborted[rid] = None                               # drop its handoff when it comes
    while len(aborted) > _MAX_REMEMBERED_ABORTS:
        aborted.popitem(last=False)


def _pump_inbox(inbox, events: queue.Queue) -> None:
    while True:
        msg = _next(inbox)
        events.put(("ctl", msg))
        if msg[0] == "stop":
            return


def _pump_link(link: KVLink, events: queue.Queue) -> None:
    """Receive handoffs until the link closes or fails (the prefill worker went away)."""
    try:
        while (h := link.recv()) is not None:
            events.put(("kv", h))
    except Exception as err:                          # noqa: BLE001 (gloo: the peer is gone)
        events.put(("link_down", str(err)))


def run_remote(role: str, address: tuple[str, int], spec: dict, authkey: bytes) -> None:
    """A worker started by hand: dial the router at `address`, then run `role`'s loop (never
    returns). `spec`: {"model", "tokenizer", "config", "threads"}."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    conn = Client(address, authkey=authkey)
    conn.send(("hello", role, os.getpid()))
    reply = conn.recv()
    if reply[0] != "link":
        raise RuntimeError(f"the router at {address[0]}:{address[1]} refused this {role} worker: {reply[-1]}")
    main = prefill_main if role == "prefill" else decode_main
    main(reply[1], ConnInbox(conn), conn, spec)
