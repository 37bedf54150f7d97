"""torch.compile against eager (chapter 1): SmolLM2's batch-1 decode step and verify steps of N
tokens after a cached context, warm ms per step in alternating rounds, the compile time apart,
and the choice `minillm.kernels.compiled.compile_if_faster` keeps (compiled only where it won).

    python -m benchmarks compile [--quick]

Eager is the model as `minillm.load_model` returns it on a CPU (the flat loop and the tuned or
probed matmul routes) over a KVCache; compiled is inductor's graph of the reference forward
(`max-autotune-no-cudagraphs`, frozen weights) over a StaticKVCache. --quick times the decode
step and a verify of 9; the full run adds N = 4 and 33. Each row count compiles once (a minute
or two on a 2-core CPU). Left out on purpose: batches above one, GPUs.
"""
import torch

from benchmarks.records import write_result
from minillm.kernels.compiled import compile_if_faster, format_choice
from minillm.model.loading import default_device

CONTEXT = 128


def run(quick: bool = False, device=None, out_dir=None, model=None,
        mode: str = "max-autotune-no-cudagraphs") -> dict:
    """Benchmark entry point (`python -m benchmarks` protocol): writes compile_cpu.json.
    `model` replaces SmolLM2 and `mode` the torch.compile mode (tests pass a tiny model and
    "default": max-autotune's kernel search is minutes on a cold inductor cache, and
    tests/kernels/test_compiled.py runs it). CPU only: elsewhere it writes nothing."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cpu":
        print("compile: skipped, measured on the CPU only (GPUs: benchmarks cuda_graphs)")
        return {"benchmark": "compile", "skipped": "measured on the CPU only"}
    if model is None:
        from minillm.llm import load_model
        model, _ = load_model(device="cpu")
    rows = (1, 9) if quick else (1, 4, 9, 33)
    choice = compile_if_faster(model, rows=rows, context=CONTEXT, rounds=5 if quick else 9,
                               steps=2 if quick else 3, mode=mode, progress=print)
    record = {"quick": quick, "model": model.config.name, "context": CONTEXT,
              "eager_forward": type(model).__name__,
              "mode": mode, "freezing": True, **choice.as_dict(),
              "units": {"eager_ms": "ms per warm step (median of alternating rounds)",
                        "compiled_ms": "ms per warm step (median of alternating rounds)",
                        "speedup": "eager_ms / compiled_ms",
                        "compile_s": "seconds of the first compiled call (compile + one step)",
                        "max_abs_diff": "largest |compiled - eager| logit"},
              "report": format_choice(choice)}
    record["path"] = str(write_result("compile", record, device, out_dir))
    return record


def report(r: dict) -> str:
    if "skipped" in r:
        return f"compile: skipped ({r['skipped']})"
    load = r["load"]
    said = (f"other work used {load['others']:.1f} of {load['cores']} cores while it timed" if "others" in load
            else f"load {load['before']:.1f} before, {load['after']:.1f} after on {load['cores']} cores")
    return f"{r['model']}, {r['context']} cached tokens, eager = {r['eager_forward']}; {said}\n" + r["report"]
