"""The real SmolLM2-135M-Instruct: minillm against transformers loading the same GGUF itself.

transformers' own GGUF loader is the trusted reference: it dequantizes the file independently
of minillm's weight copy, so a wrong name mapping or layout would show up here.
"""
import pytest
import torch

import minillm
from minillm.model.chat import encode_chat

pytestmark = pytest.mark.slow
PROMPTS = ["Write a haiku about the sea.", "What is 17 times 3?",
           "List three uses of a paperclip."]


@pytest.fixture(scope="module")
def models(smollm2, hf_smollm2):
    return (*smollm2, hf_smollm2)


@torch.no_grad()
def test_logits_match_transformers(models):
    model, tok, hf = models
    for prompt in PROMPTS:
        x = torch.tensor([encode_chat(tok, prompt)])
        ours, ref = model(x), hf(x).logits
        assert (ours - ref).abs().max().item() < 1e-3            # logits are O(10); fp32 sums
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_greedy_64_tokens_are_transformers_greedy_choices(models):
    """64 tokens of minillm's cached greedy decoding, each transformers' argmax after the prompt and
    the tokens before it: greedy decoding by definition, checked by one transformers forward pass
    over prompt + answer instead of 64 steps of its `generate` (most of this file's time)."""
    model, tok, hf = models
    for prompt in PROMPTS[:2]:
        ids = encode_chat(tok, prompt)
        ours = minillm.generate(model, ids, 64)
        logits = hf(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]   # (64, V)
        assert logits.argmax(-1).tolist() == ours


def test_cached_equals_naive_on_real_model(models):
    model, tok, _ = models
    ids = encode_chat(tok, PROMPTS[2])
    assert minillm.generate(model, ids, 24) == minillm.generate_naive(model, ids, 24)


def test_chat_answers(models):
    model, tok, _ = models
    from minillm.model.chat import chat
    assert "Paris" in chat(model, tok, "What is the capital of France?", max_new_tokens=20)


def test_prompt_longer_than_context_is_rejected(models):
    model, _, _ = models
    with pytest.raises(ValueError, match="context of 8192"):
        minillm.generate(model, [1] * 8190, 5)
