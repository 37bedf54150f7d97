"""Chapter 7's exercise checks: each accepts the right answer, computed here by hand from the
format's rule, and rejects a wrong one or a broken implementation."""
import struct

from minillm import exercises
from minillm.model.config import get_config


def test_07_1_q4_1_bytes_by_hand():
    cfg = get_config("smollm2-135m")
    C, F, D = cfg.d_model, cfg.d_ff, cfg.head_dim
    weights = cfg.n_layer * (C * (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D * C + 3 * C * F)
    assert exercises.check("07.1", weights // 32 * 20)                # 20 bytes per 32 weights
    assert not exercises.check("07.1", weights // 2)                  # the scales are not free


def test_07_2_llama_3_70b_int4_by_hand():
    cfg = get_config("llama-3-70b")
    C, F, D = cfg.d_model, cfg.d_ff, cfg.head_dim
    proj = cfg.n_layer * (C * (cfg.n_head + 2 * cfg.n_kv_head) * D + cfg.n_head * D * C + 3 * C * F)
    rest = 2 * cfg.vocab_size * C + (2 * cfg.n_layer + 1) * C          # embed, lm_head, norms
    gb = (proj * (4 + 32 / 128) / 8 + 2 * rest) / 1e9
    assert exercises.check("07.2", gb)
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
