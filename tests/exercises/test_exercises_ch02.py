"""Chapter 2's exercise checks accept the right answer (computed here independently, by
arithmetic on the model shapes and a direct count of the sampled lengths) and reject wrong
answers and planted-broken code."""
import math

import torch

from minillm import exercises
from minillm.model.config import get_config


def test_all_keys_registered():
    assert list(exercises.list_exercises("02")) == ["02.1", "02.2", "02.3", "02.4", "02.5"]


def test_02_1_vocabulary():
    l3, mi = get_config("llama-3-8b"), get_config("mistral-7b")
    per_token = 2 * mi.n_layer * mi.n_kv_head * mi.head_dim * 2   # K and V, bf16
    right = (l3.num_params - mi.num_params) * 2 / per_token
    assert exercises.check("02.1", right)
    assert not exercises.check("02.1", -right)                 # Mistral has the more room
    assert not exercises.check("02.1", right / 2)              # forgot bf16's 2 bytes of weights
    assert not exercises.check("02.1", (l3.num_params - mi.num_params) * 2 / 1e9)   # GB, not tokens


def test_02_2_fp8_70b_on_h200():
    cfg = get_config("llama-3-70b")
    kv_per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 1       # fp8
    blocks = int((0.9 * 141 * 2**30 - cfg.num_params * 1) // (16 * kv_per_token))
    right = blocks // (32768 // 16)
    assert exercises.check("02.2", right)
    assert not exercises.check("02.2", int((0.9 * 141 * 2**30 - cfg.num_params * 2)
                                           // (16 * kv_per_token)) // 2048)   # bf16 weights
    assert not exercises.check("02.2", right + 2)


def test_02_3_static_waste_by_direct_count():
    # the same lognormal draw, written out: exp(log(128) + 2 z), rounded up, in [1, 2048]
    z = torch.randn(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lengths = [min(2048, max(1, math.ceil(x))) for x in torch.exp(math.log(128) + 2.0 * z).tolist()]
    right = 1 - sum(lengths) / (2000 * 2048)
    assert exercises.check("02.3", right)
    assert not exercises.check("02.3", 1 - right)              # used, not wasted
    assert not exercises.check("02.3", 0.878)                  # sigma=1.2's answer


def test_02_4_int4_context():
    cfg = get_config("llama-2-7b")
    right = cfg.num_params * 2 / (32 * 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 0.5)
    assert exercises.check("02.4", right)
    assert not exercises.check("02.4", right / 4)              # int4 weights as well
    assert not exercises.check("02.4", right * 32)             # forgot the batch


def test_02_5_bytes_per_token_right_and_broken(capsys):
    assert exercises.check("02.5", lambda c, b: 2 * c.n_layer * c.n_kv_head * c.head_dim * b)
    broken = [
        lambda c, b: 2 * c.n_layer * c.n_head * c.head_dim * b,       # MHA formula: wrong for GQA
        lambda c, b: c.n_layer * c.n_kv_head * c.head_dim * b,        # K only
        lambda c, b: 2 * c.n_layer * c.d_model * b,                   # the article's 2*L*d*b
        lambda c, b: 2 * c.n_kv_head * c.head_dim * b,                # one layer
        lambda c, b: None,
    ]
    for fn in broken:
        assert not exercises.check("02.5", fn)
    assert "not yet" in capsys.readouterr().out
