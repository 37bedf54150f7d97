"""Chapter 7's exercises (weight quantization). Keys "07.N" as numbered in the notebook.

The numeric answers are judged against `analysis.quant_math` on the configs (no machine dependence);
the code exercise (07.3) runs the reader's Q4_1 block decoder against `quant.gguf.decode_q4_1`
on random blocks made when the reader checks.
"""
import math
import struct

import torch

from minillm.exercises import call_reader, code, numeric
from minillm.model.config import get_config
from minillm.analysis.quant_math import model_bytes


def _random_blocks(n: int = 24, seed: int = 7) -> list[bytes]:
    """Q4_1 blocks with random fp16 d >= 0 and m, and random codes (first: all codes 0..15)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(n):
        d = float(torch.rand((), generator=g)) * 0.05
        m = -float(torch.rand((), generator=g)) * 0.5
        codes = list(range(16)) * 2 if i == 0 else torch.randint(0, 16, (32,), generator=g).tolist()
        qs = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
        blocks.append(struct.pack("<ee", d, m) + qs)
    return blocks


def _test_dequantize_q4_1(candidate) -> None:
    from minillm.quant.gguf import decode_q4_1
    if not callable(candidate):
        raise AssertionError("pass your function dequantize_q4_1(block: bytes) -> 32 floats")
    for block in _random_blocks():
        want = decode_q4_1(torch.tensor(list(block), dtype=torch.uint8)[None]).dequantize()[0]
        got = call_reader(candidate, block)
        try:
            got = [float(v) for v in got]
        except TypeError:
            raise AssertionError("return a list (or 1-D tensor) of 32 numbers") from None
        if len(got) != 32:
            raise AssertionError(f"a Q4_1 block holds 32 weights, your function returned {len(got)}")
        scale = float(want.abs().max()) + 1e-12
        if any(not math.isclose(a, b, abs_tol=1e-6 * scale) for a, b in zip(got, want.tolist())):
            raise AssertionError("some weights differ from the file's dequantization")


numeric("07.1", "Bytes of SmolLM2-135M's 120 projection weights (qkv, o, gate_up, down of 30 "
        "layers) stored as Q4_1: groups of 32, an fp16 scale and an fp16 minimum per group.",
        lambda: model_bytes(get_config("smollm2-135m"), "int4", 32)["projections"],
        rtol=0.005, hint="a block of 32 weights is 16 bytes of codes plus two fp16 numbers")
numeric("07.2", "Llama-3-70B with every projection in int4, groups of 128 (fp16 scale and minimum), "
        "the embedding, lm_head (untied) and norms kept in bf16: total GB (1e9 bytes) of weights.",
        lambda: model_bytes(get_config("llama-3-70b"), "int4", 128, "bf16")["total"] / 1e9,
        rtol=0.01, hint="4 + 32/128 bits per projection weight; 2 bytes for everything else")
code("07.3", "Write dequantize_q4_1(block: bytes) -> the 32 weights of one 20-byte Q4_1 block "
     "(fp16 d, fp16 m, 16 bytes of 4-bit codes); checked against quant.gguf on random blocks.",
     _test_dequantize_q4_1, hint="byte j holds weight j in its low nibble and weight j + 16 in its high")
