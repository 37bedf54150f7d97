"""Piecewise CUDA graphs for the engine's steps: the pieces between two attention calls captured
once per padded size and replayed, the paged attention run eager between them (vLLM's design).

Letters: M rows of a step, M' the padded size, L layers, H/Hkv heads, D head dim, C model width.

A small GPU step costs its launches more than its arithmetic; a graph replays them in one launch
but needs fixed memory and shapes, which paged attention lacks. So the step is cut at each
attention call into L + 1 pieces (embedding to layer 0's q/k/v; o_proj, MLP and the next layer's
q/k/v; the last MLP and final norm). Each piece is replayed, and attention runs eager between them
(`cache.attend_rows`). Sizes are `CompilationConfig.capture_sizes`, captured largest first into one
shared pool; a size is kept where it agrees with eager and beats it (`_pick`). `CudaGraph` wraps
`torch.cuda.CUDAGraph`; `EagerGraph` is a CPU stand-in so CPU tests check everything but recording.

Left out on purpose: inductor-compiled pieces, full-step graphs for decode-only batches, tensor
parallelism, the lm_head, and capturing during a request.
"""
import statistics
import time
import weakref
from dataclasses import dataclass

import torch

from minillm.kernels.compilation_config import CompilationConfig
from minillm.kernels.compiled import _pick, reference_twin
from minillm.kernels.compiled_steps import ATOL_REL, CONTEXT, SizeTiming, kept_and_eager
from minillm.kernels.tuning_cache import notice
from minillm.model.llama import rope_cos_sin


class EagerGraph:
    """A CPU's stand-in for a CUDA graph: `capture(fn)` runs fn and keeps its outputs; `replay()`
    runs fn again and copies the result into those same tensors (fixed memory, as a graph's)."""

    def __init__(self, pool=None):
        self.fn, self.outputs = None, ()

    def capture(self, fn) -> tuple:
        self.fn, self.outputs = fn, fn()
        return self.outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


class CudaGraph:
    """`torch.cuda.CUDAGraph` behind the same two calls: `warmup` runs of fn on a side stream (the
    libraries' lazy setup happens outside the capture), then fn recorded into `pool`. It holds
    its outputs: a later piece reads them in place, so the pool must never hand their memory on."""

    def __init__(self, pool, warmup: int = 2):
        self.pool, self.warmup, self.graph, self.outputs = pool, warmup, None, ()

    def capture(self, fn) -> tuple:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        self.graph.replay()


def graph_backend(device):
    """The graph class for `device`: `CudaGraph` on a CUDA device, None elsewhere (tests put
    `EagerGraph` here to run the engine's graphs on a CPU)."""
    return CudaGraph if torch.device(device).type == "cuda" else None


