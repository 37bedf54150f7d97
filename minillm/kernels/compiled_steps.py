"""Compiled engine steps: everything between two attention calls compiled, once per padded size.

Letters: M rows of a step (its prefill chunks and decodes flattened), M' the padded size, L
layers, H/Hkv heads, D head dim, C model width, V vocab.

An engine step's cost is mostly its matmuls, and at 2-64 rows the library matmuls of an eager
forward cost far more than the roofline says (chapter 1). Inductor, with the weights frozen into
the graph and max-autotune, writes its own small-row GEMMs and fuses the norms, the rotary
embedding, the SwiGLU and the residual adds around them. Two things stand in its way inside the
engine, and the way vLLM answers them on a GPU is the one taken here:

- **The paged attention changes shape every step** (each sequence's context and block table).
  It is left eager: it enters the graph as one opaque op, `minillm::paged_attention`, which
  inductor calls as it is, so what is compiled is the pieces between two attention calls (the
  output projection and residual of one layer, the MLP, the next layer's norm, q/k/v projection
  and rotation). The op reads the step's metadata from the cache the runner hands over
  (`active_cache`), never from a tensor the graph holds.
- **Every step has another row count.** A graph is compiled for each size in
  `CompilationConfig.compile_sizes` (vLLM's name), and a step of M rows runs the graph of the
  smallest size M' >= M: the runner adds M' - M padding rows (token 0 at position 0 of a scratch
  block no sequence owns), and their rows are dropped before the logits. Steps larger than every
  kept size run eager.

A size is kept only where its compiled step agrees with the eager one (the same greedy token on
every row, logits within `ATOL_REL` of their scale) and beats it on this machine (the rule of
`compiled.compile_if_faster`: median `min_gain` under eager's and most rounds won, over a scratch
cache of its own), and `summary()` says in one line what was kept. The lm_head stays eager: it
reads only the rows that sample (a prefill chunk samples one), through the model's own routes.

Each size is compiled ahead of time into a package on disk (AOTInductor: `torch.export` of the
step, then `aoti_compile_and_package`, the weights frozen and prepacked inside) under the minillm
cache, in a folder keyed by CPU, instruction set, torch and thread count (`inductor_cache_dir`),
named by a hash of the weights (`weights_digest`). A later process loads the package in about a
second instead of compiling for minutes; the price is disk, about one copy of the weights per size.
A package that does not load is compiled again, with one line; every size, loaded or compiled, is
checked against eager before it is used, so a wrong package can cost time, never an answer.
Compiling is never started by a request: it happens when an engine is built with
`compilation_config` (progress on stderr), and a machine where the compiler fails runs eager, with
one line saying why.

Left out on purpose: CUDA graphs (on a CUDA device the engine captures and replays the same
pieces per size instead: cuda_graph_steps.py), tensor parallelism (refused), compiling the
lm_head, and saving the kept/eager verdicts (each process times its sizes again, seconds).
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.kernels.compilation_config import (DEFAULT_SIZES, KEEP, CompilationConfig,  # noqa: F401
                                                compilation_config)
from minillm.kernels.compiled import _env, _pick, _timed, inductor_cache_dir, reference_twin
from minillm.kernels.tuning_cache import notice
from minillm.model.llama import rope_cos_sin

ATOL_REL = 1e-3          # compiled logits within this fraction of the logits' largest magnitude
CONTEXT = 64             # cached tokens per row while sizes are timed
_ACTIVE: list = [None]   # the paged cache the compiled graphs' attention op reads this call


@contextlib.contextmanager
def active_cache(cache):
    """Make `cache` (a PagedKVCache, `prepare`d for this step) the one the attention op reads."""
    _ACTIVE[0] = cache
    try:
        yield
    finally:
        _ACTIVE[0] = None


@torch.library.custom_op("minillm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q (M, H, D), k/v (M, Hkv, D) -> (M, H, D): the active cache's `attend_rows` (write the new
    K/V through its slot mapping, attend over its block tables), opaque to the compiler."""
    cache = _ACTIVE[0]
    if cache is None:
        raise RuntimeError("minillm::paged_attention called outside active_cache(...)")
    return cache.attend_rows(layer, q, k, v).contiguous()


@paged_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)                                   # contiguous, as the real one


