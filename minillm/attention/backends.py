"""Which attention path a paged cache's step takes, and where flash-decoding starts to pay on
this machine: timed once, cached.

Letters: B sequences, H query heads, Hkv kv heads, D head dim, Sg the longest context of a step,
M new tokens of the step.

"paged" gathers every context into one padded tensor and runs one SDPA (paged.py); it wins while
that copy is small. "flash_decoding" reads tiles into reused buffers and merges the partials
(flash_decoding.py). "auto", the default, sends a decode-only step to flash-decoding from this
machine's crossover, `decode_threshold(...)`: both timed over a grid of (batch, context), keeping
the key count from which flash-decoding always wins, cached beside the matmul table per CPU,
torch, threads, device and head shape. Steps with a prefill chunk take the paged path.
`BackendChoice` chooses once per step for every layer.

Left out on purpose: a finer crossover model (per batch size, per KV dtype); quantized KV pools
are timed as their float equivalent.
"""
import time

import torch

from minillm._validate import check_int
from minillm.attention.flash_decoding import CHUNK, DecodePlan, flash_decode
from minillm.attention.metadata import PagedAttentionMetadata
from minillm.attention.paged import attend_slot_rows
from minillm.kernels.cpu_kernels import cpu_name, kernel_isa
from minillm.kernels.route_timing import settled
from minillm.kernels.tuning_cache import read_tuned, tuning_file, write_tuned

ATTENTION_BACKENDS = ("paged", "flash_decoding", "auto")


class BackendChoice:
    """The attention path of each step of one paged cache: `decode_plan(q, meta)` is asked once
    per step and returns the step's flash-decoding plan, or None for the paged path.

    name: one of ATTENTION_BACKENDS; n_kv_head, head_dim: the model's; max_context: the model's
    longest sequence (a plan refuses longer contexts)."""

    def __init__(self, name: str, n_kv_head: int, head_dim: int, max_context: int | None = None):
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {name!r}")
        self.name, self.n_kv_head, self.head_dim = name, n_kv_head, head_dim
        self.max_context = max_context
        # "auto" only: the crossover in keys (None: flash-decoding never wins here), asked of
        # `decode_threshold` the first time a step is long enough to need it
        self.crossover_known = False
        self.crossover: int | None = None

    def decode_plan(self, q, meta: PagedAttentionMetadata) -> DecodePlan | None:
        """q (M, H, D) of the step `meta` describes -> its `DecodePlan` if this step goes
        through flash-decoding (decode-only, and the backend says so), else None."""
        if meta.num_tokens != len(meta.query_lens) or not self._flash(q, meta):
            return None
        return DecodePlan.from_metadata(meta, self.n_kv_head, CHUNK, self.max_context)

    def _flash(self, q, meta: PagedAttentionMetadata) -> bool:
        """Decode-only step: always with "flash_decoding"; with "auto" when the longest context
        spans more than one chunk and the step's keys (B x Sg) reach the crossover."""
        if self.name != "auto":
            return self.name == "flash_decoding"
        B, _, Sg = meta.groups[0].shape
        if Sg <= CHUNK:
            return False
        if not self.crossover_known:
            self.crossover = decode_threshold(q.shape[1], self.n_kv_head, self.head_dim,
                                              q.dtype, q.device)
            self.crossover_known = True
        return self.crossover is not None and B * Sg >= self.crossover


GRID = ((1, 512), (1, 2048), (8, 512), (1, 8192), (8, 2048), (8, 8192))   # (batch, context)
BLOCK = 16
VERSION = 1


def _key(n_head, n_kv_head, head_dim, dtype, device) -> dict:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    isa = {} if dev.type == "cuda" else {"isa": kernel_isa()}
    return {"device": name, **isa, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "shape": [n_head, n_kv_head, head_dim], "dtype": str(dtype), "grid": [list(p) for p in GRID],
            "chunk": CHUNK, "version": VERSION}


def cache_path(key: dict, cache_dir=None):
    return tuning_file("decode_attention", key, cache_dir)