class Pieces:
    """The step cut at its attention calls, over a reference twin: the arithmetic of `_Body`."""

    def __init__(self, twin):
        self.m, cfg = twin, twin.config
        self.H, self.Hkv, self.D, self.L = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_layer

    def pre_attention(self, i, x, cos, sin):          # x (M, C) -> q (M, H, D), k, v (M, Hkv, D)
        blk, H, Hkv, D = self.m.layers[i], self.H, self.Hkv, self.D
        qkv = blk.attn.qkv_proj(blk.input_norm(x)).view(x.shape[0], H + 2 * Hkv, D)
        qk = qkv[:, :H + Hkv]
        qk = qk * cos + torch.cat([-qk[..., D // 2:], qk[..., :D // 2]], -1) * sin
        return qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]

    def post_attention(self, i, x, y):                # x (M, C), y (M, H, D) -> x (M, C)
        blk = self.m.layers[i]
        x = x + blk.attn.o_proj(y.reshape(x.shape[0], self.H * self.D))
        return x + blk.mlp(blk.post_attn_norm(x))

    def first(self, ids, pos):                        # (M,), (M,) -> cos, sin, x, q, k, v
        cfg = self.m.config
        cos, sin = rope_cos_sin(pos, self.D, cfg.rope_theta, self.m.dtype)    # (M, D)
        cos, sin = cos[:, None], sin[:, None]                                  # (M, 1, D)
        x = self.m.embed(ids)                                                  # (M, C)
        return (cos, sin, x, *self.pre_attention(0, x, cos, sin))

    def middle(self, i, x, y, cos, sin):              # layer i-1's rest, layer i's start
        x = self.post_attention(i - 1, x, y)
        return (x, *self.pre_attention(i, x, cos, sin))

    def last(self, x, y):                             # -> (hidden (M, C),)
        return (self.m.norm(self.post_attention(self.L - 1, x, y)),)


@dataclass
class SizeGraphs:
    """One size's graphs and static tensors: inputs ids, pos (M',); per layer the q, k, v a
    piece writes and the attention output y (M', H, D) the next piece reads; hidden (M', C)."""
    ids: torch.Tensor
    pos: torch.Tensor
    graphs: list
    qkv: list
    ys: list
    hidden: torch.Tensor

    def replay(self, input_ids, positions, cache) -> torch.Tensor:
        """input_ids (1, M'), positions (M',) -> hidden (M', C), overwritten by the next step."""
        self.ids.copy_(input_ids[0])
        self.pos.copy_(positions)
        self.graphs[0].replay()
        for i, (q, k, v) in enumerate(self.qkv):
            self.ys[i].copy_(cache.attend_rows(i, q, k, v))      # eager: this step's tables
            self.graphs[i + 1].replay()
        return self.hidden


_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {key: steps}


def cuda_graph_steps(model, config: CompilationConfig, make_cache, device, progress=notice):
    """The engine's piecewise graphs for `config` (captured and judged once per process and
    model), or None where they do not apply: cudagraph_mode "none", or no graph backend for
    `device` (one line if "piecewise" was asked for)."""
    graph = graph_backend(device)
    if config.cudagraph_mode == "none" or (config.cudagraph_mode is None and graph is None):
        return None
    if graph is None:
        notice(f"cuda graphs: cudagraph_mode='piecewise' needs a CUDA device, not "
               f"{torch.device(device).type}; ignored")
        return None
    made = _MADE.setdefault(model, {})
    if (config, graph) not in made:
        made[config, graph] = CudaGraphSteps(model, config, graph).capture(make_cache, progress)
    return made[config, graph]


class CudaGraphSteps:
    """`CompiledSteps`' interface over piecewise graphs: `capture()` records and judges each
    size, `padded(M)` says the size a step of M rows runs at (None: eager), `run(...)` runs it.
    `graph`: the graph class (None: `graph_backend(model.device)`). `timings` are
    `SizeTiming`s whose compiled_ms is the graphs' step and compile_s every size's capture."""

    def __init__(self, model, config: CompilationConfig, graph=None):
        self.model, self.config = model, config
        self.graph = graph or graph_backend(model.device)
        if self.graph is None:
            raise ValueError(f"CUDA graphs need a CUDA device (the model is on {model.device}); "
                             f"pass graph=EagerGraph to run the pieces eagerly")
        self.pieces = Pieces(reference_twin(model))       # TypeError for a quantized model
        self.pool = torch.cuda.graph_pool_handle() if self.graph is CudaGraph else None
        self.sizes: dict[int, SizeGraphs] = {}
        self.kept: tuple = ()
        self.timings: list[SizeTiming] = []
        self.capture_s = 0.0
        self.why_eager = ""                               # set when capturing failed

    def padded(self, rows: int) -> int | None:
        """The kept size a step of `rows` rows runs at, or None (eager)."""
        for s in self.config.capture_sizes:
            if s >= rows:
                return s if s in self.kept else None
        return None

    def _capture(self, size: int) -> SizeGraphs:
        p, dev, dtype = self.pieces, self.model.device, self.model.dtype
        ids = torch.zeros(size, dtype=torch.long, device=dev)                 # (M',)
        pos = torch.zeros(size, dtype=torch.long, device=dev)                 # (M',)
        ys = [torch.zeros(size, p.H, p.D, dtype=dtype, device=dev) for _ in range(p.L)]
        graphs = [self.graph(self.pool) for _ in range(p.L + 1)]
        cos, sin, x, *qkv = graphs[0].capture(lambda: p.first(ids, pos))
        qkvs = [tuple(qkv)]
        for i in range(1, p.L):                       # default args: this piece's inputs, bound now
            x, *qkv = graphs[i].capture(lambda i=i, x=x: p.middle(i, x, ys[i - 1], cos, sin))
            qkvs.append(tuple(qkv))
        hidden, = graphs[p.L].capture(lambda x=x: p.last(x, ys[-1]))
        return SizeGraphs(ids, pos, graphs, qkvs, ys, hidden)

    def run(self, input_ids, positions, cache, rows: int, logits_index, return_hidden=False):
        """The step of `rows` real rows padded to input_ids (1, M'): logits (1, K, V) at
        `logits_index` (every real row when None), with `return_hidden` also hidden (1, rows, C)."""
        hidden = self.sizes[input_ids.shape[1]].replay(input_ids, positions, cache)[:rows][None]
        picked = hidden if logits_index is None else hidden[:, logits_index]
        logits = self.model.lm_head(picked)                                  # (1, K, V)
        return (logits, hidden.clone()) if return_hidden else logits        # its own memory

    @torch.inference_mode()
    def capture(self, make_cache, progress=None) -> "CudaGraphSteps":
        """Capture every size (largest first), then time each against the eager model over a
        scratch cache (`make_cache(num_blocks, block_size)`) and keep it where it agrees and wins.
        A capture that fails keeps every size eager, with one line."""
        sizes, t0 = self.config.capture_sizes, time.perf_counter()
        if progress is not None:
            progress(f"capturing CUDA graphs: {len(sizes)} size(s) x {self.pieces.L + 1} pieces...")
        try:
            for size in reversed(sizes):
                self.sizes[size] = self._capture(size)
        except Exception as e:                    # an op the graph cannot hold, out of memory
            self.why_eager = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            notice(f"cuda graphs: capture failed ({self.why_eager}); running eager")
            self.sizes, self.kept = {}, ()
            return self
        self.capture_s = round(time.perf_counter() - t0, 2)
        P, per_row = 16, -(-(CONTEXT + 1) // 16)
        cache = make_cache(per_row * sizes[-1], P)
        self.timings = [self._judge(size, cache, per_row, P) for size in sizes]
        self.kept = tuple(t.size for t in self.timings if t.choice == "graph")
        return self

    def _judge(self, size: int, cache, per_row: int, P: int) -> SizeTiming:
        """One size: a decode step of `size` rows after CONTEXT cached tokens, graphs vs eager."""
        cfg, dev = self.model.config, self.model.device
        g = torch.Generator().manual_seed(size)
        ids = torch.randint(cfg.vocab_size, (1, size), generator=g).to(dev)
        pos = torch.full((size,), CONTEXT, dtype=torch.long, device=dev)
        tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(size)]

        def prepared():
            cache.prepare([1] * size, [CONTEXT + 1] * size, tables)
            return cache
        eager = lambda: self.model(ids, pos, prepared())[0]                          # noqa: E731
        graph = lambda: self.model.lm_head(self.sizes[size].replay(ids, pos, prepared()))  # noqa: E731
        want, got = eager(), graph().clone()                                    # (M', V)
        diff = (got - want).abs().max().item()
        agree = torch.equal(got.argmax(-1), want.argmax(-1)) and \
            diff <= ATOL_REL * want.abs().max().item()
        t_e, t_g = [], []
        for r in range(self.config.rounds):             # alternate which goes first
            a, b = (eager, graph) if r % 2 == 0 else (graph, eager)
            ta, tb = _timed(a, dev), _timed(b, dev)
            t_e.append(ta if r % 2 == 0 else tb)
            t_g.append(tb if r % 2 == 0 else ta)
        choice, won = _pick(t_e, t_g, agree, self.config.min_gain)
        faster = choice == "compiled"
        keep = faster or (agree and self.config.keep == "agreeing")
        return SizeTiming(size, round(statistics.median(t_e), 3), round(statistics.median(t_g), 3),
                          won, len(t_e), self.capture_s, diff, agree, "graph" if keep else "eager",
                          faster)

    def summary(self) -> str:
        """One line: which sizes replay graphs, with their speed-ups, and which stay eager, why."""
        if self.why_eager:
            return f"cuda graphs: none, the capture failed ({self.why_eager}); every step eager"
        if not self.timings:
            return "cuda graphs: not captured yet"
        part, largest = kept_and_eager(self.timings, self.kept)
        return (f"cuda graphs (piecewise, {self.pieces.L + 1} pieces, captured in "
                f"{self.capture_s:.1f} s; rows: speed-up over eager): {part}; steps over "
                f"{largest} rows run eager")

    def as_dict(self) -> dict:
        return {"capture_sizes": list(self.config.capture_sizes), "kept": list(self.kept),
                "why_eager": self.why_eager, "capture_s": self.capture_s,
                "pieces": self.pieces.L + 1, "graph": self.graph.__name__,
                "timings": [t.__dict__ for t in self.timings]}


def _timed(fn, device) -> float:
    """ms of one call of fn, the device's queue drained before and after (CUDA runs async)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - t0)
