"""Statistical exactness: speculative sampling on a tiny context-dependent model pair reproduces the
target's joint law of the next 3 tokens, and the same test rejects four classic bugs.

The reference law is computed by enumeration through the target model: all V^3 continuations,
p(y1 y2 y3) = p(y1 | prompt) p(y2 | prompt y1) p(y3 | prompt y1 y2), each processed by
`logits_to_probs` with the sampling parameters in use (that is what "sampling from the target"
means). The samples come from multi-step speculative generation (K = 2, so a row needs one or two
verify steps), batched over N rows with no cache so that N can be large.

Threshold: Pearson chi-square over the V^3 cells, cells with expected count < 5 pooled into one, and
the p-value from the chi-square survival function Q(dof/2, X2/2) (torch.special.gammaincc). A
correct sampler must give p > 1e-3: with a fixed seed the test is deterministic, and with a fresh
seed a correct sampler would fail it once in a thousand runs. Each broken sampler must give
p < 1e-6; their deviations are large enough that this holds with a wide margin (see the printed
p-values with -s).
"""
import itertools

import pytest
import torch

import minillm.spec.rejection as spec
from minillm import logits_to_probs, tiny_model
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import DraftModelProposer, NgramProposer, Proposal
from minillm.spec.loop import speculative_generate

F64 = torch.float64
V, LENGTH, K, N = 5, 3, 2, 6_000
PROMPT = [1, 2, 3, 1, 2]
SMALL = dict(n_layer=2, n_head=2, n_kv_head=1, head_dim=8, d_model=16, d_ff=32)  # cheap at N rows


pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


@pytest.fixture(scope="module")
def pair():
    return (tiny_model(vocab_size=V, seed=0, dtype=F64, **SMALL),
            tiny_model(vocab_size=V, seed=1, dtype=F64, **SMALL))


@torch.inference_mode()
def exact_target_law(target, prompt, params, vocab=V, length=LENGTH):
    """Enumerate every continuation through the target model: (V,) * length, float64."""
    prefixes = list(itertools.product(range(vocab), repeat=length - 1))
    x = torch.tensor([prompt + list(y) for y in prefixes])                  # (V^(L-1), S + L - 1)
    probs = logits_to_probs(target(x)[:, -length:], *params)               # (V^(L-1), L, V)
    law = torch.zeros((vocab,) * length, dtype=F64)
    for row, y in enumerate(prefixes):
        for last in range(vocab):
            seq = y + (last,)
            law[seq] = torch.stack([probs[row, i, seq[i]] for i in range(length)]).prod()
    return law


