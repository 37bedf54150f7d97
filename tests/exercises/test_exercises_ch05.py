"""Chapter 5's exercise checks: each accepts the right answer, computed here independently (hand
arithmetic, a linear scan, the scheduler's rule worked out by hand), and rejects a wrong one or a
broken implementation."""
import math

import pytest

from minillm import exercises
from minillm.analysis.roofline import get_hardware, step_costs, total_cost
from minillm.model.config import get_config


def test_05_1_ridge_chunk_by_linear_scan():
    cfg, hw = get_config("llama-3-8b"), get_hardware("h200")
    t = 1                          # the first T whose step intensity reaches the ridge, one by one
    while total_cost(step_costs(cfg, 1, t, 0, "bf16")).intensity < hw.ridge("bf16"):
        t += 1
    assert exercises.check("05.1", t)
    assert not exercises.check("05.1", round(hw.ridge("bf16")))    # the weights-only estimate


def test_05_2_and_05_3_steps_by_hand():
    # decode-first: each step 64 - 4 = 60 prompt tokens -> ceil(400 / 60) = 7 steps
    assert exercises.check("05.2", math.ceil(400 / (64 - 4)))
    assert not exercises.check("05.2", math.ceil(256 / (64 - 4)))   # the chapter's 256 tokens
    # prefill-first: 6 steps of 64 prompt tokens and no decodes, then the last 16 tokens share a
    # step with the decodes -> a running request's next token comes 6 + 1 steps later
    assert exercises.check("05.3", 400 // 64 + 1)
    assert not exercises.check("05.3", 1)
    assert not exercises.check("05.3", math.ceil(256 / 64) + 1)     # the chapter's 256 tokens


def test_05_6_cached_prefix_by_hand():
    # 16 cached blocks of 16 = 256 tokens need no compute: 384 - 256 = 128 at 60 a step -> 3 steps
    assert exercises.check("05.6", math.ceil((384 - 256) / (64 - 4)))
    assert not exercises.check("05.6", math.ceil(384 / (64 - 4)))     # as if nothing were cached


def test_05_4_h100_stall_by_hand():
    cfg, hw, T = get_config("mistral-7b"), get_hardware("h100-sxm"), 32768
    d, D, H, Hkv, L = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.n_layer
    per_layer = d * (H + 2 * Hkv) * D + H * D * d + 3 * d * cfg.d_ff      # linear weights
    flops = 2 * per_layer * L * T + 4 * L * H * T * T * D                  # matmuls + QK^T, PV
    # every op but lm_head is compute-bound at 32,768 tokens; lm_head (one row) is a weight read
    lm_head = (d * cfg.vocab_size + d + cfg.vocab_size) * 2 / hw.mem_bandwidth
    ms = 1e3 * (flops / hw.peak("bf16") + lm_head)
    assert exercises.check("05.4", ms)
    assert not exercises.check("05.4", ms * 1.2)


def chunk_plan(prompt_len, num_decodes, budget):
    chunk = budget - num_decodes
    return [chunk] * (prompt_len // chunk) + ([prompt_len % chunk] if prompt_len % chunk else [])


def chunk_plan_ignores_decodes(prompt_len, num_decodes, budget):
    return chunk_plan(prompt_len, 0, budget)


def chunk_plan_off_by_one(prompt_len, num_decodes, budget):
    return chunk_plan(prompt_len, num_decodes + 1, budget) if budget > num_decodes + 1 else [1] * prompt_len


@pytest.mark.parametrize("broken", [chunk_plan_ignores_decodes, chunk_plan_off_by_one,
                                    lambda *a: tuple(), "not a function"])
def test_05_5_rejects_broken_plans(broken):
    assert not exercises.check("05.5", broken)


def test_05_5_accepts_the_rule():
    assert exercises.check("05.5", chunk_plan)


def test_05_7_and_05_8_partial_prefills_by_hand():
    # 05.7: every step has 64 - 4 decodes - at most 3 short decodes >= 40 tokens left for the long
    # prompt, so the threshold sets its chunk: ceil(256 / 40) = 7 steps
    assert exercises.check("05.7", math.ceil(256 / 40))
    assert not exercises.check("05.7", math.ceil(256 / (64 - 4)))    # as if nothing were capped
    # 05.8, one partial slot (the long prompt's): step 1 leaves 64 - 4 - 40 = 20 -> short 1 whole
    # (16), 4 left cannot finish short 2; step 2 leaves 64 - 5 - 40 = 19 -> short 2; step 3 leaves
    # 64 - 6 - 40 = 18 -> short 3, which samples in its third step
    left = [64 - (4 + k) - 40 for k in range(3)]
    assert all(16 <= x < 32 for x in left)                           # one short prompt a step
    assert exercises.check("05.8", 3)
    assert not exercises.check("05.8", 1)                             # as if each short ran at once


def test_every_chapter5_exercise_is_listed_and_bad_keys_raise():
    assert list(exercises.list_exercises("05")) == ["05.1", "05.2", "05.3", "05.4", "05.5", "05.6",
                                                    "05.7", "05.8"]
    with pytest.raises(ValueError, match="05.9"):
        exercises.check("05.9", 1)
