"""The shipped GGUF file's Q4_1 blocks against the shipped fp32 model, bit for bit.

The trusted reference is minillm's fp32 model (transformers + gguf dequantized the file for it,
independently of `quant.gguf`). A hand-assembled block checks the nibble order on its own.
"""
import struct

import pytest
import torch

import minillm
from minillm.model.chat import encode_chat
from minillm.quant import gguf
from minillm.quant.api import set_path
from minillm.quant.linear import Int4Linear


def test_one_hand_made_block_decodes_by_the_rule():
    d, m = 0.5, -3.0
    codes = list(range(16)) + list(range(15, -1, -1))                       # weights 0..31
    qs = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    raw = torch.tensor(list(struct.pack("<ee", d, m) + qs), dtype=torch.uint8)[None]  # (1, 20)
    w = gguf.decode_q4_1(raw)
    assert w.q.tolist() == [codes] and w.group_size == 32
    assert w.dequantize().tolist() == [[d * c + m for c in codes]]
    layout = gguf.q4_1_layout()
    assert layout["bytes_per_block"] == 20 and layout["bits_per_weight"] == 5.0
    with pytest.raises(ValueError, match="raw must be uint8"):
        gguf.decode_q4_1(torch.zeros(2, 19, dtype=torch.uint8))


@pytest.fixture(scope="module")
def shipped():
    """The fp32 model's weights and logits, then the same model quantized "gguf" in place."""
    model, tok = minillm.load_model(device="cpu", kernels="plain")
    fp32 = {n: m.weight for n, m in model.named_modules() if n.endswith("_proj")}
    x = torch.tensor([encode_chat(tok, "What is the capital of France?")])
    with torch.no_grad():
        logits = model(x)
    minillm.quantize(model, "gguf", path="reference")
    return model, fp32, x, logits


@pytest.mark.slow
def test_every_projection_equals_the_shipped_fp32_weight_bit_for_bit(shipped):
    model, fp32, _, _ = shipped
    assert len(fp32) == 4 * model.config.n_layer
    for name, weight in fp32.items():
        module = model.get_submodule(name)
        assert isinstance(module, Int4Linear) and module.group_size == 32
        assert torch.equal(module.dequantize(), weight), name
    kinds = gguf.tensor_types()
    assert kinds["Q4_1"]["count"] == 7 * model.config.n_layer           # q k v o gate up down
    assert set(kinds) == {"Q4_1", "F32", "Q8_0"}                         # norms, the embedding


@pytest.mark.slow
@torch.no_grad()
def test_quantized_model_reproduces_the_shipped_logits(shipped):
    model, _, x, fp32 = shipped
    assert torch.equal(model(x), fp32)              # dequantize, then the same F.linear: bit for bit
    fast = set_path(model, "auto")(x)               # the fused kernel where present: bf16 activations
    set_path(model, "reference")
    assert torch.equal(fast[0, -1].argmax(), fp32[0, -1].argmax())
    assert (fast - fp32).abs().max() < 0.1 * (fp32.max() - fp32.min())