def chi_square_pvalue(samples: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of (N, L) samples to the (V,)*L law."""
    counts, vocab = torch.zeros(law.numel(), dtype=F64), law.shape[0]
    flat = (samples * (vocab ** torch.arange(samples.shape[1] - 1, -1, -1))).sum(1)
    counts.index_add_(0, flat, torch.ones(len(flat), dtype=F64))
    expected = law.flatten() * len(samples)
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if ((exp == 0) & (obs > 0)).any():
        return 0.0                                        # an impossible sequence was produced
    keep = exp > 0
    x2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = torch.tensor(keep.sum().item() - 1, dtype=F64)
    return float(torch.special.gammaincc(dof / 2, x2 / 2))


@torch.inference_mode()
def speculative_samples(target, proposer, params, seed, n=N, k=K):
    """n independent speculative generations of LENGTH tokens, batched over rows of equal length."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = [[] for _ in range(n)]
    while True:
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if len(r) < LENGTH:
                by_len.setdefault(len(r), []).append(i)
        if not by_len:
            return torch.tensor([r[:LENGTH] for r in rows])
        for idx in by_len.values():
            ctx = [PROMPT + rows[i] for i in idx]
            prop = proposer.propose(ctx, k, *params, gen)
            x = torch.cat([torch.tensor(ctx), prop.token_ids], dim=1)             # (B, S + K)
            p = logits_to_probs(target(x)[:, -(k + 1):], *params)              # (B, K + 1, V)
            out, _ = spec.rejection_sample(p, prop.probs, prop.token_ids, gen)
            for j, i in enumerate(idx):
                rows[i] += [t for t in out[j].tolist() if t >= 0]


class BrokenDrafter(Proposer):
    """Draft model whose reported q does not match how it picked its tokens (negative controls)."""

    def __init__(self, model, mode):
        self.model, self.mode = model, mode

    def propose(self, contexts, k, temperature, top_k, top_p, generator):
        ids, toks, qs = torch.tensor(contexts), [], []
        for _ in range(k):
            logits = self.model(ids)[:, -1]                                       # (B, V)
            processed = logits_to_probs(logits, temperature, top_k, top_p)
            soft = torch.softmax(logits / temperature, -1)                      # before top-k/p
            if self.mode == "greedy_soft_q":      # samples greedily, reports its soft q
                tok = logits.argmax(-1)
            else:                                 # "unprocessed_q": samples processed, reports raw
                tok = torch.multinomial(processed, 1, generator=generator)[:, 0]
            toks.append(tok)
            qs.append(soft)
            ids = torch.cat([ids, tok[:, None]], 1)
        return Proposal(torch.stack(toks, 1), torch.stack(qs, 1))


def _abs_residual(target_probs, draft_probs, draft_token_ids):
    """Residual without max(., 0): the sign of p - q is dropped (|p - q|) instead of clipped."""
    Kd = draft_token_ids.shape[1]
    q = draft_probs if draft_probs is not None else spec._one_hot(draft_token_ids, target_probs.shape[-1], F64)
    r = (target_probs[:, :Kd] - q).abs()
    r = r / r.sum(-1, keepdim=True).clamp(min=1e-300)
    return torch.cat([r, target_probs[:, Kd:]], dim=1)


PLAIN = (1.0, None, None)
PROCESSED = (0.8, 3, 0.9)          # temperature, top_k, top_p


@pytest.mark.parametrize("case,params,seed", [("draft", PLAIN, 0), ("draft", PROCESSED, 1),
                                              ("ngram", PLAIN, 2)])
def test_speculative_matches_target_law(pair, case, params, seed):
    target, draft = pair
    proposer = DraftModelProposer(draft, use_cache=False) if case == "draft" else NgramProposer()
    pvalue = chi_square_pvalue(speculative_samples(target, proposer, params, seed),
                               exact_target_law(target, PROMPT, params))
    print(f"{case} {params}: p = {pvalue:.4f}")
    assert pvalue > 1e-3


@pytest.mark.parametrize("bug", ["always_accept", "residual_without_max", "unprocessed_q",
                                 "greedy_soft_q"])
def test_chi_square_rejects_broken_samplers(pair, bug, monkeypatch):
    target, draft = pair
    params, proposer = PLAIN, DraftModelProposer(draft, use_cache=False)
    if bug == "always_accept":
        monkeypatch.setattr(spec, "acceptance_probs", lambda p, q, ids: torch.ones(ids.shape, dtype=F64))
    elif bug == "residual_without_max":
        monkeypatch.setattr(spec, "residual_probs", _abs_residual)
    elif bug == "unprocessed_q":
        params, proposer = (1.0, 2, None), BrokenDrafter(draft, bug)
    else:
        proposer = BrokenDrafter(draft, bug)
    pvalue = chi_square_pvalue(speculative_samples(target, proposer, params, seed=3),
                               exact_target_law(target, PROMPT, params))
    print(f"{bug}: p = {pvalue:.3g}")
    assert pvalue < 1e-6


def test_cached_loop_matches_target_law(pair):
    """The real batch-1 loop (KV caches, truncate) sampled 600 times, on a 3-token vocabulary."""
    target = tiny_model(vocab_size=3, seed=0, dtype=F64, **SMALL)
    draft = tiny_model(vocab_size=3, seed=1, dtype=F64, **SMALL)
    params, gen = (1.0, None, None), torch.Generator().manual_seed(4)
    proposer = DraftModelProposer(draft)
    samples = torch.tensor([speculative_generate(target, proposer, [1, 2, 0], LENGTH, K, *params,
                                                 generator=gen) for _ in range(600)])
    pvalue = chi_square_pvalue(samples, exact_target_law(target, [1, 2, 0], params, vocab=3))
    print(f"cached loop: p = {pvalue:.4f}")
    assert pvalue > 1e-3
