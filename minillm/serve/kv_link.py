"""The KV link: a prefill process sends prefilled requests to a decode process over torch.distributed.

    router (holds the TCPStore, no rank) -- rendezvous --> prefill (rank 0) <== gloo ==> decode (rank 1)
    one request: header (pickled, `Comm.broadcast_object`) then one `send` per KV block, in block order

A 2-rank gloo process group of its own (distributed/group.py's `Comm`, so the link counts its
calls and bytes like every other group in chapter 11). The header says the request, its first
token, its sampling parameters and every block's shape (2, L, n_i, Hkv, D) (kv_transfer.py), so the
decode side allocates each block's buffer before `recv`. A header of None closes the link.

`send` returns what one request cost: KV payload bytes (= kv_math.kv_cache_bytes(cfg, S, dtype),
the header not counted), blocks and seconds. The link's timeout is long on purpose: an idle
server's decode side waits in `recv` for the next request, and a peer that dies shows up at
once as an error (gloo: connection reset), not as a timeout.

Left out on purpose: RDMA / NVLink transports (vLLM's NIXL and Mooncake connectors), pipelining a
request's blocks with its prefill (layer by layer, as Splitwise does), several decode peers.
"""
import datetime
import time

import torch
import torch.distributed as dist

from minillm.distributed.group import HOST, Comm, make_process_group
from minillm.distributed.kv_transfer import Handoff

PREFILL_RANK, DECODE_RANK = 0, 1
IDLE_TIMEOUT_S = 7 * 24 * 3600.0          # an idle link is not an error


def link_store(timeout_s: float = 60.0):
    """The rendezvous store the two sides meet at (the router keeps it); its `.port` goes to both."""
    return dist.TCPStore(HOST, 0, 2, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class KVLink:
    """One side of the link. `connect(port, rank)` in each process; prefill `send`s, decode `recv`s."""

    def __init__(self, comm: Comm):
        self.comm, self.rank = comm, comm.rank
        self.closed = False

    @classmethod
    def connect(cls, port: int, rank: int, timeout_s: float = IDLE_TIMEOUT_S,
                connect_timeout_s: float = 60.0) -> "KVLink":
        if rank not in (PREFILL_RANK, DECODE_RANK):
            raise ValueError(f"rank must be {PREFILL_RANK} (prefill) or {DECODE_RANK} (decode), got {rank!r}")
        store = dist.TCPStore(HOST, port, 2, False,
                              timeout=datetime.timedelta(seconds=connect_timeout_s))
        pg = make_process_group(store, rank, 2, "gloo", timeout_s)
        link = cls(Comm(pg, rank, 2, torch.device("cpu")))
        link._store = store
        return link

    def send(self, h: Handoff | None) -> dict:
        """Prefill side: the header, then each block (2, L, n_i, Hkv, D). None closes the link.
        Returns {"bytes", "blocks", "header_bytes", "seconds"}."""
        if self.rank != PREFILL_RANK:
            raise RuntimeError("only the prefill side (rank 0) sends on a KV link")
        t0 = time.perf_counter()
        before = self.comm.stats.get("broadcast", {}).get("bytes", 0)
        self.comm.broadcast_object(None if h is None else h.header(), src=PREFILL_RANK)
        header_bytes = self.comm.stats["broadcast"]["bytes"] - before
        if h is None:
            self.closed = True
            return {"bytes": 0, "blocks": 0, "header_bytes": header_bytes, "seconds": 0.0}
        for block in h.blocks:
            self.comm.send(block.contiguous(), DECODE_RANK)
        return {"bytes": h.nbytes, "blocks": h.num_blocks, "header_bytes": header_bytes,
                "seconds": time.perf_counter() - t0}

    def recv(self) -> Handoff | None:
        """Decode side: the next request, its blocks received one by one; None once closed."""
        if self.rank != DECODE_RANK:
            raise RuntimeError("only the decode side (rank 1) receives on a KV link")
        header = self.comm.broadcast_object(None, src=PREFILL_RANK)
        if header is None:
            self.closed = True
            return None
        dtype = getattr(torch, header["dtype"])
        blocks = [self.comm.recv(torch.empty(shape, dtype=dtype), PREFILL_RANK)
                  for shape in header["shapes"]]                         # each (2, L, n_i, Hkv, D)
        return Handoff.from_header(header, blocks)
