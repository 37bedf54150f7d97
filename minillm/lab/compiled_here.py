"""The compiled engine steps a chapter may use on this machine, and the committed record otherwise.

Letters: N rows of a step.

A chapter never compiles (minutes per size on a small CPU). `built_config(model, sizes)` returns
a `CompilationConfig` only when every size's package is on disk for this model, CPU, instruction
set, torch and thread count (`inductor_cache_dir()`), else None after one line naming the build
command (`BUILD`); it only checks that the files exist. Passed to `EngineConfig` or `step_times`,
the packages are loaded and checked against eager before use.
- `step_times(model, sizes)`: ms per step of N decode rows, eager and compiled, measured here or
  read from the committed `compiled_steps` record (`.origin` says which);
- `padded_costs(times, n_max)`: {n: ms}, each n at the cost of the smallest size that holds it;
- `engine_decode(model, batches)`, `engine_decode_ms(engines, prompts)`: ms per engine decode step.

Left out on purpose: compiling (`BUILD`, or `LLM(..., compilation_config=...)` in a process of
your own), quantized models (the compiler takes fp32).
"""
import os
from dataclasses import dataclass, field

import torch

from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels.compilation_config import DEFAULT_SIZES, CompilationConfig
from minillm.kernels.compiled import inductor_cache_dir
from minillm.kernels.compiled_steps import CONTEXT, CompiledSteps
from minillm.lab.common import load_results, per_token_ms
from minillm.lab.machine import COURSE_THREADS, record_origin
from minillm.paging.paged_cache import PagedKVCache

BUILD = "python -m benchmarks compiled_steps --quick"


def build_command(threads: int | None = None) -> str:
    """The command that builds the packages for `threads` (default: this process's count)."""
    threads = torch.get_num_threads() if threads is None else threads
    return BUILD if threads == COURSE_THREADS else f"{BUILD} --threads {threads}"


def missing_sizes(model, config: CompilationConfig) -> list[int]:
    """The sizes of `config` whose package is not on disk for `model` here (none: all built)."""
    folder = config.cache_dir or inductor_cache_dir()
    steps = CompiledSteps(model, config)              # hashes the weights once; compiles nothing
    return [n for n in config.compile_sizes if not os.path.exists(steps.package_path(n, folder))]


def built_config(model, sizes=DEFAULT_SIZES, say=print, **fields) -> CompilationConfig | None:
    """A `CompilationConfig(compile_sizes=sizes, **fields)` when every size's package is on disk
    for `model` here, else None after `say(...)` has been given one line with the command that
    builds them. Never loads or compiles anything."""
    config = CompilationConfig(compile_sizes=tuple(sizes), **fields)
    missing = missing_sizes(model, config)
    if not missing:
        return config
    t = torch.get_num_threads()
    say(f"no compiled packages here for {t} thread{'s' if t != 1 else ''} (sizes "
        f"{', '.join(map(str, missing))} missing): `{build_command()}` builds them, minutes per "
        f"size; the committed record instead")
    return None


def compiled_record(threads: int | None = None) -> dict | None:
    """The newest committed `compiled_steps` record measured at `threads` torch threads (default:
    this process's), or None."""
    threads = torch.get_num_threads() if threads is None else threads
    recs = [r for r in load_results("compiled_steps")
            if (r.get("machine") or {}).get("torch_threads") == threads and "sizes" in r]
    return max(recs, key=lambda r: r["machine"].get("date", "")) if recs else None


@dataclass
class StepTimes:
    """ms per step of N decode rows, eager and compiled ({N: ms}), and where they come from."""
    eager: dict
    compiled: dict
    origin: str                       # "measured here (...)" or a record's `record_origin`
    record: dict | None = field(default=None, repr=False)

    def ratio(self, n: int, compiled: bool) -> float:
        """step(n) / step(1) of one kind, n run at the smallest measured size >= n."""
        t = self.compiled if compiled else self.eager
        return t[_holding(t, n)] / t[1]


def _holding(times: dict, n: int) -> int:
    fits = [s for s in sorted(times) if s >= n]
    if not fits:
        raise ValueError(f"no size holds {n} rows: sizes go up to {max(times)}")
    return fits[0]


