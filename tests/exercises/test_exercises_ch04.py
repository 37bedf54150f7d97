"""Chapter 4's exercise checks accept the right answer, computed here another way (from the
lengths by hand, from the KV formula), and reject wrong answers and broken admission rules."""
import math

import pytest
import torch

from minillm import exercises
from minillm.lab.workloads import poisson_workload, replay
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.exercises import ch04
from minillm.model.config import get_config
from minillm.model.generate import generate
from minillm.model.loading import tiny_model


def _static(r, c):
    return c if r == 0 else 0


def _continuous(r, c):
    return c - r


def test_04_1_static_steps_from_lengths_alone():
    work = poisson_workload(24, math.inf, 256, seed=0, prompt_len=(8, 64), output_len=(4, 96))
    lens = [w.max_tokens for w in work]
    by_hand = sum(max(lens[i:i + 4]) for i in range(0, 24, 4))   # each batch of 4 lasts its longest
    assert exercises.check("04.1", by_hand)
    assert not exercises.check("04.1", by_hand + 1)
    assert not exercises.check("04.1", max(lens))          # that is continuous batching's floor
    assert not exercises.check("04.1", sum(max(lens[i:i + 6]) for i in range(0, 24, 6)))  # the chapter's 6


def test_04_2_saturation_rate():
    lens = [w.max_tokens for w in poisson_workload(256, math.inf, 256, seed=0, prompt_len=(8, 64),
                                                   output_len=(4, 128))]
    rate = 8 * len(lens) / sum(lens)
    assert exercises.check("04.2", rate)
    assert not exercises.check("04.2", 1.1 * rate)
    assert not exercises.check("04.2", "fast")
    sweep = [w.max_tokens for w in poisson_workload(120, math.inf, 256, seed=0, prompt_len=(8, 64),
                                                    output_len=(4, 96))]
    assert not exercises.check("04.2", 8 * len(sweep) / sum(sweep))    # the load sweep's, printed
    assert not exercises.check("04.2", 2 * rate)                       # the benchmark's 16 slots


def test_04_3_accepts_static_rejects_continuous_and_over_admission():
    assert exercises.check("04.3", _static)
    assert not exercises.check("04.3", _continuous)              # the planted broken version
    assert not exercises.check("04.3", lambda r, c: c)           # over-admits into a full batch
    assert not exercises.check("04.3", lambda r, c: 1 if r == 0 else 0)   # batches of one
    assert not exercises.check("04.3", 42)


def test_04_4_swap_bytes_from_the_kv_formula():
    cfg = get_config("smollm2-135m")
    per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4        # K and V, fp32
    assert exercises.check("04.4", 7 * 16 * per_token)                  # 100 tokens -> 7 blocks
    assert not exercises.check("04.4", 100 * per_token)                 # forgets whole blocks
    assert not exercises.check("04.4", 7 * 16 * per_token // 2)         # bf16, not fp32


def test_serve_loop_matches_generate_and_the_engine():
    model = tiny_model(vocab_size=256, seed=0, dtype=torch.float64)
    work = poisson_workload(9, math.inf, 256, seed=5, prompt_len=(4, 20), output_len=(2, 20))
    toks, steps = ch04.serve_loop(model, work, 3, _continuous)
    assert toks == [generate(model, w.prompt_token_ids, w.max_tokens) for w in work]
    eng = LLMEngine(model, EngineConfig(block_size=8, num_blocks=64, max_num_seqs=3,
                                        max_num_batched_tokens=128))
    replay(eng, work, time_unit="steps")
    assert steps == len(eng.trace)


def test_every_key_is_listed():
    assert sorted(exercises.list_exercises("04")) == ["04.1", "04.2", "04.3", "04.4"]
