"""Chapter 1's exercise checks accept the right answer (computed here independently: the decode
step's FLOPs and bytes written out by hand, the planner's arithmetic by hand) and reject wrong
answers and planted-broken code."""
import pytest

from minillm import exercises
from minillm.model.config import get_config


def test_all_keys_registered():
    assert list(exercises.list_exercises("01")) == ["01.1", "01.2", "01.3", "01.4"]


def _decode_intensity(cfg, B, S, w=2):
    """FLOPs / bytes of one decode step (T=1, logits for one row each), by hand, in w-byte elements."""
    L, H, Hkv, D, d, f, V = (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model,
                             cfg.d_ff, cfg.vocab_size)
    mats = [(d, (H + 2 * Hkv) * D), (H * D, d), (d, 2 * f), (f, d)]   # (in, out) per layer
    flops = L * sum(2 * B * k * n for k, n in mats) + 2 * B * d * V
    flops += L * 2 * (2 * B * H * (S + 1) * D)                        # scores and values
    nbytes = L * sum((k * n + B * (k + n)) * w for k, n in mats) + (d * V + B * (d + V)) * w
    nbytes += L * 2 * (B * H * D + B * (S + 1) * Hkv * D) * w         # Q/out and the K/V cache
    return flops / nbytes


def test_01_1_crossover_by_brute_force():
    cfg, ridge = get_config("llama-3-70b"), 989.4e12 / 4.8e12        # the H200's datasheet
    b = next(b for b in range(1, 10_000) if _decode_intensity(cfg, b, 512) >= ridge)
    assert exercises.check("01.1", b)
    assert not exercises.check("01.1", b - 1)                  # still below the ridge
    assert not exercises.check("01.1", round(ridge))           # "B equals the ridge" (bf16 = 2 bytes)
    b0 = next(b for b in range(1, 10_000) if _decode_intensity(cfg, b, 0) >= ridge)
    assert b0 < b and not exercises.check("01.1", b0)         # the cache's reads forgotten


def test_01_2_intensity_limit():
    cfg = get_config("llama-3-70b")
    assert exercises.check("01.2", _decode_intensity(cfg, 1 << 20, 8192))
    # the limit is what one sequence's FLOPs over its own KV bytes tend to: close, not the same
    L, H, Hkv, D = cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    assert not exercises.check("01.2", 2 * H / Hkv / 2 / 4)    # a wrong count of the reuse
    assert not exercises.check("01.2", 1.0)                    # the batch-1 intensity


def test_01_3_sequences_that_fit():
    cfg = get_config("llama-3-8b")
    kv_per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 2
    budget = 0.9 * 141 * 2**30 - cfg.num_params * 2
    blocks = int(budget // (16 * kv_per_token))
    right = blocks // -(-1025 // 16)                           # 65 blocks per sequence
    assert exercises.check("01.3", right)
    assert not exercises.check("01.3", int((0.9 * 141e9 - cfg.num_params * 2) // (16 * kv_per_token)) // 65)
    assert not exercises.check("01.3", blocks // 64)           # 1024 tokens: forgot the new one


def test_01_4_roofline_time_right_and_broken(capsys):
    assert exercises.check("01.4", lambda f, b, p, w: max(f / p, b / w))
    broken = [
        lambda f, b, p, w: f / p + b / w,                      # no overlap
        lambda f, b, p, w: min(f / p, b / w),                  # the faster one
        lambda f, b, p, w: b / w,                              # memory only
        lambda f, b, p, w: max(f * p, b * w),                  # units upside down
        lambda f, b, p, w: None,
        lambda f, b, p, w: 1 / 0,
    ]
    for fn in broken:
        assert not exercises.check("01.4", fn)
    assert "not yet" in capsys.readouterr().out


def test_bad_answers_are_rejected_not_crashing():
    assert not exercises.check("01.1", "285")
    assert not exercises.check("01.2", float("nan"))
