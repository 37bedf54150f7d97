"""Engine overhead benchmark: what `LLMEngine.step()` costs beyond the model's own arithmetic.

A tiny model with many layers (30 layers like SmolLM2-135M, but d_model 64) makes the arithmetic
negligible, so a decode step of the engine over it is almost all overhead: Python per step
(scheduler, bookkeeping, sampling) and per layer (paged KV writes, gathers, masks, small ops).
Three numbers per batch size B (1, 8, 32; every request decoding, steady state):
- `engine_ms`: median ms of one `engine.step()` with the tiny model, prompts of ragged lengths
  (8..15 tokens, so attention needs its padding mask as in real serving);
- `bare_ms`: median ms of the same model's bare forward of one token per row over a contiguous
  `KVCache` at the engine's mean context (what the model costs with the least machinery);
- `overhead_ms` = engine_ms - bare_ms: the engine's own cost;
and a count that explains them: `ops_per_step`, the ATen ops one engine step sends through
PyTorch's dispatcher (about 38 per layer with the flat forward), and `us_per_op` = engine_ms /
ops_per_step. With arithmetic this small every op costs about the same fixed few microseconds,
so an eager step costs roughly ops x that; fewer or fused ops (a compiler, a CUDA graph) is what makes it cheaper.
Each is measured twice, with the flat forward (`kernels/flat_forward.py`: one loop, no module
calls, what `load_model`'s models run on a CPU) and with the reference forward of `llama.py`
(`reference_*`), so one run shows what the flat loop saves. All are timed in turn, step by step,
with wall-clock medians: on a shared machine the absolute numbers move from run to run, their
ratios much less.
Beside them (not in quick mode, or when `model` is given) the real model's bare decode step at the
same batch sizes, so the reader sees what fraction of a real step the overhead is.

Not in quick mode, where git and this repository's history are at hand: the engine of
`baseline.ISSUE_BASE` (the code issue 13 measured) and this checkout's, each in its own process,
timed in turn in the same run (`baseline.py`), and their ratio: what "halve the engine's cost" is
measured against, on this machine.

Left out on purpose: prefill steps and mixed batches (their overhead is paid once per prompt, the
decode step's on every token), and GPUs' launch overhead (cuda_graphs.py measures that).
"""
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import baseline
from benchmarks.baseline import BATCHES, BLOCK_SIZE, PROMPT_LEN   # the sizes both time
from benchmarks.records import write_result
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.kernels.flat_forward import FlatTransformer, flatten, unflatten
from minillm.model.loading import tiny_model
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.common import prefilled


def overhead_model(n_layer: int = 30, device=None):
    """The many-layer tiny model: 30 layers of d_model 64 (arithmetic negligible)."""
    return tiny_model(vocab_size=256, n_layer=n_layer, device=device)


def _medians_ms(fns: dict, warmup: int, steps: int) -> dict:
    """Median ms of each function, called in turn (round-robin) so that a noisy neighbour on a
    shared machine slows them all alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def decoding_engine(model, batch: int, max_tokens: int) -> LLMEngine:
    """An engine with `batch` requests, all decoding: ragged prompts of PROMPT_LEN..+7 tokens,
    prefilled in the first step (done here)."""
    per_seq = -(-(PROMPT_LEN + 8 + max_tokens) // BLOCK_SIZE)
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=batch * per_seq,
                                           max_num_seqs=batch,
                                           max_num_batched_tokens=batch * (PROMPT_LEN + 8)))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    V = model.config.vocab_size
    for i in range(batch):
        engine.add_request([(7 * i + j) % V for j in range(PROMPT_LEN + i % 8)], params)
    engine.step()                                          # the prefill of every prompt
    assert len(engine.scheduler.running) == batch and not engine.scheduler.waiting
    return engine


def bare_decoder(model, batch: int, context: int):
    """A function running the model's bare forward of one token per row after `context` tokens
    cached in a contiguous `KVCache` (each call rewrites the same slot)."""
    _, forward = prefilled(model, batch, context, 1)
    x = torch.ones(batch, 1, dtype=torch.long, device=model.device)
    return lambda: forward(x)


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops that reach the dispatcher (each pays PyTorch's fixed cost per op)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def ops_per_step(model, batch: int) -> dict:
    """ATen ops of one decode `engine.step()` at `batch`: {"total": n, "per_layer": n / L,
    "top": the ten most frequent}. A count, the same on every machine: the engine's own cost is
    about this many ops times PyTorch's fixed cost per op (a few microseconds on a CPU)."""
    engine = decoding_engine(model, batch, 4)
    engine.step()                                        # one decode step first (warm paths)
    with _OpCounter() as counter:
        engine.step()
    total = sum(counter.counts.values())
    return {"total": total, "per_layer": round(total / model.config.n_layer, 1),
            "top": dict(counter.counts.most_common(10))}


