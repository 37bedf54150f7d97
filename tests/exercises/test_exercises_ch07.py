"""Chapter 7's exercise checks: each accepts the right answer, computed here by hand from the
format's rule, and rejects a wrong one or a broken implementation."""
import struct

import pytest
import torch

from minillm import exercises
from minillm.model.config import get_config


def test_07_1_q4_1_g64_bytes_by_hand():
    cfg = get_config("smollm2-135m")
    C, F, D = cfg.d_model, cfg.d_ff, cfg.head_dim
    weights = cfg.n_layer * (C * (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D * C + 3 * C * F)
    assert exercises.check("07.1", weights // 64 * 36)                # 32 + 4 bytes per 64 weights
    assert not exercises.check("07.1", weights // 32 * 20)            # the file's groups of 32
    assert not exercises.check("07.1", weights // 2)                  # the scales are not free


def test_07_2_llama_3_70b_int4_g64_by_hand():
    cfg = get_config("llama-3-70b")
    C, F, D = cfg.d_model, cfg.d_ff, cfg.head_dim
    proj = cfg.n_layer * (C * (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D * C + 3 * C * F)
    rest = 2 * cfg.vocab_size * C + (2 * cfg.n_layer + 1) * C          # embed, lm_head, norms
    gb = (proj * (4 + 32 / 64) / 8 + 2 * rest) / 1e9
    assert exercises.check("07.2", gb)
    assert not exercises.check("07.2", (proj * (4 + 32 / 128) / 8 + 2 * rest) / 1e9)   # groups of 128
    assert not exercises.check("07.2", cfg.num_params * 0.5 / 1e9)    # "4 bits, nothing else"


def dequantize_q4_1(block: bytes) -> list:
    d, m = struct.unpack("<ee", block[:4])
    qs = block[4:20]
    codes = [b & 0xF for b in qs] + [b >> 4 for b in qs]
    return [d * q + m for q in codes]


def test_07_3_right_and_wrong_decoders():
    assert exercises.check("07.3", dequantize_q4_1)

    def interleaved(block):                                           # the other plausible order
        d, m = struct.unpack("<ee", block[:4])
        return [d * q + m for b in block[4:20] for q in (b & 0xF, b >> 4)]
    assert not exercises.check("07.3", interleaved)

    def no_minimum(block):
        d, _ = struct.unpack("<ee", block[:4])
        return [d * q for q in [b & 0xF for b in block[4:20]] + [b >> 4 for b in block[4:20]]]
    assert not exercises.check("07.3", no_minimum)
    assert not exercises.check("07.3", lambda block: 1 / 0)          # raising is a wrong answer
    assert not exercises.check("07.3", "not a function")


def test_07_4_int8_kv_bytes_by_hand():
    assert exercises.check("07.4", 2 * 32 * 8 * (128 + 2))             # codes + an fp16 scale
    assert not exercises.check("07.4", 2 * 32 * 8 * 128)               # the scales are not free


def fake_quant_int8(x):
    s = (x.abs().amax(-1, keepdim=True) / 127).half().float()          # the stored fp16 scale
    return torch.round(x / s).clamp(-127, 127) * s


def test_07_5_right_and_wrong_int8_round_trips():
    assert exercises.check("07.5", fake_quant_int8)
    assert not exercises.check("07.5", lambda x: torch.round(x / (x.abs().amax(-1, keepdim=True) / 127))
                               * (x.abs().amax(-1, keepdim=True) / 127))   # scale not rounded to fp16
    assert not exercises.check("07.5", lambda x: fake_quant_int8(x * 127 / 128) * 128 / 127)
    assert not exercises.check("07.5", lambda x: 1 / 0)


def compensate(W, H, q0):
    """GPTQ's step written from the normal equations: solve H[1:, 1:] dW = -H[1:, 0] e."""
    e = W[:, 0] - q0                                                    # (N,)
    delta = torch.linalg.solve(H[1:, 1:], H[1:, :1]).t()                # (1, K - 1)
    out = W.clone()
    out[:, 0] = q0
    out[:, 1:] += e[:, None] * delta
    return out


def test_07_7_right_and_wrong_compensation():
    assert exercises.check("07.7", compensate)
    assert not exercises.check("07.7", lambda W, H, q0: torch.cat([q0[:, None], W[:, 1:]], 1))  # RTN
    assert not exercises.check("07.7", lambda W, H, q0: compensate(W, H.diag().diag(), q0))


@pytest.mark.slow
def test_07_6_outlier_count_by_a_forward_hook(smollm2):
    """Counted independently of quant.outliers: a hook on the real model's last down_proj (the
    shared model: the hook comes off whatever happens)."""
    from minillm.quant.quality import calibration_ids
    model, tok = smollm2
    seen = []
    handle = model.layers[-1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        with torch.no_grad():
            model(calibration_ids(tok, 4, 128))
    finally:
        handle.remove()
    count = int((seen[0].abs() >= 6).reshape(-1, seen[0].shape[-1]).any(0).sum())
    assert exercises.check("07.6", count)
    assert not exercises.check("07.6", count + 1)
