"""Compiled engine steps: everything between two attention calls compiled, once per padded size.

Letters: M rows of a step (its prefill chunks and decodes flattened), M' the padded size, L
layers, H/Hkv heads, D head dim, C model width, V vocab.

Inductor writes its own small-row GEMMs and fuses the norms, rotary, SwiGLU and residuals around
them. Paged attention changes shape every step, so it stays eager as one opaque op
(`minillm::paged_attention`, reading the step's metadata through `active_cache`); a graph is
compiled per size in `CompilationConfig.compile_sizes`, and a step of M rows runs the smallest
M' >= M with padding rows dropped before the logits. A size is kept only where it agrees with
eager and beats it on this machine (`compiled.compile_if_faster`); packages are compiled ahead of
time with AOTInductor (`step_body.compile_package`), cached per CPU, torch and thread count, and
checked against eager before use. Compiling never starts from a request (background_steps.py).

Left out on purpose: CUDA graphs (cuda_graph_steps.py), tensor parallelism, compiling the lm_head.
"""
import os
import statistics
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.kernels.compilation_config import (DEFAULT_SIZES, KEEP, CompilationConfig,  # noqa: F401
                                                compilation_config)
from minillm.kernels.compiled import _pick, _timed, inductor_cache_dir, reference_twin
from minillm.kernels.cpu_kernels import cpu_name, kernel_isa
from minillm.kernels.load_now import Watch
from minillm.kernels.step_body import (CONTEXT, _Body, active_cache, compile_package,  # noqa: F401
                                       example_inputs, paged_attention, weights_digest)
from minillm.kernels.tuning_cache import notice, read_tuned, write_tuned

ATOL_REL = 1e-3          # compiled logits within this fraction of the logits' largest magnitude
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
    saved: bool = False              # eager/compiled ms and the verdict read from an earlier run


def kept_and_eager(timings: list[SizeTiming], kept) -> tuple[str, int]:
    """The part of a summary line both step kinds share: "kept 1 (1.30x), 2 (1.10x); eager at 4
    (not faster)" (size, then speed-up over eager or why not kept), and the largest size kept (0)."""
    won = [t for t in timings if t.size in kept]
    lost = [t for t in timings if t.size not in kept]
    part = ("kept " + ", ".join(f"{t.size} ({t.eager_ms / t.compiled_ms:.2f}x)" for t in won)
            if won else "none kept")
    if lost:
        part += "; eager at " + ", ".join(
            f"{t.size} ({'disagrees' if not t.tokens_equal else 'not faster'})" for t in lost)
    return part, max((t.size for t in won), default=0)


