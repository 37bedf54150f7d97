"""minillm's forward pass against transformers' LlamaForCausalLM with the same weights.

Random models of several shapes (GQA and MHA, tied and untied) so this runs without the real
model; transformers is the trusted reference. transformers computes RMSNorm and RoPE tables in
float32 even for float64 models, so the float64 comparison is as tight as float32 allows.
"""
import pytest
import torch

import minillm
from minillm.model.hf_convert import to_hf_model

SHAPES = {
    "gqa-untied": dict(n_head=4, n_kv_head=2),
    "mha-tied": dict(n_head=4, n_kv_head=4, tie_embeddings=True),
    "mqa-untied": dict(n_head=4, n_kv_head=1, n_layer=3),
    "gqa-tied-wide": dict(n_head=6, n_kv_head=2, head_dim=8, d_model=48, tie_embeddings=True),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-5)])
def test_logits_match_transformers(shape, dtype, tol):
    model = minillm.tiny_model(vocab_size=97, seed=1, dtype=dtype, **SHAPES[shape])
    hf = to_hf_model(model)
    x = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = model(x), hf(x).logits
    assert ours.shape == (3, 21, 97)
    assert (ours - ref).abs().max().item() < tol


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_matches_transformers_generate(shape):
    model = minillm.tiny_model(vocab_size=97, seed=2, dtype=torch.float64, **SHAPES[shape])
    hf = to_hf_model(model)
    prompt = [3, 14, 15, 92, 65, 35]
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64,
                          min_new_tokens=64, do_sample=False, pad_token_id=0)
    assert minillm.generate(model, prompt, 64) == ref[0, len(prompt):].tolist()


def test_kv_cache_prefill_in_pieces_matches_one_pass():
    """Chunks of the prompt through the cache give the same logits as one uncached pass."""
    model = minillm.tiny_model(seed=3, dtype=torch.float64)
    x = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = minillm.KVCache(model.config, 2, 40, dtype=torch.float64)
    pieces = [model(x[:, a:b], torch.arange(a, b), cache) for a, b in [(0, 7), (7, 8), (8, 30)]]
    assert torch.allclose(torch.cat(pieces, dim=1), model(x), atol=1e-12, rtol=0)
    # rollback is writing at earlier positions: other tokens from 8 on replace the old ones
    y = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    ref = model(torch.cat([x[:, :8], y], dim=1))[:, 8:]
    assert torch.allclose(model(y, torch.arange(8, 20), cache), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_kv_cache_against_dense_token_by_token(masked):
    """KVCache (slices the filled slots) and StaticKVCache (masks all slots) both give the
    no-cache logits, one token at a time after a prefill, with stale slots past the end."""
    from minillm.model.kv_cache import StaticKVCache
    model = minillm.tiny_model(seed=6, dtype=torch.float64)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    cache = (StaticKVCache if masked else minillm.KVCache)(model.config, 2, 24, dtype=torch.float64)
    model(torch.randint(0, 256, (2, 20)), torch.arange(20), cache)     # junk in slots 0..19
    got = [model(x[:, :9], torch.arange(9), cache)]
    got += [model(x[:, p:p + 1], torch.tensor([p]), cache) for p in range(9, 16)]
    assert torch.allclose(torch.cat(got, dim=1), model(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_kv_cache_positions_buffer_reused_in_place(masked):
    """The cache works out what depends on the positions once per forward pass; a caller that
    refills one positions buffer in place (as a captured step does) still gets the no-cache
    logits at every step, also with a multi-token step between single-token ones."""
    from minillm.model.kv_cache import StaticKVCache
    model = minillm.tiny_model(seed=7, dtype=torch.float64)
    x = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(4))
    cache = (StaticKVCache if masked else minillm.KVCache)(model.config, 2, 20, dtype=torch.float64)
    got = [model(x[:, :6], torch.arange(6)[None], cache)]
    one, three = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    for a, b in [(6, 7), (7, 8), (8, 11), (11, 12), (12, 13), (13, 14)]:
        pos = one if b - a == 1 else three
        pos.copy_(torch.arange(a, b)[None])
        got.append(model(x[:, a:b], pos, cache))
    assert torch.allclose(torch.cat(got, dim=1), model(x), atol=1e-12, rtol=0)


def test_cache_protocol_refuses_missing_or_misshapen_positions():
    model = minillm.tiny_model(seed=3, dtype=torch.float64)
    cache = minillm.KVCache(model.config, 2, 16, dtype=torch.float64)
    x = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="positions are required"):
        model(x, cache=cache)
    with pytest.raises(ValueError, match="positions must be"):
        model(x, torch.arange(3), cache)
    with pytest.raises(ValueError, match="share positions"):
        model(x, torch.arange(8).view(2, 4), cache)            # per-row positions: paged cache's job
    with pytest.raises(ValueError, match="KV cache full"):
        model(x, torch.arange(14, 18), cache)
    with pytest.raises(ValueError, match="batch_size"):
        minillm.KVCache(model.config, 0, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        minillm.KVCache(model.config, 1, model.config.max_seq_len + 1)


def test_logits_index_selects_positions():
    model = minillm.tiny_model(seed=4, dtype=torch.float64)
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    idx = torch.tensor([3, 11])
    assert torch.allclose(model(x, logits_index=idx), model(x)[:, idx], atol=1e-12, rtol=0)


def test_tiny_model_is_deterministic_in_seed():
    a, b, c = (minillm.tiny_model(seed=s) for s in (5, 5, 6))
    x = torch.arange(10)[None]
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), c(x))


def test_presets_and_param_counts():
    # published sizes: SmolLM2 134.5M (tied), Llama-2-7B 6.74B, Llama-3-8B 8.03B, Llama-2-70B 68.98B
    expected = {"smollm2-135m": 134_515_008, "llama-2-7b": 6_738_415_616,
                "llama-3-8b": 8_030_261_248, "llama-2-70b": 68_976_648_192}
    for name, n in expected.items():
        assert minillm.get_config(name).num_params == n
    real = minillm.tiny_model(**{k: v for k, v in vars(minillm.get_config("smollm2-135m")).items()
                                 if k not in ("name", "n_layer", "vocab_size")}, n_layer=1,
                              vocab_size=100)
    assert sum(p.numel() for p in real.parameters()) == real.config.num_params


@pytest.mark.parametrize("bad", [dict(n_head=4, n_kv_head=3), dict(n_layer=0), dict(d_model=-1)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        minillm.tiny_model(**bad)
    with pytest.raises(ValueError, match="unknown model preset"):
        minillm.get_config("gpt-5")


