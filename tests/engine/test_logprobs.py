"""Logprobs, prompt logprobs and best_of from the engine, and the logits processors' exactness
under speculative decoding.

References: transformers' model (loaded from the same GGUF by its own loader) and its
log-softmax of the whole sequence for greedy logprobs and prompt logprobs; a dense forward pass
of the tiny model with the penalties written out here (OpenAI's formula, transformers' repetition
rule) and `logits_to_probs` for sampled logprobs; exact enumeration of the penalized law with a
chi-square test for speculative sampling (helpers from test_spec_stats.py).
"""
import itertools
from dataclasses import replace

import pytest
import torch

import minillm.engine.logits_process as logits_process
from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.model.sampling import logits_to_probs
from test_spec_stats import LENGTH, PROMPT, SMALL, V, chi_square_pvalue

F64 = torch.float64
TV = 64                           # the tiny model's vocab for the deterministic checks
pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


def penalized_by_hand(logits, prompt, prefix, p: SamplingParams):
    """(V,) logits after `prompt + prefix` -> the penalized logits, written out token by token."""
    out = logits.clone()
    for t in set(prompt) | set(prefix):                 # repetition: prompt + output
        if p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(prefix):                               # OpenAI: output only
        out[t] -= p.presence_penalty + p.frequency_penalty * prefix.count(t)
    return out


def law_by_hand(model, prompt, prefix, p: SamplingParams):
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + list(prefix)]))[0, -1]
    x = penalized_by_hand(logits, prompt, list(prefix), p)[None]
    return logits_to_probs(x, p.temperature, p.top_k, p.top_p, min_p=p.min_p)[0]      # (V,)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab_size=TV, seed=0, dtype=F64)


# ---- greedy logprobs and prompt logprobs against transformers --------------------------------
@pytest.fixture(scope="module")
def real_pair(smollm2, hf_smollm2):
    return (*smollm2, hf_smollm2)


@pytest.mark.slow
def test_greedy_and_prompt_logprobs_match_transformers(real_pair):
    """Chunks of 5 tokens (the prompt's rows come from three chunks), beside a request that asks
    for nothing (it gets no logprobs). Output token i: the log-softmax of transformers' logits
    at its position, the top-5 ids the same; prompt token i: the same at position i - 1."""
    model, tok, hf = real_pair
    prompt = tok.encode("The capital of France is Paris, and the capital of Italy is")
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=5),
                       tokenizer=tok)
    params = SamplingParams(max_tokens=5, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out, other = engine.generate([prompt, "Hello"], [params, SamplingParams(max_tokens=3)])
    c = out.outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + c.token_ids])).logits[0], -1)   # (T, V)
    assert len(c.logprobs) == len(c.token_ids) == 5
    for i, (tok_id, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tok_id].rank == 1 and tok_id == int(row.argmax())
        top = row.topk(5)
        assert set(entry) == set(top.indices.tolist())
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=2e-3)
            assert lp.decoded_token == tok.decode([t])
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3, 4, 5]
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row, t = ref[i - 1], prompt[i]
        assert plp[i][t].logprob == pytest.approx(row[t].item(), abs=2e-3)
        assert abs(plp[i][t].rank - (1 + int((row > row[t]).sum()))) <= 1   # ties within 1e-3
        assert set(plp[i]) - {t} <= set(row.topk(4).indices.tolist()) and len(plp[i]) >= 3
    assert other.outputs[0].logprobs is None and other.prompt_logprobs is None
    assert other.outputs[0].cumulative_logprob is None
    assert engine.num_free_blocks == engine.num_blocks


# ---- sampled logprobs: the law each token was drawn from --------------------------------------
@pytest.mark.parametrize("spec", [False, True])
def test_sampled_logprobs_are_the_processed_law(tiny, spec):
    """Each token's logprob (and its top-3) is the log of the law by hand at its position:
    penalties, then temperature / top-k / min-p / top-p. Under speculative decoding too: an
    accepted draft's law is its target row's."""
    p = SamplingParams(temperature=0.9, top_k=20, min_p=0.02, top_p=0.95, max_tokens=24, seed=3,
                       presence_penalty=-1.5, frequency_penalty=-0.5, repetition_penalty=0.8,
                       logprobs=3)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    cfg = dict(num_speculative_tokens=3, speculative_method="ngram") if spec else {}
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                          logprobs_mode="processed_logprobs", **cfg))
    c = engine.generate([prompt], p)[0].outputs[0]
    if spec:
        assert engine.spec_stats.num_accepted_tokens > 0
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        law = law_by_hand(tiny, prompt, c.token_ids[:i], p)
        assert law[t] > 0
        assert entry[t].logprob == pytest.approx(law[t].log().item(), abs=1e-6)   # drawn in fp32
        assert entry[t].rank == 1 + int((law > law[t]).sum())
        with torch.inference_mode():              # past the law's support: the model's order
            raw = tiny(torch.tensor([prompt + c.token_ids[:i]]))[0, -1]
        top = sorted(range(TV), key=lambda j: (-law[j].item(), -raw[j].item()))[:3]
        assert set(entry) == set(top) | {t}


