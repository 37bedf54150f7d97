"""torch.compile for a decode step and a verify step, measured against eager on this machine.

Letters as in `llama.py`: B batch (1 here), T new tokens per call ("rows": 1 for a decode step,
N for a verify step), S_max cache slots, V vocab.

`compile_if_faster(model, rows=(1, 9))` compiles the forward once per row count, times it warm
against eager in alternating rounds (compile time reported apart), and keeps the compiled step
only where it won; eager stays the default. What inductor needs: static shapes (one graph per row
count), no host sync (a `StaticKVCache` masks all S_max slots instead of slicing), no graph breaks
(`fullgraph=True`), and by default `max-autotune-no-cudagraphs` with frozen weights, which packs a
copy of each weight for its own GEMMs. The compiled model is a `llama.py` `Transformer` sharing
the given model's parameters, so the routed `FlatTransformer` stays eager. Compiled code is tied
to the thread count it was built for.

Left out on purpose: batches above one, the engine's paged cache (compiled_steps.py), bfloat16,
GPUs (CUDA graphs: `lab/cuda_graphs.py`).
"""
import contextlib
import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from minillm._validate import check_int
from minillm.kernels.cpu_kernels import cpu_name, kernel_isa
from minillm.kernels.load_now import Watch
from minillm.kernels.tuning_cache import running_tuners
from minillm.model.kv_cache import KVCache, StaticKVCache
from minillm.model.llama import Transformer
from minillm.model.loading import cache_dir as minillm_cache_dir

MODES = ("default", "max-autotune-no-cudagraphs")   # torch.compile modes that make sense on a CPU
MIN_GAIN = 0.03       # compiled is kept where its median is at least 3% under eager's
RECOMPILE_LIMIT = 64  # graphs per code object while compiling (one per row count and model)