def _switch(model, flat: bool):
    """The model with the flat forward (flat=True) or the reference's, in place."""
    return flatten(model) if flat else unflatten(model)


def _with_forward(model, flat: bool, fn):
    """fn, called with the model switched to the flat forward (flat=True) or the reference's."""
    def call():
        _switch(model, flat)
        return fn()
    return call


@torch.inference_mode()
def step_ms(model, batch: int, warmup: int = 3, steps: int = 20) -> dict:
    """Median ms per decode step at `batch`, with the flat forward (`flat_forward.py`, what
    `load_model`'s models run on a CPU) and with the reference forward of `llama.py`:
    {"engine", "bare", "reference_engine", "reference_bare"}: `LLMEngine.step()` and the bare
    forward (at the engine's mean context half way through the timed steps). All four are timed
    in turn, step by step."""
    was_flat = isinstance(model, FlatTransformer)
    context = PROMPT_LEN + 4 + warmup + steps // 2
    fns = {}
    for flat, tag in ((True, ""), (False, "reference_")):
        _switch(model, flat)                  # the prefill step runs with the forward it times
        fns[tag + "engine"] = _with_forward(model, flat, decoding_engine(model, batch,
                                                                         warmup + steps + 1).step)
        fns[tag + "bare"] = _with_forward(model, flat, bare_decoder(model, batch, context))
    try:
        return _medians_ms(fns, warmup, steps)
    finally:
        _switch(model, was_flat)


def _baseline(threads: int) -> dict:
    """baseline.compare against the issue's commit, or {"skipped": why} where it cannot run."""
    try:
        return baseline.compare(baseline.ISSUE_BASE, threads=threads)
    except (RuntimeError, ValueError) as e:          # no git, no history (a wheel, a shallow clone)
        return {"skipped": str(e).splitlines()[0]}


