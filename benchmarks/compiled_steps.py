"""Compiled engine steps (chapter 1, chapter 4): what a step of N rows costs, eager and compiled,
against the roofline's line, and what batch 1 and batch 8 decode through the engine gain, beside
transformers, in one run.

    python -m benchmarks compiled_steps [--quick]

The model is SmolLM2-135M as `minillm.load_model` gives it on a CPU (the flat loop and its matmul
routes: "eager"). `CompiledSteps` compiles it for each size (max-autotune, frozen weights, the
paged attention left eager; kernels/compiled_steps.py) with `keep="agreeing"`, so every size is
timed; per size N it gives ms per step of N decode rows (64 cached tokens each), eager and
compiled, their ratio to N = 1, and the roofline's ratio for the same step on this machine's
measured ceilings. Then decode through `LLMEngine` at batch 1 and 8, eager and with the compiled
sizes the default rule keeps, and transformers' `generate` at the same batch, timed in turn in
the same rounds (`decode._ms_per_token`). The compile of each size is timed apart: the first
process on a machine pays inductor's code generation; `compile_s_cached` is a new process loading
the model and every size's package from disk, each checked (and timed again unless a quiet run
saved its verdicts: what a later one waits). Last, chapter 6's n-gram speculation through the
engine at batch 1 on the copy-style prompts, eager and compiled, against plain decoding.
--quick: sizes 1, 2, 4, 8 and 16 new tokens per request; the full run: sizes up to 32, 64 tokens.
Left out on purpose: GPUs (the CUDA-graph record is benchmarks/cuda_graphs.py), tensor parallelism.
"""
import json
import os
import subprocess
import sys

import torch

from benchmarks.decode import _equal_length_prompts, _ms_per_token, transformers_run
from benchmarks.records import write_result
from minillm.analysis.roofline import step_costs, step_time
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels import compiled_steps as cs
from minillm.kernels.load_now import Watch
from minillm.lab.measure import measure_hardware
from minillm.model.loading import default_device
from minillm.paging.paged_cache import CacheSpec

CONTEXT = cs.CONTEXT


def _step_roofline(cfg, hw, sizes) -> dict:
    """{N: the roofline's time of a step of N decode rows / that of 1 row} (64 cached each)."""
    t = {n: step_time(step_costs(cfg, n, 1, CONTEXT, "fp32"), hw, "fp32") for n in sizes}
    return {n: t[n] / t[sizes[0]] for n in sizes}


LATER = """
import json, sys, time
t0 = time.perf_counter()
import torch
from minillm.llm import load_model
from minillm.paging.paged_cache import CacheSpec
from minillm.kernels import compiled_steps as cs
sizes, mode = json.loads(sys.argv[1]), sys.argv[2]
model, _ = load_model(device="cpu")
cs.CompiledSteps(model, cs.CompilationConfig(compile_sizes=sizes, mode=mode, rounds=1)).compile(
    lambda n, p: CacheSpec(n, p).make(model.config, model.device))
print(json.dumps(time.perf_counter() - t0))
"""


