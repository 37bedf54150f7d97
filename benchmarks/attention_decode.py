"""Decode attention at long context (chapter 9), the record: the three-way table of
`minillm.lab.attention_decode` and the real model's step shares of `minillm.lab.long_context`,
measured in one process and written to attention_decode_<device>.json.

    python -m benchmarks attention_decode [--quick]
"""
import os

import torch

from benchmarks.records import write_result
from minillm.lab.attention_decode import CONTEXTS, decode_table, run_decode
from minillm.lab.long_context import PREFILL_LENGTHS, long_context_table, run_long_context
from minillm.lab.measure import measure_hardware
from minillm.llm import load_model            # the front door: CPU routes switched on


def run(quick: bool = False, device=None, out_dir=None, num_threads: int | None = 1,
        prefill_lengths=None) -> dict:
    """The decode-attention table, then the real model's long-context shares; writes
    `attention_decode_<device>.json` and returns the record. num_threads=1 by default: on a
    shared machine one thread gives steadier ratios (threads that wait on busy cores spin)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    load_before = os.getloadavg()[0]
    contexts = (128, 1024, 8192) if quick else CONTEXTS
    table = run_decode(contexts, rounds=2 if quick else 3, repeat=2 if quick else 3)
    hw = measure_hardware("cpu", quick=True, dtypes=("fp32",), progress=False)
    model, _ = load_model(device="cpu")
    prefill = prefill_lengths or ((128, 512) if quick else PREFILL_LENGTHS)
    longctx = run_long_context(model, hw, contexts, prefill, rounds=2 if quick else 3,
                               repeat=2 if quick else 3)
    record = {"quick": quick, "decode_attention": table, "long_context": longctx,
              "load_avg_1min": [load_before, os.getloadavg()[0]],
              "units": {"*_ms": "ms (median over rounds of medians)", "*_over_sdpa": "ratio, "
                        "median over rounds", "context": "tokens cached", "tokens": "prefill tokens",
                        "share": "attention time / step time", "share_by_difference":
                        "(step(S) - step(base_context)) / step(S)", "roofline_share":
                        "attention's predicted share of the roofline step time",
                        "kv_over_weight_bytes": "KV bytes at that context / weight bytes (fp32)",
                        "crossover_tokens": "context where KV bytes reach the weight bytes",
                        "mem_bandwidth": "bytes/s", "peak_flops": "FLOP/s",
                        "load_avg_1min": "runnable processes, 1-minute average, before and after"}}
    return {**record, "path": str(write_result("attention_decode", record, "cpu", out_dir))}


def report(record: dict) -> str:
    return decode_table(record["decode_attention"]) + "\n" + long_context_table(record["long_context"])
