"""Chapter 7's weight formats, quantized linears and `minillm.quantize`, on CPU in seconds.

Trusted references: the formats' rules written again here in float64, a float64
dequantize-then-matmul, and the same tiny model holding the dequantized weights in plain fp32
nn.Linear layers.
"""
import copy

import pytest
import torch

import minillm
from minillm import EngineConfig, LLMEngine, SamplingParams
from minillm.quant import api
from minillm.quant.api import quantize, quantized_bytes
from minillm.quant.formats import (Int4Weight, pack_int4, quantize_int4, quantize_int8,
                                   unpack_int4)
from minillm.quant.linear import Int4Linear, Int8Linear

from engine_configs import CONFIGS, workload as equivalence_workload

BF16_REL = 2 ** -6          # bf16 keeps 8 significant bits: a few roundings per product, summed


def weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g, dtype=torch.float64).float() / k ** 0.5


# ---- formats against float64 ----------------------------------------------------------------
def test_int8_matches_float64_rule():
    w = weight()
    q = quantize_int8(w)
    s = w.double().abs().amax(1) / 127                                      # (N,)
    codes = torch.round(w.double() / s[:, None]).clamp(-127, 127)
    assert torch.equal(q.q.long(), codes.long())
    assert torch.allclose(q.dequantize().double(), s[:, None] * codes, rtol=1e-6, atol=0)
    assert (q.dequantize().double() - w.double()).abs().le(s[:, None] / 2 * (1 + 1e-5)).all()
    assert q.nbytes == 96 * 128 + 96 * 4


def test_int4_matches_float64_rule_and_error_bound():
    w = weight()
    G = 32
    q = quantize_int4(w, G)
    grp = w.double().view(96, 128 // G, G)
    lo, hi = grp.amin(-1), grp.amax(-1)
    d = ((hi - lo) / 15).half().double()                                    # stored in fp16
    m = lo.half().double()
    assert torch.equal(q.scale.double(), d) and torch.equal(q.minimum.double(), m)
    deq = (d[..., None] * q.q.view(96, 4, G).double() + m[..., None]).view(96, 128)
    assert torch.allclose(q.dequantize().double(), deq, rtol=1e-6, atol=1e-7)
    # nearest point of the fp16 grid: half a step, plus what fp16 rounding of d and m moved it
    bound = d / 2 + (m - lo).abs() + 15 * (d - (hi - lo) / 15).abs() + 1e-6
    err = (q.dequantize().double() - w.double()).view(96, 4, G).abs()
    assert err.le(bound[..., None]).all()
    assert q.nbytes == 96 * 128 // 2 + 2 * 2 * 96 * 4


def test_int4_grid_properties():
    w = weight()
    q = quantize_int4(w, 32)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15
    codes = q.q.view(96, 4, 32).long()
    grp = w.view(96, 4, 32)
    assert torch.equal(codes.gather(-1, grp.argmin(-1, keepdim=True)), torch.zeros(96, 4, 1).long())
    assert torch.equal(codes.gather(-1, grp.argmax(-1, keepdim=True)), torch.full((96, 4, 1), 15))
    flat = torch.full((2, 32), 0.25)                                        # one value: scale 0
    qf = quantize_int4(flat, 32)
    assert torch.equal(qf.q, torch.zeros_like(qf.q)) and torch.equal(qf.dequantize(), flat)


def test_weights_already_on_a_q4_1_grid_come_back_bit_for_bit():
    """Why "int4", groups of 32, recovers the shipped model exactly: its weights are d * q + m."""
    g = torch.Generator().manual_seed(1)
    N, K = 64, 256
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[:, 0::32], codes[:, 1::32] = 0, 15                               # each block spans 0..15
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half()
    m = (-torch.rand(N, K // 32, generator=g) * 0.05).half()
    w = Int4Weight(codes, d, m, 32).dequantize()
    again = quantize_int4(w, 32)
    assert torch.equal(again.dequantize(), w)


def test_pack_unpack_layout_and_round_trip():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (5, 12), generator=g, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6)
    assert all(int(packed[r, j]) == int(q[r, 2 * j]) + 16 * int(q[r, 2 * j + 1])
               for r in range(5) for j in range(6))
    assert torch.equal(unpack_int4(packed), q)


# ---- the quantized linears ------------------------------------------------------------------
def _float64_linear(x, w_deq):
    return (x.double() @ w_deq.double().t())                                # (M, N)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_reference_path_is_a_float64_dequantize_then_matmul(kind):
    w = weight()
    if kind == "int8":
        q = quantize_int8(w)
        layer = Int8Linear(q, path="reference")
        w64 = q.scale.double()[:, None] * q.q.double()
    else:
        q = quantize_int4(w, 32)
        layer = Int4Linear(q, path="reference")
        w64 = (q.scale.double()[..., None] * q.q.view(96, 4, 32).double()
               + q.minimum.double()[..., None]).view(96, 128)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    ref = _float64_linear(x.view(6, 128), w64).view(2, 3, 96)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fast_path_equals_reference_within_bf16(kind):
    w = weight()
    layer = Int8Linear(quantize_int8(w)) if kind == "int8" else Int4Linear(quantize_int4(w, 32))
    kernel = "_weight_int8pack_mm" if kind == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch, kernel):
        pytest.skip(f"this torch has no torch.{kernel}")
    assert layer.active_path() == "fast"                 # the probe accepted our layout
    for rows in (1, 7):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        fast = layer(x).double()
        xb = x.bfloat16().double()                       # the kernel sees bf16 activations
        w64 = layer.dequantize().double()
        ref = xb @ w64.t()
        # bound: bf16 rounding of each weight (or of int4's scale and zero, up to the group's
        # largest weight) and of the output, over the sum of |x| |w|
        gmax = w64.abs() if kind == "int8" else \
            w64.abs().view(96, 4, 32).amax(-1, keepdim=True).expand(96, 4, 32).reshape(96, 128)
        tol = BF16_REL * (xb.abs() @ gmax.t()) + 2 ** -7 * ref.abs() + 1e-6
        assert ((fast - ref).abs() <= tol).all()


def test_auto_falls_back_and_fast_refuses_where_no_kernel():
    q = quantize_int4(weight(), 16)                      # the kernels take groups of 32..256
    layer = Int4Linear(q, path="auto")
    assert layer.active_path() == "reference"
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, q.dequantize()))
    with pytest.raises(ValueError, match="path='fast'"):
        Int4Linear(q, path="fast")
    with pytest.raises(ValueError, match="path must be one of"):
        Int4Linear(q, path="turbo")
    with pytest.raises(TypeError, match="Int4Weight"):
        Int4Linear(quantize_int8(weight()))