def _later_process(sizes, mode) -> float:
    """Seconds a new process takes to load SmolLM2 and compile `sizes` with this run's artifacts
    on disk (inductor's caches under the minillm cache): what a second `LLM(...,
    compilation_config=...)` waits."""
    out = subprocess.run([sys.executable, "-c", LATER, json.dumps(list(sizes)), mode],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    return round(json.loads(out.stdout.strip().splitlines()[-1]), 2)


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None, hf=None,
        mode: str = "max-autotune-no-cudagraphs", sizes=None) -> dict:
    """Benchmark entry point (`python -m benchmarks` protocol): writes compiled_steps_cpu.json.
    Tests pass a tiny `model` (and tokenizer, transformers twin), mode "default" and fewer
    `sizes` (1 included)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cpu":
        print("compiled_steps: skipped, measured on the CPU only here")
        return {"benchmark": "compiled_steps", "skipped": "measured on the CPU only"}
    from minillm.model.hf_convert import to_hf_model
    own_model = model is None
    if model is None:
        from minillm.llm import load_model
        model, tok = load_model(device="cpu")
    hf = hf if hf is not None else to_hf_model(model)
    sizes = tuple(sizes) if sizes else (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32)
    n_new = 16 if quick else 64
    watch = Watch()
    hw = measure_hardware(model.device, dtypes=("fp32",), progress=False)
    make = lambda n, p: CacheSpec(n, p).make(model.config, model.device)    # noqa: E731
    measured = cs.CompiledSteps(model, cs.CompilationConfig(compile_sizes=sizes, mode=mode,
                                                            keep="agreeing", rounds=7))
    measured.compile(make, progress=print)
    cached_s = _later_process(sizes, mode) if own_model else None
    roof = _step_roofline(model.config, hw, sizes)
    t = {x.size: x for x in measured.timings}
    rows = [{"n": n, "eager_ms": t[n].eager_ms, "compiled_ms": t[n].compiled_ms,
             "speedup": round(t[n].eager_ms / t[n].compiled_ms, 3),
             "eager_ratio": round(t[n].eager_ms / t[1].eager_ms, 3),
             "compiled_ratio": round(t[n].compiled_ms / t[1].compiled_ms, 3),
             "roofline_ratio": round(roof[n], 3),
             "compiled_over_roofline": round(t[n].compiled_ms / t[1].compiled_ms / roof[n], 3),
             "compile_s": t[n].compile_s, "max_abs_diff": t[n].max_abs_diff,
             "tokens_equal": t[n].tokens_equal} for n in sizes]
    # decode through the engine: eager, and compiled where the default rule keeps a size (the
    # engine loads the packages just written and times each size again)
    cc = cs.CompilationConfig(compile_sizes=sizes, mode=mode)
    decode = {}
    for batch in (1, 8):
        prompts = _equal_length_prompts(tok, batch)
        base = dict(max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20)
        eager = LLMEngine(model, EngineConfig(**base))
        comp = LLMEngine(model, EngineConfig(**base, compilation_config=cc))
        kept = cs.compiled_steps_for(model, cc, None)                 # the engine's, shared
        params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)    # noqa: E731
        ms = _ms_per_token({"eager": lambda n: eager.generate(prompts, params(n)),
                            "compiled": lambda n: comp.generate(prompts, params(n)),
                            "transformers": transformers_run(hf, prompts)},
                           n_new, model.device, 3 if quick else 5)
        decode[f"batch{batch}"] = {f"{k}_ms_per_step": round(v, 3) for k, v in ms.items()} | {
            "compiled_over_eager": round(ms["eager"] / ms["compiled"], 3),
            "compiled_vs_transformers": round(ms["transformers"] / ms["compiled"], 3),
            "eager_vs_transformers": round(ms["transformers"] / ms["eager"], 3)}
    ngram = _ngram_engine(model, tok, cc, quick) if own_model else None
    during = watch.read()
    record = {"quick": quick, "model": model.config.name, "context": CONTEXT, "mode": mode,
              "threads": torch.get_num_threads(), "sizes": rows, "kept": list(kept.kept),
              "kept_summary": kept.summary(), "compile_s_cached": cached_s,
              "decode": decode, "ngram": ngram, "load": {**during.as_record(),
                                         "busy": during.busy(torch.get_num_threads())},
              "hardware": {"name": hw.name, "peak_flops": hw.peak("fp32"),
                           "mem_bandwidth": hw.mem_bandwidth},
              "units": {"eager_ms": "ms per step of N decode rows (median of alternating rounds)",
                        "roofline_ratio": "the roofline's step(N) / step(1) on this machine's ceilings",
                        "compile_s": "seconds of the first compiled call of a size",
                        "compile_s_cached": "seconds a new process takes to load the model and "
                                            "its sizes' packages, checked and timed again",
                        "*_ms_per_step": "ms per decode step through the engine / transformers",
                        "ngram": "ms per generated token through the engine at batch 1 on the "
                                 "copy-style prompts: plain eager, n-gram eager, n-gram compiled"}}
    record["path"] = str(write_result("compiled_steps", record, device, out_dir))
    print(report(record))
    return record


def _ngram_engine(model, tok, cc, quick: bool) -> dict:
    """Chapter 6's n-gram setup through the engine at batch 1 on its copy-style prompts: ms per
    generated token of plain eager decoding, n-gram speculation eager and n-gram with the
    compiled steps (a verify of K + 1 rows runs at the next compiled size), timed in turn in the
    same rounds; each output checked against plain decoding's."""
    from minillm.lab.prompts import NGRAM_SETUP, SPEC_PROMPTS
    from minillm.model.chat import encode_chat
    n_new, k = (24 if quick else NGRAM_SETUP["max_new_tokens"]), NGRAM_SETUP["num_speculative_tokens"]
    base = dict(max_num_seqs=1, kv_cache_memory_bytes=64 * 2**20)
    spec = dict(num_speculative_tokens=k, speculative_method="ngram",
                prompt_lookup_min=NGRAM_SETUP["min_ngram"], prompt_lookup_max=3)
    engines = {"plain": LLMEngine(model, EngineConfig(**base)),
               "ngram_eager": LLMEngine(model, EngineConfig(**base, **spec)),
               "ngram_compiled": LLMEngine(model, EngineConfig(**base, **spec, compilation_config=cc))}
    out = {}
    for name in (("summarize", "code_edit") if quick else tuple(SPEC_PROMPTS)):
        ids = encode_chat(tok, SPEC_PROMPTS[name])
        params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)    # noqa: E731
        toks = {e: eng.generate([ids], params(n_new))[0].token_ids for e, eng in engines.items()}
        ms = _ms_per_token({e: (lambda n, eng=eng: eng.generate([ids], params(n)))
                            for e, eng in engines.items()}, n_new, model.device, 3 if quick else 5)
        out[name] = {f"{e}_ms_per_token": round(v, 3) for e, v in ms.items()} | {
            "ngram_eager_speedup": round(ms["plain"] / ms["ngram_eager"], 3),
            "ngram_compiled_speedup": round(ms["plain"] / ms["ngram_compiled"], 3),
            "same_tokens": len({tuple(t) for t in toks.values()}) == 1}
    return out