_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> {config: steps}


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
        self.compile_missing = True                       # False: only load packages on disk

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
        save it (with `compile_missing` False, a missing package raises instead: a background
        compile left it to its child process). Raises what the compiler raises."""
        path = self.package_path(size, cache_dir)
        if os.path.exists(path):
            try:
                self._runners[size] = torch._inductor.aoti_load_package(path)
                self.loaded.append(size)
                return
            except Exception as e:            # corrupt or foreign: say so, compile afresh
                notice(f"compiled steps: {path} unreadable ({type(e).__name__}), compiling again")
        if not self.compile_missing:
            raise FileNotFoundError(f"no compiled package of {size} row(s) at {path}")
        if progress is not None:
            progress(f"compiling the engine step of {size} row(s)...")
        compile_package(self.body, ids, pos, path, cache_dir, self.config.mode)
        self._runners[size] = torch._inductor.aoti_load_package(path)

    def run(self, input_ids, positions, cache, rows: int, logits_index, return_hidden=False):
        """The step of `rows` real rows padded to input_ids (1, M'): logits (1, K, V) at
        `logits_index` (every real row when None), and with `return_hidden` also the final
        norm's output (1, rows, C)."""
        hidden = self._call(input_ids, positions, cache)[:rows][None]        # (1, M, C)
        picked = hidden if logits_index is None else hidden[:, logits_index]
        logits = self.model.lm_head(picked)                                  # (1, K, V)
        return (logits, hidden) if return_hidden else logits

    def verdict_path(self, cache_dir: str) -> str:
        """The file of this model's saved verdicts (which sizes beat eager here)."""
        self.package_path(1, cache_dir)                   # computes the digest once
        return os.path.join(cache_dir, f"verdicts_{self.config.mode}_{self._digest}.json")

    def _verdict_key(self) -> dict:
        return {"digest": self._digest, "mode": self.config.mode, "min_gain": self.config.min_gain,
                "cpu": cpu_name(), "isa": kernel_isa(), "torch": torch.__version__,
                "threads": torch.get_num_threads()}

    def saved_verdicts(self, cache_dir: str) -> dict:
        """{size: what a quiet earlier run measured} for this model, machine and config; {} when
        none (or the file is missing, corrupt or foreign)."""
        path = Path(self.verdict_path(cache_dir))
        data = read_tuned(path, self._verdict_key())
        return {int(k): v for k, v in data["sizes"].items()} if data else {}

    def _save_verdicts(self, cache_dir: str, timed: list, loads: list) -> None:
        """Save the timed sizes' verdicts, unless other work ran while they were timed (said in
        one line where the verdicts decide, `keep="faster"`)."""
        busy = [x for x in loads if x.busy(torch.get_num_threads())]
        if busy:
            if self.config.keep == "faster":
                    notice(f"compiled steps: the machine was busy while timing ({busy[0].describe()}); "
                       f"verdicts not saved, the next process times again")
            return
        path = Path(self.verdict_path(cache_dir))
        known = {str(k): v for k, v in self.saved_verdicts(cache_dir).items()}
        for t in timed:
            known[str(t.size)] = {"choice": "compiled" if t.faster else "eager",
                                  "eager_ms": t.eager_ms, "compiled_ms": t.compiled_ms,
                                  "won": t.won, "rounds": t.rounds}
        write_tuned(path, self._verdict_key(), {"sizes": known,
                                                "load": [x.as_record() for x in loads]})

    def _check(self, ids, pos, prepared) -> tuple[float, bool]:
        """(largest logit difference, agreement) of the compiled size against eager."""
        got = self.model.lm_head(self._call(ids, pos, prepared())[None])[0]    # (M', V)
        want = self.model(ids, pos, prepared())[0]                             # (M', V)
        diff = (got - want).abs().max().item()
        return diff, torch.equal(got.argmax(-1), want.argmax(-1)) and \
            diff <= ATOL_REL * want.abs().max().item()

    def _time(self, ids, pos, prepared, gate=None) -> tuple[list, list]:
        """Eager and compiled ms per step over `rounds` rounds, alternating which goes first.
        With a `gate` (an engine's StepClock) each round waits until the engine is idle and is
        timed again if the engine ran a step meanwhile."""
        eager = lambda: self.model(ids, pos, prepared())                      # noqa: E731
        comp = lambda: self.model.lm_head(self._call(ids, pos, prepared())[None])   # noqa: E731
        eager(), comp()
        t_e, t_c = [], []
        for r in range(self.config.rounds):
            a, b = (eager, comp) if r % 2 == 0 else (comp, eager)
            while True:
                token = gate.wait_idle() if gate is not None else None
                ta, tb = _timed(a), _timed(b)
                if gate is None or gate.unchanged(token):
                    break
            t_e.append(ta if r % 2 == 0 else tb)
            t_c.append(tb if r % 2 == 0 else ta)
        return t_e, t_c

    @torch.inference_mode()
    def compile(self, make_cache, progress=None, gate=None) -> "CompiledSteps":
        """Compile (or load) each size over a scratch cache (`make_cache(num_blocks, block_size)`,
        a paged cache like the engine's), check it against the eager model, and keep it where it
        agrees and wins: timed now, or as a quiet earlier run on this machine saved it (`keep=
        "faster"` only; a size saved as eager is not even loaded). A failing compiler keeps every
        size eager, with one line. `gate`: see `_time` (a compile in the background)."""
        cfg, sizes = self.model.config, self.config.compile_sizes
        P = 16
        per_row = -(-(CONTEXT + 1) // P)
        cache = make_cache(per_row * sizes[-1], P)
        cache_dir = self.config.cache_dir or inductor_cache_dir()
        saved = self.saved_verdicts(cache_dir) if self.config.keep == "faster" else {}
        kept, self.timings, timed, loads = [], [], [], []
        for size in sizes:
            ids, pos = example_inputs(cfg.vocab_size, size, self.model.device)
            tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(size)]

            def prepared():
                cache.prepare([1] * size, [CONTEXT + 1] * size, tables)
                return cache
            v = saved.get(size)
            if v is not None and v["choice"] == "eager":          # a quiet run said: not faster
                self.timings.append(SizeTiming(size, v["eager_ms"], v["compiled_ms"], v["won"],
                                               v["rounds"], 0.0, float("nan"), True, "eager",
                                               False, saved=True))
                continue
            t0 = time.perf_counter()
            try:
                self._build(size, ids, pos, cache_dir, progress)
                if gate is not None:
                    gate.wait_idle()              # a serving engine's model: between its steps
                diff, agree = self._check(ids, pos, prepared)
            except Exception as e:                # the compiler is missing or fails: eager
                self.why_eager = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                notice(f"compiled steps: the compiler failed ({self.why_eager}); running eager")
                self.kept = ()
                return self
            compile_s = time.perf_counter() - t0
            if v is not None:                                     # saved as faster: checked, kept
                t = SizeTiming(size, v["eager_ms"], v["compiled_ms"], v["won"], v["rounds"],
                               round(compile_s, 2), diff, agree,
                               "compiled" if agree else "eager", True, saved=True)
            else:
                watch = Watch()
                t_e, t_c = self._time(ids, pos, prepared, gate)
                loads.append(watch.read())
                choice, won = _pick(t_e, t_c, agree, self.config.min_gain)
                t = SizeTiming(size, round(statistics.median(t_e), 3),
                               round(statistics.median(t_c), 3), won, len(t_e),
                               round(compile_s, 2), diff, agree, choice, choice == "compiled")
                timed.append(t)
                if agree and self.config.keep == "agreeing":
                    t.choice = "compiled"
            self.timings.append(t)
            if t.choice == "compiled":
                kept.append(size)
        if timed:
            self._save_verdicts(cache_dir, timed, loads)
        self.kept = tuple(kept)
        return self

    def summary(self) -> str:
        """One line: which sizes run compiled, with their speed-ups, and which stay eager, why."""
        if self.why_eager:
            return f"compiled steps: none, the compiler failed ({self.why_eager}); every step eager"
        if not self.timings:
            return "compiled steps: not compiled yet"
        part, largest = kept_and_eager(self.timings, self.kept)
        saved = " (timings saved by an earlier quiet run)" if any(t.saved for t in self.timings) else ""
        return (f"compiled steps ({torch.get_num_threads()} thread(s), rows: speed-up over eager): "
                f"{part}; steps over {largest} rows run eager{saved}")

    def as_dict(self) -> dict:
        return {"compile_sizes": list(self.config.compile_sizes), "kept": list(self.kept),
                "why_eager": self.why_eager, "threads": torch.get_num_threads(),
                "timings": [t.__dict__ for t in self.timings]}
