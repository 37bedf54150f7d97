"""Quantized roofline (chapter 7): batch-1 decode of the real model per weight format and path.

Formats: fp32 (as `load_model` gives it, the CPU routes tuned for this machine), bf16, int8 per
channel, int4 in groups of 32 (round-to-nearest) and "gguf" (the shipped Q4_1 blocks; the same
numbers as int4 g32 here, read from the file instead). Each quantized one runs the fused kernel
("fast", where `auto` found one) and the dequantize-then-matmul reference. Each format's floor
is its weight bytes (`quantized_bytes`: one decode step reads every weight once, the fp32
embedding as lm_head) over the read bandwidth measured in the same process. ms/token is
(t(N new tokens) - t(1)) / (N - 1), as in `benchmarks/decode.py`, so the prefill is not counted; each
time is the fastest of a few runs, and the bandwidth the higher of two measurements.

Left out on purpose: batch > 1 (the kernels' cost curve), gptq / awq (same format and speed as
int4: only the numbers in the weights differ), KV-cache formats.
"""
import copy
import gc
import time

import torch

from benchmarks.records import machine_info, write_result
from minillm.lab.common import sync
from minillm.lab.measure import measure_bandwidth
from minillm.model.chat import encode_chat
from minillm.model.generate import generate
from minillm.llm import load_model            # the front door: CPU routes switched on
from minillm.quant.api import quantize, quantized_bytes, set_path

PROMPT = "Explain how a CPU cache works."
QUANTIZED = {"int8": dict(method="int8"), "int4_g32": dict(method="int4", group_size=32),
             "gguf": dict(method="gguf")}


@torch.inference_mode()
def _time(model, prompt, n_new, repeat) -> float:
    """ms per decode step: (t(n_new tokens) - t(1)) / (n_new - 1), each the fastest of `repeat`
    alternating runs (on a shared machine, interference only ever adds time)."""
    def run(n):
        sync(model.device)
        t0 = time.perf_counter()
        generate(model, prompt, n)
        sync(model.device)
        return time.perf_counter() - t0
    run(2)                                                      # warm-up: probes, allocations
    t_n, t_1 = float("inf"), float("inf")
    for _ in range(repeat):
        t_n, t_1 = min(t_n, run(n_new)), min(t_1, run(1))
    return round(1e3 * (t_n - t_1) / (n_new - 1), 2)


def _row(model, bandwidth, prompt, n_new, repeat, path=None) -> dict:
    ms = _time(model, prompt, n_new, repeat)
    counted = quantized_bytes(model)                 # after the run: fast-path copies exist now
    nbytes = counted["total"]
    floor = 1e3 * nbytes / bandwidth
    row = {"weight_bytes": nbytes, "floor_ms": round(floor, 3), "ms_per_token": ms,
           "fraction_of_floor": round(floor / ms, 3),
           "fast_path_copy_bytes": counted.get("fast_path_copies", 0)}
    if path is not None:
        kinds = {m.active_path() for m in model.modules() if hasattr(m, "active_path")}
        row["path"] = path if path == "reference" else "+".join(sorted(kinds))
    return row


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None) -> dict:
    """Measure and write benchmarks/results/quant_<device>.json; return the record."""
    if model is None:
        model, tok = load_model(device=device)
    n_new, repeat = (6, 1) if quick else (32, 3)
    n_ref = 3 if quick else 5                # the reference dequantizes every weight every step
    prompt = encode_chat(tok, PROMPT)
    bandwidth = max(measure_bandwidth(model.device) for _ in range(2))
    rows = {"fp32": _row(model, bandwidth, prompt, n_new, repeat)}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows["bf16"] = _row(bf16, bandwidth, prompt, n_new, repeat)
    del bf16
    for name, kwargs in QUANTIZED.items():
        q = quantize(copy.deepcopy(model), **kwargs)
        rows[f"{name}_fast"] = _row(q, bandwidth, prompt, n_new, repeat, path="auto")
        rows[f"{name}_reference"] = _row(set_path(q, "reference"), bandwidth, prompt, n_ref,
                                         min(repeat, 2), path="reference")
        del q
        gc.collect()
    ms = {k: v["ms_per_token"] for k, v in rows.items()}
    ratios = {"int4_g32_fast_vs_fp32": ms["fp32"] / ms["int4_g32_fast"],
              "int4_g32_fast_vs_bf16": ms["bf16"] / ms["int4_g32_fast"],
              "gguf_fast_vs_fp32": ms["fp32"] / ms["gguf_fast"],
              "gguf_fast_vs_bf16": ms["bf16"] / ms["gguf_fast"],
              "int8_fast_vs_fp32": ms["fp32"] / ms["int8_fast"],
              "int4_g32_reference_vs_fast": ms["int4_g32_reference"] / ms["int4_g32_fast"]}
    record = {"model": model.config.name, "quick": quick, "new_tokens": n_new,
              "new_tokens_reference": n_ref, "prompt_tokens": len(prompt),
              "measured_bandwidth_GBps": round(bandwidth / 1e9, 2), "rows": rows,
              "ratios": {k: round(v, 3) for k, v in ratios.items()},
              "units": {"ms_per_token": "ms per batch-1 decode step", "floor_ms": "weight bytes / "
                        "measured read bandwidth", "weight_bytes": "bytes of every weight, the "
                        "tied fp32 embedding (= lm_head) included"}}
    record["machine"] = machine_info(model.device)
    record["path"] = str(write_result("quant", record, model.device, out_dir))
    return record


def report(r: dict) -> str:
    m = r["machine"]
    lines = [f"quantized decode on {m.get('device_name', m['device'])} ({m['torch_threads']} "
             f"threads), read bandwidth {r['measured_bandwidth_GBps']} GB/s, batch 1:",
             f"  {'format':<20}{'MB':>8}{'floor ms':>10}{'ms/token':>10}{'of floor':>10}"
             f"{'+copy MB':>10}  path"]
    for name, row in r["rows"].items():
        lines.append(f"  {name:<20}{row['weight_bytes'] / 1e6:>8.1f}{row['floor_ms']:>10.2f}"
                     f"{row['ms_per_token']:>10.2f}{100 * row['fraction_of_floor']:>9.0f}%"
                     f"{row.get('fast_path_copy_bytes', 0) / 1e6:>10.1f}  "
                     f"{row.get('path', '')}")
    lines += [f"  {k}: {v:.2f}x" for k, v in r["ratios"].items()]
    return "\n".join(lines)