def decide(times: dict):
    """Total keys from which flash-decoding is used: the smallest B x S of the grid such that it
    beat the paged path there and at every larger point; None when it loses at the largest.
    `times`: {(B, S): {"paged": ms, "flash_decoding": ms}}. A pure function of the timings."""
    points = sorted(times, key=lambda p: (p[0] * p[1], p))
    threshold = None
    for b, s in reversed(points):
        t = times[(b, s)]
        if t["flash_decoding"] >= t["paged"]:
            break
        threshold = b * s
    return threshold


def decode_step(n_head, n_kv_head, head_dim, batch, context, dtype=torch.float32, device="cpu",
                seed=0, context_lens=None, block_size: int = BLOCK, chunk: int = CHUNK) -> dict:
    """One layer's random pools (blocks in a shuffled order) and one decode step over them:
    {"paged": fn, "flash_decoding": fn, "q": (B, H, D)}. `context_lens` default: ragged, as in
    serving (context, context - 1, ...). Also the points of `bench attention_decode`."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-context // block_size)
    order = torch.randperm(batch * nb, generator=g).tolist()
    tables = [order[i * nb:(i + 1) * nb] for i in range(batch)]
    width = n_kv_head * head_dim
    k = torch.randn(batch * nb * block_size, width, generator=g).to(device, dtype)   # (N*P, Hkv*D)
    v = torch.randn(batch * nb * block_size, width, generator=g).to(device, dtype)
    lens = context_lens or [context - (i % 4) for i in range(batch)]
    meta = PagedAttentionMetadata([1] * batch, lens, tables, block_size, device)
    plan = DecodePlan.from_metadata(meta, n_kv_head, chunk)
    q = torch.randn(batch, n_head, head_dim, generator=g).to(device, dtype)           # (B, H, D)
    return {"paged": lambda: attend_slot_rows(q, k, v, n_kv_head, meta),
            "flash_decoding": lambda: flash_decode(q, k, v, n_kv_head, plan), "q": q}


@torch.inference_mode()
def time_backends(n_head, n_kv_head, head_dim, dtype=torch.float32, device="cpu",
                  rounds: int = 3, max_rounds: int = 9, grid=GRID) -> dict:
    """{(B, S): {"paged": ms, "flash_decoding": ms}}: the fastest of interleaved rounds, more
    rounds (up to `max_rounds`) until each case's two fastest samples agree within 10%."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    out = {}
    for b, s in grid:
        step = decode_step(n_head, n_kv_head, head_dim, b, s, dtype, device)
        fns = {name: step[name] for name in ("paged", "flash_decoding")}
        samples = {name: [] for name in fns}
        for name, fn in fns.items():                                   # warm-up
            fn()
        for done in range(1, max_rounds + 1):
            for name, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                samples[name].append(1e3 * (time.perf_counter() - t0))
            if done >= rounds and all(settled(x) for x in samples.values()):
                break
        out[(b, s)] = {name: min(x) for name, x in samples.items()}
    return out


def decode_threshold(n_head: int, n_kv_head: int, head_dim: int, dtype=torch.float32,
                     device="cpu", cache_dir=None, retune: bool = False):
    """This machine's crossover in total keys (None: flash-decoding never wins on the grid), from
    the cache, else timed now (a few seconds) and saved."""
    for name, value in (("n_head", n_head), ("n_kv_head", n_kv_head), ("head_dim", head_dim)):
        check_int(name, value, 1)
    key = _key(n_head, n_kv_head, head_dim, dtype, device)
    path = cache_path(key, cache_dir)
    data = None if retune else read_tuned(path, key)
    if data is not None and "threshold" in data and (data["threshold"] is None
                                                     or isinstance(data["threshold"], int)):
        return data["threshold"]
    times = time_backends(n_head, n_kv_head, head_dim, dtype, device)     # missing, corrupt, foreign
    threshold = decide(times)
    write_tuned(path, key, {"threshold": threshold,
                            "times_ms": {f"{b}x{s}": t for (b, s), t in times.items()}})
    return threshold
