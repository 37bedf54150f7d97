"""The engine's sampled paths follow the exact law (review T1, T2).

`LLMEngine.generate` serves N requests for one prompt on a 5-token float64 tiny model; the first
3 generated tokens of each are one sample of the joint law, and N of them are compared with the
exact law by a Pearson chi-square test (`exact_target_law` and `chi_square_pvalue` from
test_spec_stats.py: enumeration of all V^3 continuations, each conditional processed by
`logits_to_probs`). Plain sampling (temperature, top-k, top-p) and speculative sampling inside the
engine (K = 2 drafts from an n-gram lookup or from a draft model, verified in the ragged batch)
must both reproduce it, with a seed per request or with the engine's own generator.

The reference is not just the code under test: `test_reference_law_by_hand` rebuilds every law
used here with a softmax, top-k and top-p written out in plain Python, one model call per prefix.

Threshold: a correct sampler must give p > 1e-3 (fixed seeds, so the test is deterministic). The
negative controls break the sampler inside the engine (monkeypatched) and must give p < 1e-6.
"""
import itertools
import math

import pytest
import torch

import minillm.engine.sampler as engine_sampler
import minillm.spec.rejection as speculative
from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from test_spec_stats import LENGTH, PROMPT, SMALL, V, chi_square_pvalue, exact_target_law

F64 = torch.float64
ALPHA = 1e-3           # a correct sampler passes
POWER = 1e-6           # a broken one fails by a wide margin

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab_size=V, seed=0, dtype=F64, **SMALL)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(vocab_size=V, seed=1, dtype=F64, **SMALL)


def engine_samples(target, params, n, seed, seeded=True, method=None, draft=None):
    """n requests of PROMPT in one `generate` call -> ((n, LENGTH) first tokens, the engine).

    seeded: request i has SamplingParams(seed=seed * 10**6 + i); else every request draws from
    the engine's generator, EngineConfig(seed=seed). With speculation max_tokens is LENGTH + 1,
    so the first verify step (after the prefill's token) may draft the full K = 2."""
    temperature, top_k, top_p = params
    spec = {} if method is None else dict(num_speculative_tokens=2, speculative_method=method)
    cfg = EngineConfig(block_size=16, num_blocks=n, max_num_seqs=n, max_num_batched_tokens=8 * n,
                       seed=seed, **spec)
    engine = LLMEngine(target, cfg, draft_model=draft)
    sps = [SamplingParams(temperature=temperature, top_k=-1 if top_k is None else top_k,
                          top_p=1.0 if top_p is None else top_p,
                          max_tokens=LENGTH + (method is not None),
                          seed=seed * 10**6 + i if seeded else None) for i in range(n)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)       # an unseeded draft model draws from the global RNG (B5)
        outs = engine.generate([PROMPT] * n, sps)
    assert engine.num_free_blocks == engine.num_blocks
    return torch.tensor([o.token_ids[:LENGTH] for o in outs]), engine


def pvalue(target, samples, params):
    return chi_square_pvalue(samples, exact_target_law(target, PROMPT, params))


# ---- the reference law, by hand ----------------------------------------------------------------
def processed_by_hand(logits: list[float], temperature, top_k, top_p) -> list[float]:
    """Temperature, then top-k (ties at the k-th value kept), then top-p, in plain Python."""
    z = [x / temperature for x in logits]
    if top_k is not None and 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    probs = [x / sum(e) for x in e]
    if top_p is not None and top_p < 1:
        keep, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= top_p:            # the smallest set of best tokens whose mass reaches top_p
                break
            keep.add(i)
            mass += probs[i]
        probs = [p / mass if i in keep else 0.0 for i, p in enumerate(probs)]
    return probs


@torch.inference_mode()
def law_by_hand(model, params) -> torch.Tensor:
    law = torch.zeros((V,) * LENGTH, dtype=F64)
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob = 1.0
        for i in range(LENGTH):
            logits = model(torch.tensor([PROMPT + list(seq[:i])]))[0, -1].tolist()
            prob *= processed_by_hand(logits, *params)[seq[i]]
        law[seq] = prob
    return law


PLAIN = [(1.3, None, None), (0.7, 3, None), (1.0, None, 0.8), (0.8, 3, 0.9)]
SPEC = [(1.0, None, None), (0.8, 3, 0.9)]


def test_reference_law_by_hand(target):
    for params in sorted(set(PLAIN + SPEC), key=str):
        law = exact_target_law(target, PROMPT, params)
        assert torch.allclose(law, law_by_hand(target, params), rtol=1e-9, atol=1e-12), params
        assert law.sum().item() == pytest.approx(1.0)
    # top-k and top-p really cut the law: some continuations become impossible
    assert (exact_target_law(target, PROMPT, (0.7, 3, None)) == 0).any()
    assert (exact_target_law(target, PROMPT, (1.0, None, 0.8)) == 0).any()


