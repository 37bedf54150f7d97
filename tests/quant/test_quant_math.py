"""Chapter 7's weight-bytes arithmetic against counts made by hand and against real tensors."""
import pytest
import torch

from minillm import get_config, tiny_model
from minillm.analysis.quant_math import bits_per_weight, model_bytes, projection_shapes
from minillm.quant.formats import quantize_int4, quantize_int8


def test_bits_per_weight_by_hand():
    assert bits_per_weight("int4", 32) == 5.0            # Q4_1: 4 bits + (16 + 16) / 32
    assert bits_per_weight("int4", 128) == 4.25
    assert bits_per_weight("int4-sym", 128) == 4.125
    assert bits_per_weight("int8", in_features=64) == 8.5
    assert bits_per_weight("bf16") == 16 and bits_per_weight("fp32") == 32


def test_projection_shapes_are_the_models_own():
    m = tiny_model()
    layer = m.layers[0]
    real = [tuple(p.weight.shape) for p in (layer.attn.qkv_proj, layer.attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert projection_shapes(m.config) == real


def test_bytes_match_real_quantized_tensors():
    """The formula counts what formats.py really stores (codes packed two per byte)."""
    m = tiny_model()
    cfg = m.config
    for fmt, g, quant in (("int4", 32, lambda w: quantize_int4(w, 32)), ("int8", None, quantize_int8)):
        stored = sum(quant(p.weight.data).nbytes for layer in m.layers
                     for p in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj))
        assert model_bytes(cfg, fmt, g)["projections"] == stored
    rest = sum(p.numel() for n, p in m.named_parameters() if "proj" not in n)
    b = model_bytes(cfg, "int4", 32, "fp32")
    assert b["embedding"] + b["lm_head"] + b["norms"] == 4 * rest
    assert model_bytes(cfg, "fp32", None)["total"] == 4 * sum(
        p.numel() for p in m.parameters())


def test_a_70b_model_by_hand():
    """Llama-3-70B: 2 bytes a parameter in fp16; int4 at G=128 is 4.25 bits on the projections and
    fp16 elsewhere (the 128256 x 8192 embedding and lm_head, untied, and the norms)."""
    cfg = get_config("llama-3-70b")
    per_layer = sum(N * K for N, K in projection_shapes(cfg))
    proj, rest = cfg.n_layer * per_layer, cfg.num_params - cfg.n_layer * per_layer
    assert rest == 2 * 128256 * 8192 + (2 * cfg.n_layer + 1) * 8192
    assert model_bytes(cfg, "fp16", None, "fp16")["total"] == 2 * cfg.num_params
    assert model_bytes(cfg, "int4", 128, "fp16")["total"] == proj * 4.25 / 8 + 2 * rest


@pytest.mark.parametrize("call, err, match", [
    (lambda: bits_per_weight("int3"), ValueError, "fmt must be one of"),
    (lambda: bits_per_weight("int4"), TypeError, "group_size"),
    (lambda: bits_per_weight("int4", 0), ValueError, "group_size"),
    (lambda: bits_per_weight("int8", 32), ValueError, "int4 formats only"),
    (lambda: model_bytes(get_config("smollm2-135m"), "int4", 128), ValueError, "does not divide the input width 576"),
])
def test_bad_input(call, err, match):
    with pytest.raises(err, match=match):
        call()