def inductor_cache_dir(base=None) -> str:
    """Where inductor keeps compiled code for this machine: `$MINILLM_CACHE/inductor/<key>`, the
    key hashing what the code and its autotuning depend on (CPU, instruction set, torch, threads)."""
    key = json.dumps({"cpu": cpu_name(), "isa": kernel_isa(), "torch": torch.__version__,
                      "threads": torch.get_num_threads()}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return os.path.join(minillm_cache_dir() / "inductor" if base is None else base, digest)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def reference_twin(model: Transformer) -> Transformer:
    """A plain `Transformer` (llama.py's forward, nn.Linear) sharing `model`'s parameters: no
    copy of the weights, whatever forward or matmul routes `model` itself runs."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a minillm Transformer, got {type(model).__name__}")
    with torch.device("meta"):
        twin = Transformer(model.config)
    try:
        twin.load_state_dict(model.state_dict(keep_vars=True), assign=True, strict=True)
    except RuntimeError as e:                   # replaced layers: other parameters than the reference's
        raise TypeError("model must have the reference Transformer's parameters (nn.Linear or routed "
                        f"projections; a quantized model is not compiled here): {e}") from None
    return twin.eval()


class CompiledForward:
    """`step(input_ids, positions)` -> logits (1, T, V): the model's reference forward compiled
    by inductor over its own `StaticKVCache` of `max_seq_len` slots (`.cache`), one graph per T.
    The first call at a new T compiles (seconds to minutes); `compile_s[T]` records how long that
    first call took. With `freezing` the weights are constants of the graph: a later change to
    the model's weights is not seen by a row count already compiled."""

    def __init__(self, model: Transformer, max_seq_len: int, mode: str = "max-autotune-no-cudagraphs",
                 freezing: bool = True):
        check_mode(mode)
        self.model = reference_twin(model)
        cfg = self.model.config
        check_int("max_seq_len", max_seq_len, 1, cfg.max_seq_len)
        self.cache = StaticKVCache(cfg, 1, max_seq_len, device=model.device, dtype=model.dtype)
        self.freezing = bool(freezing)
        self._fn = torch.compile(self.model, dynamic=False, fullgraph=True,
                                 mode=None if mode == "default" else mode)
        self.compile_s: dict[int, float] = {}

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[-1]
        if T in self.compile_s:
            return self._fn(input_ids, positions, self.cache)
        t0 = time.perf_counter()
        # compiler settings for this compile only, not for the process; autotuning's tables of
        # timings per kernel (printed to stderr by default) are not shown
        with _env("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir()), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch._inductor.config.patch(freezing=self.freezing, autotune_num_choices_displayed=0,
                                             max_autotune_report_choices_stats=False), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            out = self._fn(input_ids, positions, self.cache)
        self.compile_s[T] = time.perf_counter() - t0
        return out


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_rows(rows) -> tuple[int, ...]:
    """rows: an int >= 1 or a non-empty sequence of them -> a sorted tuple without repeats."""
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    if not rows:
        raise ValueError("rows must be an int >= 1 or a non-empty list of them, got none")
    return tuple(sorted({check_int("rows", r, 1) for r in rows}))


@dataclass
class StepTiming:
    """One row count's measurement: warm ms per step (median of rounds), the rounds compiled
    won, the first compiled call's seconds, the logits' largest difference from eager's, whether
    the greedy tokens agree, and the choice."""
    rows: int
    eager_ms: float
    compiled_ms: float
    compiled_won_rounds: int
    rounds: int
    compile_s: float
    max_abs_diff: float
    tokens_equal: bool
    choice: str                      # "eager" or "compiled"

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.compiled_ms


def _pick(t_eager: list, t_comp: list, agree: bool, min_gain: float) -> tuple[str, int]:
    """("compiled" or "eager", rounds compiled won): compiled only when its outputs agree with
    eager's, its median is `min_gain` under eager's, and it won most rounds (rounds that cannot
    separate the two keep eager)."""
    won = sum(c < e for c, e in zip(t_comp, t_eager))
    faster = statistics.median(t_comp) < (1 - min_gain) * statistics.median(t_eager)
    return ("compiled" if agree and faster and 2 * won > len(t_eager) else "eager"), won


class CompileChoice:
    """What `compile_if_faster` measured and kept. `timings` (one StepTiming per row count),
    `choice` ({T: "eager" or "compiled"}), and `step(input_ids, positions)`, which runs a call
    of T new tokens compiled where compiled won and eager elsewhere, both over one cache
    (`.cache`, a StaticKVCache; the eager model reads it unmasked, as a KVCache)."""

    def __init__(self, model, compiled: CompiledForward, timings: list[StepTiming], load: dict):
        self.model, self.compiled, self.timings, self.load = model, compiled, timings, load
        self.choice = {t.rows: t.choice for t in timings}
        self.cache = compiled.cache
        self.eager_cache = object.__new__(KVCache)                  # the same k, v tensors
        self.eager_cache.__dict__.update(self.cache.__dict__)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.choice.get(input_ids.shape[-1]) == "compiled":
            return self.compiled(input_ids, positions)
        return self.model(input_ids, positions, self.eager_cache)

    def as_dict(self) -> dict:
        return {"timings": [{**asdict(t), "speedup": round(t.speedup, 3)} for t in self.timings],
                "choice": {str(k): v for k, v in self.choice.items()}, "load": self.load,
                "threads": torch.get_num_threads()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


@torch.inference_mode()
def compile_if_faster(model: nn.Module, rows=(1, 9), context: int = 64, rounds: int = 7,
                      steps: int = 3, mode: str = "max-autotune-no-cudagraphs", freezing: bool = True,
                      min_gain: float = MIN_GAIN, progress=None) -> CompileChoice:
    """Compile `model`'s forward for each row count in `rows` (1: a decode step; N: a verify
    step of N tokens) after `context` cached tokens, time it warm against the eager `model`
    (as it is: accelerated or plain, over a KVCache) in `rounds` alternating rounds of `steps`
    calls each, and keep compiled only where it won (`_pick`). `progress(line)` is called
    before each compile (they take seconds to minutes). -> CompileChoice."""
    rows = check_rows(rows)
    check_int("context", context, 1)
    check_int("rounds", rounds, 1)
    check_int("steps", steps, 1)
    compiled = CompiledForward(model, context + max(rows), mode, freezing)   # checks mode, model
    cfg, dev = model.config, model.device
    eager_cache = KVCache(cfg, 1, context + max(rows), device=dev, dtype=model.dtype)
    prompt = torch.randint(cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    model(prompt.to(dev), torch.arange(context, device=dev), eager_cache)
    compiled.model(prompt.to(dev), torch.arange(context, device=dev), compiled.cache)   # eager fill
    watch = Watch(exclude=running_tuners())          # other work while this times
    timings = []
    for T in rows:
        x = torch.randint(cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(dev)
        pos = torch.arange(context, context + T, device=dev)
        if progress is not None:
            progress(f"compiling the forward of {T} token(s) (batch 1, {context} cached)...")
        out_c = compiled(x, pos).clone()
        out_e = model(x, pos, eager_cache)
        eager = lambda: [model(x, pos, eager_cache) for _ in range(steps)]   # noqa: E731
        comp = lambda: [compiled(x, pos) for _ in range(steps)]              # noqa: E731
        eager(), comp()                                                      # warm both
        t_e, t_c = [], []
        for r in range(rounds):                     # alternate which goes first
            pair = (eager, comp) if r % 2 == 0 else (comp, eager)
            a, b = (_timed(f) / steps for f in pair)
            t_e.append(a if r % 2 == 0 else b)
            t_c.append(b if r % 2 == 0 else a)
        diff = (out_c - out_e).abs().max().item()
        equal = torch.equal(out_c.argmax(-1), out_e.argmax(-1))
        choice, won = _pick(t_e, t_c, equal, min_gain)
        timings.append(StepTiming(T, round(statistics.median(t_e), 3), round(statistics.median(t_c), 3),
                                  won, rounds, round(compiled.compile_s[T], 2), diff, equal, choice))
    during = watch.read()
    return CompileChoice(model, compiled, timings, {**during.as_record(),
                                                    "busy": during.busy(torch.get_num_threads())})


def format_choice(choice: CompileChoice) -> str:
    """One line per row count: eager and compiled ms, the ratio, compile seconds, the choice."""
    lines = [f"torch.compile (inductor) vs eager, batch 1, {torch.get_num_threads()} thread(s), "
             f"median of {choice.timings[0].rounds} alternating rounds"
             + (f"; the machine was busy (other work used {choice.load['others']:.1f} of "
                f"{choice.load['cores']} cores): these times measure the other work too"
                if choice.load.get("busy") else "")]
    for t in choice.timings:
        kind = "decode step" if t.rows == 1 else f"verify of {t.rows}"
        lines.append(f"  {kind:>13}: eager {t.eager_ms:7.2f} ms, compiled {t.compiled_ms:7.2f} ms "
                     f"({t.speedup:.2f}x, won {t.compiled_won_rounds}/{t.rounds} rounds), compile "
                     f"{t.compile_s:5.1f} s once, max |diff| {t.max_abs_diff:.1e} -> {t.choice}")
    return "\n".join(lines)