def test_greedy_penalized_output_is_the_same_with_speculation(tiny):
    """Greedy with penalties that make the model repeat itself (so n-gram drafts get accepted):
    the tokens and their logprobs equal the plain engine's."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2]]
    p = [SamplingParams(max_tokens=30, presence_penalty=-2.0, frequency_penalty=-0.3, logprobs=2),
         SamplingParams(max_tokens=30, repetition_penalty=0.7, logit_bias={9: 3.0}, logprobs=2,
                        min_tokens=5, stop_token_ids=[2])]
    base = dict(block_size=4, num_blocks=128, max_num_batched_tokens=16)
    plain = LLMEngine(tiny, EngineConfig(**base)).generate(prompts, p)
    engine = LLMEngine(tiny, EngineConfig(num_speculative_tokens=3, speculative_method="ngram", **base))
    spec = engine.generate(prompts, p)
    assert engine.spec_stats.num_accepted_tokens > 5
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-6) for t in x)


# ---- best_of ------------------------------------------------------------------------------------
def test_best_of_returns_the_n_best_by_cumulative_logprob(tiny):
    """best_of=5, n=2 samples the same 5 completions as n=5 (the seed rule draws token k of
    completion i alike), and returns the 2 with the highest cumulative logprob, best first."""
    prompt = [3, 1, 4, 1, 5]
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8))
    kw = dict(temperature=1.0, max_tokens=6, seed=11)
    every, best = engine.generate([prompt, prompt], [SamplingParams(n=5, logprobs=0, **kw),
                                                     SamplingParams(n=2, best_of=5, **kw)])
    scores = [sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)) for c in every.outputs]
    order = sorted(range(5), key=lambda i: -scores[i])[:2]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [every.outputs[i].token_ids for i in order]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx([scores[i] for i in order])
    assert best.outputs[0].logprobs is None                 # not asked for
    assert len(set(map(tuple, (c.token_ids for c in every.outputs)))) == 5
    assert engine.num_free_blocks == engine.num_blocks      # the 3 others gave their blocks back


def test_prompt_logprobs_with_prefix_caching_skip_the_cache(tiny):
    """A prompt_logprobs request whose prefix is cached still gets every prompt position, equal
    to a dense forward's log-softmax (vLLM skips the cache for it); a plain request reads it."""
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=32, enable_prefix_caching=True))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    engine.generate([prompt], SamplingParams(max_tokens=1))              # caches 2 blocks
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.metrics.num_cached_tokens == 0
    with torch.inference_mode():
        ref = torch.log_softmax(tiny(torch.tensor([prompt]))[0].float(), -1)      # (T, V)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(),
                                                                          abs=1e-6)
    again = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert again.metrics.num_cached_tokens == 8
    assert engine.num_free_blocks == engine.num_blocks


# ---- the law under speculative decoding, by enumeration ----------------------------------------
PENALIZED = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0,
                           repetition_penalty=1.2, max_tokens=LENGTH + 1)


@pytest.fixture(scope="module")
def small():
    """The target, and a draft model with the same weights: its q is the unpenalized law, so
    drafts are often accepted and are often tokens the output does not hold yet (the case where
    row j must count drafts[:j])."""
    return (tiny_model(vocab_size=V, seed=0, dtype=F64, **SMALL),
            tiny_model(vocab_size=V, seed=0, dtype=F64, **SMALL))


def exact_penalized_law(model, p):
    law = torch.zeros((V,) * LENGTH, dtype=F64)
    for seq in itertools.product(range(V), repeat=LENGTH):
        law[seq] = torch.stack([law_by_hand(model, PROMPT, seq[:i], p)[seq[i]]
                                for i in range(LENGTH)]).prod()
    return law


def spec_samples(models, n, seed):
    cfg = EngineConfig(block_size=16, num_blocks=n, max_num_seqs=n, max_num_batched_tokens=8 * n,
                       num_speculative_tokens=2, speculative_method="draft")
    engine = LLMEngine(models[0], cfg, draft_model=models[1])
    outs = engine.generate([PROMPT] * n, [replace(PENALIZED, seed=seed * 10**6 + i)
                                          for i in range(n)])
    assert engine.spec_stats.num_accepted_tokens > 0
    return torch.tensor([o.token_ids[:LENGTH] for o in outs])


def test_penalized_law_is_kept_under_rejection_sampling(small, monkeypatch):
    """The first 3 tokens of 500 penalized requests, speculated with K = 2 draft-model drafts,
    follow the exact penalized law (p > 1e-3); with verify rows that count only the output (row
    j blind to drafts[:j]) the same test fails by a wide margin (p < 1e-6)."""
    law = exact_penalized_law(small[0], PENALIZED)
    assert law.sum().item() == pytest.approx(1.0)
    p = chi_square_pvalue(spec_samples(small, 500, seed=5), law)
    print(f"penalized, draft model K=2: p = {p:.4f}")
    assert p > 1e-3
    real = logits_process.token_counts
    monkeypatch.setattr(logits_process, "token_counts",
                        lambda output, drafts, V, device: real(output, [], V, device).expand(
                            len(drafts) + 1, -1).clone())
    p_bad = chi_square_pvalue(spec_samples(small, 500, seed=6), law)
    print(f"rows blind to drafts: p = {p_bad:.3g}")
    assert p_bad < 1e-6
