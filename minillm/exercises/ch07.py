"""Chapter 7's exercises (quantization). Keys "07.N": 07.1-07.3 in 07_quantization.ipynb (formats
and bytes), 07.4-07.7 in 07b_quantization_quality.ipynb (the KV cache, outliers, GPTQ).

07.1, 07.2 and 07.4 are judged against `analysis.quant_math` / `analysis.kv_math` on the configs
(no machine dependence); 07.6 against the outlier census of the real model, run on the reader's
machine when they check. The code exercises run the reader's function against the package on
inputs made when the reader checks: a Q4_1 block decoder (07.3, against `quant.gguf`), the int8
KV cache's round trip (07.5, against `quant.kv`) and GPTQ's one-column step (07.7, against a
float64 least-squares solve).
"""
import functools
import math
import struct

import torch

from minillm.exercises import call_reader, code, numeric
from minillm.model.config import get_config
from minillm.analysis.kv_math import kv_bytes_per_token
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
        "layers) stored with Q4_1's rule in groups of 64 (instead of the file's 32): 4-bit codes, "
        "an fp16 scale and an fp16 minimum per group.",
        lambda: model_bytes(get_config("smollm2-135m"), "int4", 64)["projections"],
        rtol=0.005, hint="count the projection weights from the config, then what one group of 64 "
        "takes, codes and its two fp16 numbers")
numeric("07.2", "Llama-3-70B with every projection in int4, groups of 64 (fp16 scale and minimum), "
        "the embedding, lm_head (untied) and norms kept in bf16: total GB (1e9 bytes) of weights.",
        lambda: model_bytes(get_config("llama-3-70b"), "int4", 64, "bf16")["total"] / 1e9,
        rtol=0.01, hint="redo the chapter's groups-of-128 row with the scale bits of groups of 64; "
        "what is not a projection stays as it was")
code("07.3", "Write dequantize_q4_1(block: bytes) -> the 32 weights of one 20-byte Q4_1 block "
     "(fp16 d, fp16 m, 16 bytes of 4-bit codes); checked against quant.gguf on random blocks.",
     _test_dequantize_q4_1, hint="byte j holds weight j in its low nibble and weight j + 16 in its high")


def _kv_cases():
    """Vectors (..., D) of very different sizes (seeded; none so small that its scale would fall
    below fp16's smallest normal number, where the cache clamps it)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 3, 64, generator=g) * torch.exp((2 * torch.randn(6, 3, 1, generator=g)).clamp(-2, 4))
    return [x, torch.randn(5, 16, generator=g), 1e3 * torch.randn(2, 8, generator=g)]


def _test_fake_quant_int8(candidate) -> None:
    from minillm.quant.kv import dequantize_kv, quantize_kv
    if not callable(candidate):
        raise AssertionError("pass your function fake_quant_int8(x)")
    for x in _kv_cases():
        got = call_reader(candidate, x.clone())
        want = dequantize_kv(*quantize_kv(x, "int8"), torch.float32)
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise AssertionError(f"for x of shape {tuple(x.shape)} return a tensor of that shape")
        if not torch.allclose(got.float(), want, rtol=1e-6, atol=1e-6 * float(x.abs().max())):
            raise AssertionError(f"values differ from the int8 KV cache's for x of shape "
                                 f"{tuple(x.shape)}")


@functools.cache                       # one answer per process: checking twice loads once
def _last_down_outliers() -> int:
    """Input dims of the last layer's down_proj past 6 on the chapter's calibration tokens."""
    from minillm.model.loading import load_model
    from minillm.quant.outliers import outlier_features
    from minillm.quant.quality import calibration_ids
    model, tok = load_model(device="cpu")
    rows = outlier_features(model, calibration_ids(tok, 4, 128))
    last = model.config.n_layer - 1
    return next(r["n_dims"] for r in rows if r["layer"] == last and r["proj"] == "mlp.down_proj")


def _test_compensate(candidate) -> None:
    """The one-column GPTQ step against a float64 least-squares solve."""
    if not callable(candidate):
        raise AssertionError("pass your function compensate(W, H, q0)")
    gen = torch.Generator().manual_seed(0)
    for N, K, T in ((3, 6, 40), (5, 12, 80)):
        X = torch.randn(T, K, generator=gen, dtype=torch.float64) @ torch.randn(
            K, K, generator=gen, dtype=torch.float64)                      # correlated inputs
        W = torch.randn(N, K, generator=gen, dtype=torch.float64)
        q0 = torch.round(W[:, 0] * 2) / 2
        got = call_reader(candidate, W.clone(), 2 * X.t() @ X, q0.clone())
        target = X[:, :1] @ (W[:, :1] - q0[:, None]).t() + X[:, 1:] @ W[:, 1:].t()
        best = torch.linalg.lstsq(X[:, 1:], target).solution.t()          # (N, K - 1)
        if not isinstance(got, torch.Tensor) or got.shape != W.shape:
            raise AssertionError(f"compensate must return a tensor of shape {tuple(W.shape)}")
        if not torch.allclose(got[:, 0], q0) or not torch.allclose(got[:, 1:], best, atol=1e-8):
            raise AssertionError("columns 1.. are not the least-squares optimum given column 0")


numeric("07.4", "Bytes per token of Llama-3-8B's KV cache (32 layers, 8 KV heads, head_dim 128) "
        "in int8 with one fp16 scale per token per KV head.",
        lambda: kv_bytes_per_token(get_config("llama-3-8b"), "int8", scale_bytes=2),
        rtol=0.0, atol=0.0, hint="redo chapter 7b's bytes-per-token table for this model's shape: "
        "what one head's K vector takes in int8 with its scale, and how many such vectors a token "
        "stores")
code("07.5", "Write fake_quant_int8(x) -> what the int8 KV cache returns for vectors x (..., D): "
     "symmetric, one absmax scale per vector stored in fp16, codes in [-127, 127].",
     _test_fake_quant_int8,
     hint="round the scale to fp16 before dividing by it; max |x| / 127 maps to the code 127")
numeric("07.6", "How many of the 1,536 input dims of SmolLM2's last down_proj reach |x| >= 6 on "
        "the chapter's calibration tokens (calibration_ids(tok, 4, 128))?", _last_down_outliers,
        atol=0.0, rtol=0.0, hint="outlier_features(model, ids): the row of layer 29, mlp.down_proj")
code("07.7", "Write compensate(W, H, q0): put q0 in column 0 of W and move columns 1.. to minimize "
     "||(W_orig - W_new) X^T||^2, for H = 2 X^T X (GPTQ's step, from H^-1).", _test_compensate,
     hint="only the error of column 0 needs cancelling; H^-1 says how much each other column can")