def test_buffers_not_parameters_move_and_describe_themselves():
    q = quantize_int4(weight(), 32)
    layer = Int4Linear(q)
    assert list(layer.parameters()) == []
    assert set(layer.state_dict()) == {"qweight", "scales", "minimums"}
    assert layer.nbytes == q.nbytes == sum(b.numel() * b.element_size() for b in layer.buffers())
    text = repr(layer)
    assert "format=int4" in text and "group_size=32" in text and "path=auto" in text
    moved = layer.to("cpu").to(torch.float64)            # a dtype cast keeps the stored format
    assert moved.scales.dtype == torch.float16 and torch.equal(moved.dequantize(), q.dequantize())
    x = torch.randn(2, 128, dtype=torch.float64)
    assert moved(x).dtype == torch.float64
    assert "format=int8" in repr(Int8Linear(quantize_int8(weight()), path="reference"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fast_path_equals_reference():
    layer = Int4Linear(quantize_int4(weight(256, 512), 32)).to("cuda")
    x = torch.randn(4, 512, device="cuda")
    ref = torch.nn.functional.linear(x.bfloat16().float(), layer.dequantize().cuda())
    y = layer(x)
    assert (y - ref).abs().max() <= 0.03 * ref.abs().max()


# ---- minillm.quantize -----------------------------------------------------------------------
def snapshot(model):
    return [(n, type(m).__name__) for n, m in model.named_modules()], \
        {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, snap):
    mods, state = snapshot(model)
    assert mods == snap[0]
    assert state.keys() == snap[1].keys() and all(torch.equal(state[k], snap[1][k]) for k in state)


BAD = [
    (dict(method="int3"), ValueError, "method must be one of"),
    (dict(method="int8", group_size=32), ValueError, "group_size must be None for int8"),
    (dict(method="int4", group_size=48), ValueError, "divides the input width"),
    (dict(method="int4", group_size=32.0), TypeError, "group_size must be an int"),
    (dict(method="int4", path="fastest"), ValueError, "path must be one of"),
    (dict(method="int4", calibration=[[1, 2]]), ValueError, "only used by 'gptq' and 'awq'"),
    (dict(method="gptq"), ValueError, "needs calibration"),
    (dict(method="gptq", calibration=[]), ValueError, "non-empty"),
    (dict(method="awq", calibration=torch.zeros(0, 8, dtype=torch.long)), ValueError, "B >= 1"),
    (dict(method="gptq", calibration=[[1, 2, 300]]), ValueError, r"in \[0, 256\)"),
    (dict(method="gptq", calibration=torch.tensor([[1, -1]])), ValueError, r"in \[0, 256\)"),
    (dict(method="gptq", calibration=[[1, 2], [3]]), ValueError, "one length"),
    (dict(method="gptq", calibration=torch.ones(2, 4)), TypeError, "LongTensor"),
    (dict(method="gguf"), ValueError, "shipped SmolLM2"),
    (dict(method="gguf", group_size=64), ValueError, "None or 32"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD)
def test_bad_input_is_refused_and_the_model_is_unchanged(kwargs, error, match):
    model = minillm.tiny_model()
    snap = snapshot(model)
    with pytest.raises(error, match=match):
        quantize(model, **kwargs)
    assert_unchanged(model, snap)


def test_refuses_a_model_twice_and_non_models():
    model = quantize(minillm.tiny_model(), "int8")
    snap = snapshot(model)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4")
    assert_unchanged(model, snap)
    with pytest.raises(TypeError, match="Transformer"):
        quantize(torch.nn.Linear(4, 4), "int8")


def _fake(monkeypatch, name, fn):
    """`quantize` calls `fn` as the calibration method `name` (gptq_weights / awq_weights)."""
    monkeypatch.setattr(api, f"{name}_weights", fn)


def test_gptq_and_awq_dispatch_with_checked_calibration(monkeypatch):
    seen = {}

    def gptq_weights(model, calibration, group_size):
        seen.update(calibration=calibration, group_size=group_size)
        return {n: quantize_int4(m.weight.detach(), group_size)
                for n, m in model.named_modules() if n.endswith("_proj")}
    _fake(monkeypatch, "gptq", gptq_weights)
    model = quantize(minillm.tiny_model(), "gptq", calibration=[[1, 2, 3], [4, 5, 6]])
    assert seen["group_size"] == 32 and torch.equal(seen["calibration"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)

    def awq_weights(model, calibration, group_size):
        w, _ = gptq_weights(model, calibration, group_size), None
        return w, {"layers.0.input_norm.weight": torch.full((64,), 2.0)}
    _fake(monkeypatch, "awq", awq_weights)
    model = quantize(minillm.tiny_model(), "awq", group_size=16, calibration=torch.ones(1, 4).long())
    assert torch.equal(model.layers[0].input_norm.weight.detach(), torch.full((64,), 2.0))


def test_a_method_returning_the_wrong_modules_leaves_the_model_unchanged(monkeypatch):
    _fake(monkeypatch, "gptq", lambda model, calibration, group_size: {})
    model = minillm.tiny_model()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="returned weights"):
        quantize(model, "gptq", calibration=[[1, 2]])
    assert_unchanged(model, snap)
    _fake(monkeypatch, "awq", lambda model, calibration, group_size: (
        {n: quantize_int4(m.weight.detach(), 32) for n, m in model.named_modules() if n.endswith("_proj")},
        {"layers.0.nope.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="does not match a parameter"):
        quantize(model, "awq", calibration=[[1, 2]])
    assert_unchanged(model, snap)


def dequantized_twin(qmodel, fp_model):
    """The float model with each projection's weight replaced by the quantized one, dequantized."""
    twin = copy.deepcopy(fp_model)
    with torch.no_grad():
        for name, module in qmodel.named_modules():
            if isinstance(module, (Int8Linear, Int4Linear)):
                twin.get_submodule(name).weight.copy_(module.dequantize())
    return twin


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_tiny_model_runs_engine_and_generate_like_its_dequantized_twin(method, one_thread):
    fp = minillm.tiny_model()
    q = quantize(copy.deepcopy(fp), method, path="reference")
    twin = dequantized_twin(q, fp)
    x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(q(x), twin(x))                 # the same ops on the same numbers
        prompt = x[0].tolist()
        assert minillm.generate(q, prompt, 12) == minillm.generate(twin, prompt, 12)
    prompts = [x[0].tolist(), x[1, :5].tolist()]
    params = SamplingParams(max_tokens=10)
    cfg = EngineConfig(block_size=4, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=8)
    ours = [o.token_ids for o in LLMEngine(q, cfg).generate(prompts, params, use_tqdm=False)]
    ref = [o.token_ids for o in LLMEngine(twin, cfg).generate(prompts, params, use_tqdm=False)]
    assert ours == ref


def test_fast_path_model_runs_engine_and_stays_close(one_thread):
    fp = minillm.tiny_model()
    q = quantize(copy.deepcopy(fp), "int4")               # auto: fused kernel where present
    twin = dequantized_twin(q, fp)
    x = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, ref = q(x), twin(x)
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
    out = minillm.LLM(q, max_num_seqs=2, num_blocks=16, block_size=4).generate(
        [x[0].tolist()], SamplingParams(max_tokens=6), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_llm_quantization_option():
    llm = minillm.LLM(minillm.tiny_model(), quantization="int8", num_blocks=16, block_size=4)
    assert isinstance(llm.model.layers[1].attn.o_proj, Int8Linear)
    with pytest.raises(ValueError, match="quantization must be one of"):
        minillm.LLM(minillm.tiny_model(), quantization="gptq")


def test_quantized_bytes_counts_every_weight_once():
    cfg = minillm.tiny_model().config
    model = quantize(minillm.tiny_model(), "int4", group_size=32)
    C, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layer
    qkv_rows = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    shapes = [(qkv_rows, C), (cfg.n_head * cfg.head_dim, C), (2 * F, C), (C, F)]
    int4 = L * sum(n * k // 2 + 2 * 2 * n * (k // 32) for n, k in shapes)
    fp32 = 4 * (2 * V * C + (2 * L + 1) * C)              # embed, untied lm_head, norms
    counted = quantized_bytes(model)
    # the int4 kernel's tiled copy holds as many bytes as the stored codes and scales
    fast = any(m.active_path() == "fast" for m in model.modules() if isinstance(m, Int4Linear))
    assert counted.pop("fast_path_copies", 0) == (int4 if fast else 0)
    assert counted.pop("embedding") == 4 * V * C
    # a step reads the int4 weights (the kernel's same-sized copy on the fast path), the norms,
    # the untied fp32 lm_head and one embedding row per token
    assert counted.pop("read_per_step") == int4 + 4 * (V * C + (2 * L + 1) * C) + 4 * C
    assert counted == {"int4_g32": int4, "float32": fp32, "total": int4 + fp32}
    assert minillm.quantize is not None and "quantize" in minillm.__all__


@pytest.mark.parametrize("method,fmt,group", [("int8", "int8", None), ("int4", "int4", 16)])
def test_model_bytes_from_the_config_matches_the_quantized_model(method, fmt, group):
    from minillm.analysis.quant_math import model_bytes
    model = quantize(minillm.tiny_model(), method, group_size=group)
    counted = quantized_bytes(model)
    predicted = model_bytes(model.config, fmt, group)
    assert predicted["total"] == counted["total"]
    assert predicted["projections"] == counted[fmt if fmt == "int8" else f"int4_g{group}"]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_equivalence_holds_for_a_quantized_model(method, name, one_thread):
    """Every request's greedy output through the engine equals `generate` alone on the same
    quantized model (float64 activations, reference path: no ties can flip), whatever the block
    size, chunking or preemption: quantization changes the weights, not the engine's exactness."""
    q = quantize(minillm.tiny_model(dtype=torch.float64), method, group_size=16 if method == "int4" else None,
                 path="reference")
    prompts, max_tokens = equivalence_workload(0)
    refs = [minillm.generate(q, p, k) for p, k in zip(prompts, max_tokens)]
    engine = LLMEngine(q, EngineConfig(**CONFIGS[name]))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert engine.num_free_blocks == engine.num_blocks
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