def run(quick: bool = False, device=None, out_dir=None, model=None, threads: int | None = 1) -> dict:
    """Measure and write benchmarks/results/overhead_<device>.json; return the record.

    `threads`: torch threads for the tiny model (1 by default: its ops are too small to split,
    and with more threads on a busy machine each op waits at a barrier for a descheduled thread,
    which times the machine's scheduler, not the engine; None keeps torch's setting). The real
    model runs with torch's setting."""
    tiny = overhead_model(device=device)
    warmup, steps = (2, 7) if quick else (5, 40)
    rows, saved = {}, torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        for b in BATCHES:
            ms = step_ms(tiny, b, warmup, steps)
            ops = ops_per_step(_switch(tiny, True), b)
            ref_ops = ops_per_step(_switch(tiny, False), b)
            rows[f"batch{b}"] = {"engine_ms": round(ms["engine"], 3),
                                 "bare_ms": round(ms["bare"], 3),
                                 "overhead_ms": round(ms["engine"] - ms["bare"], 3),
                                 "ops_per_step": ops["total"], "ops_per_layer": ops["per_layer"],
                                 "us_per_op": round(1e3 * ms["engine"] / ops["total"], 2),
                                 "top_ops": ops["top"],
                                 "reference_engine_ms": round(ms["reference_engine"], 3),
                                 "reference_bare_ms": round(ms["reference_bare"], 3),
                                 "reference_ops_per_step": ref_ops["total"],
                                 "reference_over_flat": round(ms["reference_engine"] / ms["engine"], 2)}
    finally:
        torch.set_num_threads(saved)
    if model is None and not quick:
        from minillm.llm import load_model
        model, _ = load_model(device=device)
    real = None
    if model is not None:
        with torch.inference_mode():
            was_flat, real, real_ref = isinstance(model, FlatTransformer), {}, {}
            try:
                for b in BATCHES:
                    decode = bare_decoder(model, b, 128)
                    ms = _medians_ms({"flat": _with_forward(model, True, decode),
                                      "reference": _with_forward(model, False, decode)},
                                     2, 5 if quick else 10)
                    real[f"batch{b}"] = round(ms["flat"], 3)
                    real_ref[f"batch{b}"] = round(ms["reference"], 3)
            finally:
                _switch(model, was_flat)
    cfg = tiny.config
    record = {"quick": quick, "tiny_model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model,
                                             "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head},
              "prompt_len": PROMPT_LEN, "block_size": BLOCK_SIZE, "timed_steps": steps,
              "tiny_model_threads": threads or saved,
              "units": {"engine_ms": "ms per engine.step() (median)",
                        "bare_ms": "ms per bare model forward, contiguous KVCache (median)",
                        "overhead_ms": "ms", "real_model_bare_ms": "ms per decode step (median)",
                        "ops_per_step": "ATen ops per engine.step()",
                        "reference_over_flat": "reference engine_ms / flat engine_ms",
                        "us_per_op": "engine_ms / ops_per_step, in microseconds"},
              **rows}
    if real is not None:
        record["real_model"] = model.config.name
        record["real_model_bare_ms"] = real
        record["real_model_reference_bare_ms"] = real_ref
    if not quick and tiny.device.type == "cpu":
        record["baseline"] = _baseline(threads or saved)
    record["path"] = str(write_result("overhead", record, tiny.device, out_dir))
    return record


def report(r: dict) -> str:
    real = r.get("real_model_bare_ms")
    lines = [f"engine overhead: tiny model of {r['tiny_model']['n_layer']} layers, d_model "
             f"{r['tiny_model']['d_model']}, {r['tiny_model_threads']} thread(s), medians of "
             f"{r['timed_steps']} steps"]
    for b in BATCHES:
        x = r[f"batch{b}"]
        line = (f"  batch {b:>2}: engine step {x['engine_ms']:.2f} ms, bare forward "
                f"{x['bare_ms']:.2f} ms -> engine overhead {x['overhead_ms']:.2f} ms")
        if "ops_per_step" in x:
            line += (f"; {x['ops_per_step']} ATen ops ({x['ops_per_layer']:.0f} per layer, "
                     f"{x['us_per_op']:.1f} us each)")
        if "reference_engine_ms" in x:
            line += (f"\n            reference forward: engine step {x['reference_engine_ms']:.2f} ms "
                     f"({x['reference_over_flat']:.2f}x the flat one), "
                     f"{x['reference_ops_per_step']} ATen ops")
        if real is not None:
            ref = r.get("real_model_reference_bare_ms", {}).get(f"batch{b}")
            line += (f"\n            {r['real_model']} bare step {real[f'batch{b}']:.1f} ms"
                     + (f" (reference forward {ref:.1f} ms)" if ref is not None else ""))
        lines.append(line)
    base = r.get("baseline")
    if base and "skipped" in base:
        lines.append(f"  against the engine of an earlier commit: skipped ({base['skipped']})")
    elif base:
        lines.append("  " + baseline.report(base).replace("\n", "\n  "))
    return "\n".join(lines)
