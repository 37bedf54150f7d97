"""Chapter 9 benchmark, part A: prefill attention of one layer at long context, materialized vs tiled.

Shapes of SmolLM2-135M's attention (H 9, Hkv 3, D 64), batch 1, fp32, causal, T = S = N.
- Memory (`peak_table`): the peak extra bytes of live tensors each version allocates, counted by
  `attention.memory.peak_bytes` (deterministic: ops and shapes only). Dense attention is counted on
  the "meta" device (shapes without data: the same ops, the same count, without allocating its
  7 GB at N = 8192), the tiled version on CPU tensors (its tiles are small, and meta kernels run
  slower than real ones); the record checks meta == cpu for both at the smallest N.
  Target of issue 18: tiled <= 1/8 of dense at 4096.
- Time (`time_table`): SDPA (PyTorch's fused CPU kernel, GQA without repeats), the materialized
  reference and the tiled PyTorch version, in interleaved rounds in one process (the machine's
  bandwidth drifts; ratios are what we report). Seed 002's claim: fused attention 2-4x faster than
  materialized beyond 1K tokens. The tiled version is slower than SDPA although it does the same
  arithmetic: a Python loop over tiles issues ~10 small ops per tile, each reading and writing
  its tile through main memory, where SDPA's C++ kernel runs each tile through cache in one go.

The decode part (`run_decode`, flash-decoding over the paged cache) lives in attention_decode.py.
Left out on purpose: the backward pass, batch > 1 (the peak scales with it), other dtypes.
"""
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minillm.attention import attention_reference, flash_attention
from minillm.attention.memory import peak_bytes
from benchmarks.records import write_result

H, HKV, D = 9, 3, 64
MEMORY_N = (1024, 2048, 4096, 8192)
TIME_N = (256, 512, 1024, 2048, 4096, 8192)
BLOCKS = (64, 128)


def inputs(n: int, device="cpu", seed: int = 0):
    """q (1, H, n, D), k, v (1, Hkv, n, D), fp32."""
    if torch.device(device).type == "meta":
        return tuple(torch.empty(1, h, n, D, device="meta") for h in (H, HKV, HKV))
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, D, generator=g).to(device) for h in (H, HKV, HKV))


def variants() -> dict:
    """name -> attention(q, k, v), all causal."""
    out = {"dense": lambda q, k, v: attention_reference(q, k, v),
           "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    for b in BLOCKS:
        out[f"tiled{b}"] = lambda q, k, v, b=b: flash_attention(q, k, v, block_q=b, block_k=b)
    return out


def peak_table(ns=MEMORY_N, dense_device="meta", tiled_device="cpu") -> dict:
    """{N: {variant: peak extra bytes}} for dense and the tiled block sizes, plus their ratios."""
    fns = variants()
    rows = {}
    for n in ns:
        row = {"dense": peak_bytes(fns["dense"], *inputs(n, dense_device))[1]}
        q, k, v = inputs(n, tiled_device)
        with torch.inference_mode():
            row.update({f"tiled{b}": peak_bytes(fns[f"tiled{b}"], q, k, v)[1] for b in BLOCKS})
        row["scores_bytes"] = H * n * n * 4                       # one (H, N, N) fp32 matrix
        for b in BLOCKS:
            row[f"tiled{b}_over_dense"] = round(row[f"tiled{b}"] / row["dense"], 5)
        rows[str(n)] = row
    return rows


def time_table(ns=TIME_N, rounds: int = 3, names=("sdpa", "dense", "tiled128")) -> dict:
    """{N: {variant: median seconds}} over `rounds` interleaved rounds, and dense / sdpa."""
    fns = variants()
    rows = {}
    for n in ns:
        q, k, v = inputs(n)
        times = {name: [] for name in names}
        with torch.inference_mode():
            for name in names:                                    # warm-up: one call each
                fns[name](q, k, v)
            for _ in range(rounds):
                for name in names:
                    t0 = time.perf_counter()
                    fns[name](q, k, v)
                    times[name].append(time.perf_counter() - t0)
        row = {name: statistics.median(t) for name, t in times.items()}
        row["dense_over_sdpa"] = round(row["dense"] / row["sdpa"], 3)
        if "tiled128" in row:
            row["tiled128_over_sdpa"] = round(row["tiled128"] / row["sdpa"], 3)
        rows[str(n)] = row
        del q, k, v
    return rows


def run_prefill(quick: bool = False, out_dir=None, rounds: int = 3, memory: dict | None = None) -> dict:
    """Measure both tables, write benchmarks/results/attention_cpu.json; return the record.

    `memory`: a peak table of an earlier run to reuse (the counts are deterministic: the same code
    gives the same table), so the timing can run alone, un-niced, when the machine is quiet."""
    memory_n, time_n = ((512, 1024), (256, 512)) if quick else (MEMORY_N, TIME_N)
    t0 = time.perf_counter()
    reused = memory is not None
    memory = memory if reused else peak_table(memory_n)
    memory_n = tuple(int(n) for n in memory)
    check_n = memory_n[0]
    assert peak_table((check_n,), "cpu", "meta") == {str(check_n): memory[str(check_n)]}, \
        "peak_bytes differs between meta and cpu tensors"
    load_before = os.getloadavg()[0]
    timing = time_table(time_n, 2 if quick else rounds)
    record = {"quick": quick, "shape": {"batch": 1, "n_head": H, "n_kv_head": HKV, "head_dim": D,
                                        "dtype": "float32", "causal": True},
              "blocks": list(BLOCKS), "memory_devices": f"dense on meta, tiled on cpu (both checked against the other at N={check_n})",
              "torch_threads": torch.get_num_threads(), "rounds": rounds,
              "units": {"memory": "bytes: peak of live tensors allocated by the call (peak_bytes)",
                        "timing": "seconds per call (median of interleaved rounds)",
                        "ratios": "dimensionless",
                        "load_average_1min": "runnable processes (before, after the timing) on the machine"},
              "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "memory_reused_from_an_earlier_run": reused,
              "memory": memory, "timing": timing, "seconds": round(time.perf_counter() - t0, 1)}
    record["path"] = str(write_result("attention", record, "cpu", out_dir))
    return record


def run(quick: bool = False, device=None, out_dir=None) -> dict:
    """`python -m benchmarks attention`: part A (this file) on the CPU."""
    return run_prefill(quick=quick, out_dir=out_dir)


def report(r: dict) -> str:
    lines = ["prefill attention, one layer (H 9, Hkv 3, D 64, fp32, causal, batch 1)",
             "  peak extra memory (MiB):      N   dense  tiled64  tiled128  tiled64/dense"]
    for n, row in r["memory"].items():
        lines.append(f"  {int(n):>34} {row['dense'] / 2**20:7.1f} {row['tiled64'] / 2**20:8.2f} "
                     f"{row['tiled128'] / 2**20:9.2f} {row['tiled64_over_dense']:14.4f}")
    lines.append("  time (ms):                     N    sdpa    dense  tiled128  dense/sdpa  tiled128/sdpa")
    for n, row in r["timing"].items():
        lines.append(f"  {int(n):>34} {1e3 * row['sdpa']:7.1f} {1e3 * row['dense']:8.1f} "
                     f"{1e3 * row['tiled128']:9.1f} {row['dense_over_sdpa']:11.2f} {row['tiled128_over_sdpa']:14.2f}")
    return "\n".join(lines)