# ---- plain sampling through the engine ---------------------------------------------------------
@pytest.mark.parametrize("params,seeded", [(PLAIN[0], True), (PLAIN[1], True), (PLAIN[2], True),
                                           (PLAIN[3], False)])
def test_engine_sampling_law(target, params, seeded):
    samples, _ = engine_samples(target, params, 3000, seed=10 + PLAIN.index(params), seeded=seeded)
    p = pvalue(target, samples, params)
    print(f"plain {params} seeded={seeded}: p = {p:.4f}")
    assert p > ALPHA


# ---- speculative sampling through the engine ---------------------------------------------------
@pytest.mark.parametrize("method,params,seeded,n", [
    ("ngram", SPEC[0], True, 2000), ("ngram", SPEC[1], False, 2000),
    ("draft", SPEC[1], True, 1000), ("draft", SPEC[0], False, 1000)])
def test_engine_speculative_sampling_law(target, draft, monkeypatch, method, params, seeded, n):
    qs = []                              # the q each verify call gets (None: a one-hot drafter)

    def spy(target_probs, draft_probs, draft_token_ids, generator=None):
        qs.append(draft_probs)
        return speculative.rejection_sample(target_probs, draft_probs, draft_token_ids, generator)

    monkeypatch.setattr(engine_sampler, "rejection_sample", spy)
    samples, engine = engine_samples(target, params, n, seed=20 + seeded, seeded=seeded,
                                     method=method, draft=draft if method == "draft" else None)
    s = engine.spec_stats
    # the rejection-sampling branch ran: drafts accepted and rejected, and K = 2 rounds occurred
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens and s.num_draft_tokens > s.num_spec_steps
    assert len(qs) == s.num_spec_steps
    # a dropped q would still pass the law (see the controls below): check it reaches the verifier
    assert all((q is None) == (method == "ngram") for q in qs)
    p = pvalue(target, samples, params)
    print(f"{method} {params} seeded={seeded}: p = {p:.4f}, accepted fraction {s.accepted_fraction:.2f}")
    assert p > ALPHA


# ---- negative controls: the same tests reject broken samplers inside the engine ------------------
def _plain_bug(bug):
    real = engine_sampler.logits_to_probs
    if bug == "ignores_top_p":
        return lambda logits, temperature, top_k, top_p: real(logits, temperature, top_k, None)
    assert bug == "temperature_twice"
    return lambda logits, temperature, top_k, top_p: real(logits / temperature, temperature,
                                                          top_k, top_p)


@pytest.mark.parametrize("bug,params", [("ignores_top_p", PLAIN[2]),
                                        ("temperature_twice", PLAIN[1])])
def test_engine_sampling_law_rejects_broken_runner(target, monkeypatch, bug, params):
    monkeypatch.setattr(engine_sampler, "logits_to_probs", _plain_bug(bug))
    samples, _ = engine_samples(target, params, 3000, seed=30)
    p = pvalue(target, samples, params)
    print(f"{bug}: p = {p:.3g}")
    assert p < POWER


def _uniform_draft_probs(target_probs, draft_probs, draft_token_ids, generator=None):
    """The draft model's reported q no longer matches how it sampled (here: uniform)."""
    q = torch.full_like(draft_probs, 1 / draft_probs.shape[-1])
    return speculative.rejection_sample(target_probs, q, draft_token_ids, generator)


# Not a control: verifying a sampling draft with q = None (one-hot at the proposed token) is still
# exact, whatever the drafter did; it only accepts less often. A wrong q is what breaks the law.
@pytest.mark.parametrize("bug,method,n", [("residual_is_target", "ngram", 2000),
                                          ("residual_is_target", "draft", 1000),
                                          ("draft_probs_mismatch", "draft", 1000)])
def test_engine_speculative_law_rejects_broken_verify(target, draft, monkeypatch, bug, method, n):
    if bug == "residual_is_target":   # on rejection, draw from p instead of norm(max(p - q, 0))
        monkeypatch.setattr(speculative, "residual_probs", lambda p, q, ids: p)
    else:
        monkeypatch.setattr(engine_sampler, "rejection_sample", _uniform_draft_probs)
    params = SPEC[0]
    samples, _ = engine_samples(target, params, n, seed=40, method=method,
                                draft=draft if method == "draft" else None)
    p = pvalue(target, samples, params)
    print(f"{bug} ({method}): p = {p:.3g}")
    assert p < POWER
