"""Cached generation against the naive reference, sampling against exact enumeration, bad input."""
import pytest
import torch

import minillm
from minillm.model.sampling import logits_to_probs, sample


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_equals_naive_greedy(seed):
    model = minillm.tiny_model(seed=seed, dtype=torch.float64)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert minillm.generate(model, prompt, 40) == minillm.generate_naive(model, prompt, 40)


def test_cached_equals_naive_sampled_with_same_generator():
    model = minillm.tiny_model(seed=3, dtype=torch.float64)
    kw = dict(temperature=0.9, top_k=50, top_p=0.95)
    a = minillm.generate(model, [1, 2, 3], 30, generator=torch.Generator().manual_seed(7), **kw)
    b = minillm.generate_naive(model, [1, 2, 3], 30, generator=torch.Generator().manual_seed(7), **kw)
    c = minillm.generate(model, [1, 2, 3], 30, generator=torch.Generator().manual_seed(8), **kw)
    assert a == b and a != c


def test_batch_generation_equals_one_at_a_time():
    model = minillm.tiny_model(seed=4, dtype=torch.float64)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [1, 1, 1, 1]]
    assert minillm.generate_batch(model, prompts, 12) == [minillm.generate(model, p, 12) for p in prompts]


def test_stop_tokens_end_generation():
    model = minillm.tiny_model(seed=0, dtype=torch.float64)
    full = minillm.generate(model, [1, 2, 3], 20)
    stop = full[5]
    out = minillm.generate(model, [1, 2, 3], 20, stop_token_ids=[stop])
    assert out == full[:full.index(stop) + 1]


def test_top_k_top_p_support_by_enumeration():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    p = torch.softmax(logits, -1)[0]
    # top-k=2: exactly the two largest, renormalized
    pk = logits_to_probs(logits, top_k=2)[0]
    assert torch.allclose(pk, torch.tensor([p[0], p[1], 0, 0, 0]) / (p[0] + p[1]))
    # top-p: smallest prefix of the sorted distribution whose mass reaches top_p
    mass = p.cumsum(0)
    pp = logits_to_probs(logits, top_p=float(mass[1]) + 1e-9)[0]
    assert (pp > 0).tolist() == [True, True, True, False, False]
    assert torch.allclose(pp[:3], p[:3] / mass[2])
    assert (logits_to_probs(logits, top_p=0.01)[0] > 0).sum() == 1           # top token always kept
    # temperature rescales logits before softmax
    assert torch.allclose(logits_to_probs(logits, temperature=0.5), torch.softmax(logits / 0.5, -1))
    assert logits_to_probs(logits, temperature=0)[0].tolist() == [1, 0, 0, 0, 0]


def test_sampling_frequencies_follow_probs():
    probs = logits_to_probs(torch.tensor([[1.0, 0.2, -0.5, 0.3]]), top_k=3).repeat(20000, 1)
    draws = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).double() / len(draws)
    assert freq[2] == 0                                      # outside top-k: never drawn
    assert (freq - probs[0]).abs().max() < 0.015             # ~5 sigma at n = 20000
    assert torch.equal(draws, sample(probs, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(prompt_ids=[1] * 510, max_new_tokens=5), "context"),
    (dict(prompt_ids=[1, 999]), r"\[0, 256\)"),
])
@pytest.mark.parametrize("fn", [minillm.generate, minillm.generate_naive])
def test_bad_input(fn, kwargs, match):
    model = minillm.tiny_model()
    args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        fn(model, **args)