def step_times(model, sizes=DEFAULT_SIZES, rounds: int = 3, say=print) -> StepTimes | None:
    """Eager and compiled ms per step of N rows for N in `sizes` (1 included): measured here when
    the packages are built (loaded, each checked to give eager's greedy tokens, then timed in
    `rounds` alternating rounds), else from the committed record for this thread count; None
    when there is neither."""
    sizes = tuple(sizes)
    if 1 not in sizes:
        raise ValueError(f"sizes must include 1 (the decode step), got {sizes}")
    config = built_config(model, sizes, say=say, keep="agreeing", rounds=rounds)
    if config is not None:
        steps = CompiledSteps(model, config).compile(lambda n, p: PagedKVCache(model.config, n, p))
        if steps.why_eager:
            say(f"the compiled packages did not run here ({steps.why_eager})")
        else:
            if not all(t.tokens_equal for t in steps.timings):
                raise AssertionError("a compiled size changed a greedy token")
            return StepTimes({t.size: t.eager_ms for t in steps.timings},
                             {t.size: t.compiled_ms for t in steps.timings},
                             f"{_here()}, {CONTEXT} cached tokens per row")
    rec = compiled_record()
    if rec is None:
        say(f"and no committed compiled_steps record at {torch.get_num_threads()} thread(s)")
        return None
    rows = {x["n"]: x for x in rec["sizes"] if x["n"] in sizes}
    return StepTimes({n: x["eager_ms"] for n, x in rows.items()},
                     {n: x["compiled_ms"] for n, x in rows.items()}, record_origin(rec), rec)


def _here() -> str:
    t = torch.get_num_threads()
    load = f", load {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return f"measured here ({t} thread{'s' if t != 1 else ''}{load})"


def engine_decode(model, batches=(1, 8), prompt_len: int = 32, n_new: int = 16, rounds: int = 3,
                  say=print) -> tuple[dict, str] | None:
    """({batch: {"eager": ms, "compiled": ms}}, where from): ms per decode step through the
    engine for `batch` random prompts of `prompt_len` tokens, eager and compiled (sizes
    `batches`) timed in the same rounds, when their packages are built; else the committed
    record's (which adds "transformers", its `generate` at the same batch); None when neither."""
    batches = tuple(batches)
    config = built_config(model, batches, say=say, keep="agreeing", rounds=rounds)
    if config is not None:
        base = dict(max_num_seqs=max(batches), kv_cache_memory_bytes=64 * 2**20)
        engines = {"eager": LLMEngine(model, EngineConfig(**base)),
                   "compiled": LLMEngine(model, EngineConfig(**base, compilation_config=config))}
        steps = engines["compiled"].runner.compiled
        if steps is not None and tuple(steps.kept) == batches:
            g = torch.Generator().manual_seed(0)
            out = {}
            for b in batches:
                prompts = torch.randint(model.config.vocab_size, (b, prompt_len), generator=g)
                out[b] = engine_decode_ms(engines, prompts.tolist(), n_new, rounds)
            return out, _here()
        say("the compiled packages did not run here (" + (steps.why_eager if steps else "none") + ")")
    rec = compiled_record()
    if rec is None or any(f"batch{b}" not in rec.get("decode", {}) for b in batches):
        say(f"and no committed record of batches {batches} at {torch.get_num_threads()} thread(s)")
        return None
    return ({b: {k.removesuffix("_ms_per_step"): v for k, v in rec["decode"][f"batch{b}"].items()
                 if k.endswith("_ms_per_step")} for b in batches}, record_origin(rec))


def padded_costs(times: dict, n_max: int) -> dict:
    """{n: ms} for n = 1..n_max from {size: ms}: each n costs what the smallest size >= n costs."""
    return {n: times[_holding(times, n)] for n in range(1, n_max + 1)}


@torch.inference_mode()
def engine_decode_ms(engines: dict, prompts: list[list[int]], n_new: int = 16,
                     rounds: int = 3) -> dict:
    """{name: ms per decode step} of each engine generating `n_new` tokens for every prompt
    (`common.per_token_ms`: the prefill cancels, the engines alternate within each round)."""
    def run(engine):
        return lambda n: engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return per_token_ms({name: run(e) for name, e in engines.items()}, n_new, rounds)