class _Body(nn.Module):
    """Embedding, every layer (attention through the opaque op) and the final norm: (1, M) ids,
    (M,) positions -> hidden (M, C). The arithmetic of `llama.py`, one row per token."""

    def __init__(self, twin):
        super().__init__()
        self.twin = twin

    def forward(self, input_ids, positions):
        m, cfg = self.twin, self.twin.config
        H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        M = input_ids.shape[1]
        cos, sin = rope_cos_sin(positions, D, cfg.rope_theta, m.dtype)    # (M, D)
        cos, sin = cos[:, None], sin[:, None]                              # (M, 1, D)
        x = m.embed(input_ids[0])                                          # (M, C)
        for i, blk in enumerate(m.layers):
            qkv = blk.attn.qkv_proj(blk.input_norm(x)).view(M, H + 2 * Hkv, D)
            qk = qkv[:, :H + Hkv]
            qk = qk * cos + torch.cat([-qk[..., D // 2:], qk[..., :D // 2]], -1) * sin
            y = paged_attention(qk[:, :H], qk[:, H:], qkv[:, H + Hkv:], i)   # (M, H, D)
            x = x + blk.attn.o_proj(y.reshape(M, H * D))
            x = x + blk.mlp(blk.post_attn_norm(x))
        return m.norm(x)                                                   # (M, C)


@dataclass
class SizeTiming:
    """One padded size: eager and compiled ms per step (medians), rounds compiled won, the
    compile's seconds, the logits' largest difference, whether greedy tokens agree, the choice."""
    size: int
    eager_ms: float
    compiled_ms: float
    won: int
    rounds: int
    compile_s: float
    max_abs_diff: float
    tokens_equal: bool
    choice: str
    faster: bool                     # what the "faster" rule says, whatever `keep` chose


_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {config: steps}


def weights_digest(model) -> str:
    """A hash of the model's config and every parameter's bytes (about a second for 135M)."""
    h = hashlib.sha1(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def compiled_steps_for(model, config: CompilationConfig, make_cache, progress=None) -> "CompiledSteps":
    """`model`'s compiled steps for `config`, compiled and judged once per process: engines built
    later over the same model and config share them (the graphs hold the weights as they were
    when compiled: change the weights, and build a new model)."""
    made = _MADE.setdefault(model, {})
    if config not in made:
        made[config] = CompiledSteps(model, config).compile(make_cache, progress)
    return made[config]


class CompiledSteps:
    """The compiled pieces of `model` for the sizes of `config`; `compile()` builds and judges
    them, `padded(M)` says the size a step of M rows runs at (None: eager), `run(...)` runs it."""

    def __init__(self, model, config: CompilationConfig):
        self.model, self.config = model, config
        self.body = _Body(reference_twin(model)).eval()   # TypeError for a quantized model
        self._runners: dict = {}                          # size -> its loaded package
        self._digest = None                               # weights_digest(model), once
        self.loaded: list = []                            # sizes read from disk, not compiled
        self.kept: tuple = ()
        self.timings: list[SizeTiming] = []
        self.why_eager = ""                               # set when nothing could compile

    def padded(self, rows: int) -> int | None:
        """The kept size a step of `rows` rows runs at, or None (eager)."""
        for s in self.config.compile_sizes:
            if s >= rows:
                return s if s in self.kept else None
        return None

    def _call(self, input_ids, positions, cache):
        with active_cache(cache):
            return self._runners[input_ids.shape[1]](input_ids, positions)     # (M', C)

    def package_path(self, size: int, cache_dir: str) -> str:
        """The compiled package of one size: named by the size, the mode and a hash of the
        weights and config, so another model's package is never read for this one."""
        if self._digest is None:                          # hashing 135M weights takes a second
            self._digest = weights_digest(self.model)
        return os.path.join(cache_dir, f"step{size}_{self.config.mode}_{self._digest}.pt2")

    def _build(self, size: int, ids, pos, cache_dir: str, progress) -> None:
        """Load the package of `size` from disk, or (missing, unreadable) export, compile and
        save it. Raises what the compiler raises."""
        path = self.package_path(size, cache_dir)
        if os.path.exists(path):
            try:
                self._runners[size] = torch._inductor.aoti_load_package(path)
                self.loaded.append(size)
                return
            except Exception as e:            # corrupt or foreign: say so, compile afresh
                notice(f"compiled steps: {path} unreadable ({type(e).__name__}), compiling again")
        if progress is not None:
            progress(f"compiling the engine step of {size} row(s)...")
        opts = {"freezing": True, "autotune_num_choices_displayed": 0,
                "max_autotune_report_choices_stats": False,
                **({"max_autotune": True} if self.config.mode != "default" else {})}
        os.makedirs(cache_dir, exist_ok=True)
        with _env("TORCHINDUCTOR_CACHE_DIR", cache_dir), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            program = torch.export.export(self.body, (ids, pos))
            tmp = f"{path}.{os.getpid()}.tmp.pt2"
            torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                                     inductor_configs=opts)
        os.replace(tmp, path)                 # atomic: a reader sees a whole package or none
        self._runners[size] = torch._inductor.aoti_load_package(path)

    def run(self, input_ids, positions, cache, rows: int, logits_index, return_hidden=False):
        """The step of `rows` real rows padded to input_ids (1, M'): logits (1, K, V) at
        `logits_index` (every real row when None), and with `return_hidden` also the final
        norm's output (1, rows, C)."""
        hidden = self._call(input_ids, positions, cache)[:rows][None]        # (1, M, C)
        picked = hidden if logits_index is None else hidden[:, logits_index]
        logits = self.model.lm_head(picked)                                  # (1, K, V)
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def compile(self, make_cache, progress=None) -> "CompiledSteps":
        """Compile each size over a scratch cache (`make_cache(num_blocks, block_size)`, a paged
        cache like the engine's), time it against the eager model and keep it where it agrees
        and wins. A failing compiler keeps every size eager, with one line."""
        cfg, sizes = self.model.config, self.config.compile_sizes
        P = 16
        per_row = -(-(CONTEXT + 1) // P)
        cache = make_cache(per_row * sizes[-1], P)
        cache_dir = self.config.cache_dir or inductor_cache_dir()
        kept, self.timings = [], []
        g = torch.Generator().manual_seed(0)
        for size in sizes:
            ids = torch.randint(cfg.vocab_size, (1, size), generator=g).to(self.model.device)
            pos = torch.full((size,), CONTEXT, dtype=torch.long, device=self.model.device)
            tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(size)]

            def prepared():
                cache.prepare([1] * size, [CONTEXT + 1] * size, tables)
                return cache
            t0 = time.perf_counter()
            try:
                self._build(size, ids, pos, cache_dir, progress)
                hidden = self._call(ids, pos, prepared())
            except Exception as e:                # the compiler is missing or fails: eager
                self.why_eager = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                notice(f"compiled steps: the compiler failed ({self.why_eager}); running eager")
                self.kept = ()
                return self
            compile_s = time.perf_counter() - t0
            got = self.model.lm_head(hidden[None])[0]                          # (M', V)
            want = self.model(ids, pos, prepared())[0]                         # (M', V)
            diff = (got - want).abs().max().item()
            agree = torch.equal(got.argmax(-1), want.argmax(-1)) and \
                diff <= ATOL_REL * want.abs().max().item()
            eager = lambda: self.model(ids, pos, prepared())                  # noqa: E731
            comp = lambda: self.model.lm_head(self._call(ids, pos, prepared())[None])   # noqa: E731
            eager(), comp()
            t_e, t_c = [], []
            for r in range(self.config.rounds):             # alternate which goes first
                a, b = (eager, comp) if r % 2 == 0 else (comp, eager)
                ta, tb = _timed(a), _timed(b)
                t_e.append(ta if r % 2 == 0 else tb)
                t_c.append(tb if r % 2 == 0 else ta)
            choice, won = _pick(t_e, t_c, agree, self.config.min_gain)
            faster = choice == "compiled"
            if agree and self.config.keep == "agreeing":
                choice = "compiled"
            self.timings.append(SizeTiming(size, round(statistics.median(t_e), 3),
                                           round(statistics.median(t_c), 3), won, len(t_e),
                                           round(compile_s, 2), diff, agree, choice, faster))
            if choice == "compiled":
                kept.append(size)
        self.kept = tuple(kept)
        return self

    def summary(self) -> str:
        """One line: which sizes run compiled, with their speed-ups, and which stay eager, why."""
        if self.why_eager:
            return f"compiled steps: none, the compiler failed ({self.why_eager}); every step eager"
        if not self.timings:
            return "compiled steps: not compiled yet"
        won = [t for t in self.timings if t.size in self.kept]
        lost = [t for t in self.timings if t.size not in self.kept]
        part = ("kept " + ", ".join(f"{t.size} ({t.eager_ms / t.compiled_ms:.2f}x)" for t in won)
                if won else "none kept")
        if lost:
            part += "; eager at " + ", ".join(
                f"{t.size} ({'disagrees' if not t.tokens_equal else 'not faster'})" for t in lost)
        return (f"compiled steps ({torch.get_num_threads()} thread(s), rows: speed-up over eager): "
                f"{part}; steps over {max(won, key=lambda t: t.size).size if won else 0} rows run eager")

    def as_dict(self) -> dict:
        return {"compile_sizes": list(self.config.compile_sizes), "kept": list(self.kept),
                "why_eager": self.why_eager, "threads": torch.get_num_threads(),
                "timings": [t.__dict__ for t in self.timings]}
