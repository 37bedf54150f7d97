"""Chapter 1 exercises (the roofline). Numeric answers are judged against minillm's roofline
functions (`minillm.analysis.roofline`, the planner of `kv_math`); the code exercise runs the
reader's lower-bound function against the package's `op_time` on random ops.

    >>> from minillm import exercises
    >>> exercises.check("01.1", 1)                # doctest: +SKIP
    01.1 not yet: that is not it (...); recompute. Hint: ...
"""
import random

from minillm.analysis.kv_math import plan_capacity
from minillm.analysis.roofline import (Hardware, OpCost, decode_compute_bound_batch, decode_costs,
                                       get_hardware, op_time, total_cost)
from minillm.exercises import call_reader as _call, code, numeric
from minillm.model.config import get_config


numeric("01.1", "Llama-3-70B decodes in bf16 on an H200, every sequence with 512 cached tokens "
        "(S=512). From which batch size B on is a decode step compute-bound (total intensity >= "
        "the ridge point)?",
        lambda: decode_compute_bound_batch(get_config("llama-3-70b"), get_hardware("h200"), 512, "bf16"),
        rtol=0, atol=0.5, hint="as in section 3, the step's total intensity grows with B; find the first B at which it "
        "reaches this card's ridge, counting the cache's reads at S=512")

numeric("01.2", "The same model and card with S=8192 cached tokens: what intensity (FLOP/byte) does "
        "a decode step tend to as B grows without bound? (It is why no batch turns it compute-bound.)",
        lambda: total_cost(decode_costs(get_config("llama-3-70b"), 1 << 20, 8192, "bf16")).intensity,
        rtol=0.01, hint="evaluate the total intensity at a huge batch, e.g. B = 2**20")

numeric("01.3", "Llama-3-8B in bf16 on an H200 (its real 141 GiB), gpu_memory_utilization=0.9, "
        "blocks of 16, no activation reserve: how many sequences of 1025 tokens (S=1024 plus the "
        "new one) fit at once? Batches above it cannot be run, whatever the roofline predicts.",
        lambda: plan_capacity(get_config("llama-3-8b"), get_hardware("h200"), 0.9, 16, 1025,
                              "bf16").max_num_seqs,
        rtol=0, atol=0.5, hint="redo section 3's capacity line for the H200: its memory, not the H100's")


def _show(value) -> str:
    """A short, machine-independent rendering of what the reader's function returned."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else repr(value)[:40]


def _test_roofline_time(fn) -> None:
    """fn(flops, nbytes, peak_flops, bandwidth) -> the roofline's lower-bound seconds of one op."""
    rng = random.Random(1)
    for _ in range(300):
        hw = Hardware("toy", {"fp32": 10 ** rng.uniform(9, 15)}, 10 ** rng.uniform(9, 13), 1e9)
        op = OpCost("op", 10 ** rng.uniform(3, 15), 10 ** rng.uniform(3, 12))
        want = op_time(op, hw, "fp32")
        got = _call(fn, op.flops, op.bytes, hw.peak("fp32"), hw.mem_bandwidth)
        assert isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * want, (
            f"flops={op.flops:.3g}, bytes={op.bytes:.3g}, peak={hw.peak('fp32'):.3g} FLOP/s, "
            f"bandwidth={hw.mem_bandwidth:.3g} B/s: got {_show(got)} s")


code("01.4", "Write roofline_time(flops, nbytes, peak_flops, bandwidth) -> the least seconds an op "
     "can take on a chip with that peak (FLOP/s) and memory bandwidth (bytes/s).",
     _test_roofline_time, hint="compute and memory overlap: the slower of the two decides")