def report(r: dict) -> str:
    if "skipped" in r:
        return f"compiled_steps: skipped ({r['skipped']})"
    lines = [f"{r['model']}, {r['threads']} thread(s), {r['context']} cached tokens per row, "
             f"{r['mode']}; other work used {r['load']['others']:.1f} of {r['load']['cores']} cores",
             f"{'N':>4} {'eager ms':>9} {'compiled':>9} {'speedup':>8} {'eager/1':>8} "
             f"{'comp/1':>7} {'roofline':>9} {'compile s':>10}"]
    for x in r["sizes"]:
        lines.append(f"{x['n']:>4} {x['eager_ms']:>9.1f} {x['compiled_ms']:>9.1f} {x['speedup']:>7.2f}x "
                     f"{x['eager_ratio']:>8.2f} {x['compiled_ratio']:>7.2f} {x['roofline_ratio']:>9.2f} "
                     f"{x['compile_s']:>10.1f}")
    if r["compile_s_cached"] is not None:
        lines.append(f"a later process, the packages on disk: {r['compile_s_cached']:.1f} s to "
                     f"load the model and its sizes, checked and timed again")
    lines.append(r["kept_summary"])
    for b, d in r["decode"].items():
        lines.append(f"{b}: eager {d['eager_ms_per_step']:.1f}, compiled "
                     f"{d['compiled_ms_per_step']:.1f}, transformers "
                     f"{d['transformers_ms_per_step']:.1f} ms/step -> compiled "
                     f"{d['compiled_over_eager']:.2f}x eager, {d['compiled_vs_transformers']:.2f}x "
                     f"transformers (eager {d['eager_vs_transformers']:.2f}x)")
    for name, d in (r.get("ngram") or {}).items():
        lines.append(f"n-gram, {name}: {d['ngram_eager_speedup']:.2f}x plain decoding eager, "
                     f"{d['ngram_compiled_speedup']:.2f}x with compiled steps"
                     f"{'' if d['same_tokens'] else ' (OUTPUTS DIFFER)'}")
    return "\n".join(lines)
