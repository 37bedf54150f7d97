"""What logprobs show (vLLM's `logprobs_mode`), the text a stop token leaves, and scoring a prompt
with max_tokens=0.

References: a dense forward pass of the same tiny model, its log-softmax (raw_logprobs), its
logits (raw_logits), and `logits_to_probs` of them (the processed law); the tokenizer's own decode
of the token ids for the text; vLLM's documented behaviour for what is shown: the model's top
tokens under top-k / top-p by default, no stop token text unless include_stop_str_in_output, and
max_tokens=0 with prompt logprobs scoring the prompt only.
"""
import pytest
import torch

from minillm import LLM, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParamError, SamplingParams
from minillm.model.sampling import logits_to_probs

F64 = torch.float64
TV = 64
pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab_size=TV, seed=0, dtype=F64)


def rows(model, ids: list[int]) -> torch.Tensor:
    """(T, V) the model's logits at every position of ids, one dense forward."""
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].double()


def sample_with(tiny, mode: str, p: SamplingParams, prompt=(3, 1, 4, 1, 5)):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64, logprobs_mode=mode))
    out = engine.generate([list(prompt)], p)[0]
    c = out.outputs[0]
    return c, rows(tiny, list(prompt) + c.token_ids)[len(prompt) - 1:]     # row i: token i's


def test_top_logprobs_under_top_p_and_top_k_are_the_models_top_tokens(tiny):
    """Default (raw_logprobs, as vLLM): each token's entry is the model's log-softmax at its
    position, its top 10 ids those of the dense forward, no -inf; ranks in that law."""
    p = SamplingParams(temperature=0.7, top_p=0.3, top_k=5, max_tokens=6, seed=1, logprobs=10)
    c, logits = sample_with(tiny, "raw_logprobs", p)
    for t, entry, row in zip(c.token_ids, c.logprobs, logits):
        ref = torch.log_softmax(row, -1)
        assert set(entry) == set(ref.topk(10).indices.tolist()) | {t}
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-6)
        assert entry[t].rank == 1 + int((ref > ref[t]).sum())


def test_processed_modes_are_the_law_drawn_from(tiny):
    """processed_logprobs: log of the top-k / top-p law (the model's next best tokens, at -inf,
    fill the list past its support); processed_logits: the logits / T inside it, -inf outside."""
    p = SamplingParams(temperature=0.7, top_p=0.5, max_tokens=6, seed=2, logprobs=6)
    c, logits = sample_with(tiny, "processed_logprobs", p)
    for t, entry, row in zip(c.token_ids, c.logprobs, logits):
        law = logits_to_probs(row, p.temperature, p.top_k, p.top_p)                       # (V,)
        best = sorted(range(TV), key=lambda j: (-law[j].item(), -row[j].item()))[:6]
        assert set(entry) == set(best) | {t}
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(law[tok].log().item(), abs=1e-6)
    c, logits = sample_with(tiny, "processed_logits", p)
    for t, entry, row in zip(c.token_ids, c.logprobs, logits):
        law = logits_to_probs(row, p.temperature, p.top_k, p.top_p)
        ref = (row / p.temperature).masked_fill(law == 0, float("-inf"))
        assert all(lp.logprob == pytest.approx(ref[tok].item(), abs=1e-6) for tok, lp in entry.items())


def test_raw_logits_and_greedy_modes(tiny):
    """raw_logits: the model's logits; at temperature 0 both processed modes are the model's
    rows (no processor here), as raw."""
    p = SamplingParams(temperature=0.9, max_tokens=4, seed=3, logprobs=2)
    c, logits = sample_with(tiny, "raw_logits", p)
    for entry, row in zip(c.logprobs, logits):
        assert all(lp.logprob == pytest.approx(row[tok].item(), abs=1e-6) for tok, lp in entry.items())
    g = SamplingParams(max_tokens=4, logprobs=2)
    for mode, ref_of in (("processed_logprobs", lambda r: torch.log_softmax(r, -1)),
                         ("processed_logits", lambda r: r)):
        c, logits = sample_with(tiny, mode, g)
        for entry, row in zip(c.logprobs, logits):
            ref = ref_of(row)
            assert all(lp.logprob == pytest.approx(ref[tok].item(), abs=1e-6)
                       for tok, lp in entry.items())


def test_a_bad_logprobs_mode_is_refused_by_name(tiny):
    for make in (lambda: EngineConfig(logprobs_mode="logprobs"),
                 lambda: LLM(tiny, logprobs_mode="raw")):
        with pytest.raises(ValueError, match="logprobs_mode.*raw_logprobs"):
            make()


def test_max_tokens_0_scores_the_prompt_only(tiny):
    """max_tokens=0 with prompt_logprobs (vLLM's scoring request): no token, finish "length",
    the prompt's logprobs equal the dense forward's log-softmax; without prompt_logprobs it is
    refused, naming max_tokens."""
    prompt = [7, 3, 9, 9, 2, 5, 1]
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=16, max_num_batched_tokens=4))
    out = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    ref = torch.log_softmax(rows(tiny, prompt), -1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(
            ref[i - 1, prompt[i]].item(), abs=1e-6)
    assert engine.num_free_blocks == engine.num_blocks
    with pytest.raises(SamplingParamError, match="max_tokens") as err:
        SamplingParams(max_tokens=0)
    assert err.value.field == "max_tokens"


@pytest.fixture(scope="module")
def small_llm(tok):
    return LLM(tiny_model(vocab_size=len(tok), seed=0), tok, num_blocks=32, block_size=16)


def test_a_stop_token_leaves_no_text_unless_asked(small_llm, tok):
    """vLLM: the token that stops a sequence stays in token_ids but its text is not shown;
    include_stop_str_in_output shows it, and keeps a stop string too."""
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    ids = small_llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tok.decode(ids[i:i + 1]))
    stop = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[ids[at]])
    for keep in (False, True):
        p = SamplingParams(**{**stop.__dict__, "include_stop_str_in_output": keep})
        out = small_llm.generate(["The capital of France is"], p, use_tqdm=False)[0]
        assert out.token_ids == ids[:at + 1] and out.finish_reason == "stop"
        assert out.text == tok.decode(ids[:at + 1 if keep else at], skip_special_tokens=True)
    full = tok.decode(ids, skip_special_tokens=True)
    word = full[len(full) // 2:][:2]
    for keep in (False, True):
        p = SamplingParams(max_tokens=10, ignore_eos=True, stop=[word], include_stop_str_in_output=keep)
        out = small_llm.generate(["The capital of France is"], p, use_tqdm=False)[0]
        cut = full.find(word)
        assert out.text == full[:cut + len(word) if keep else cut] and out.finish_reason == "stop"
