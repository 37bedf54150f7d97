"""Drafter training targets (objectives.py) on a tiny float32 model: token targets from a label
array or the target's distribution, the target's greedy labels over fixed text, and a draft
vocabulary sized by coverage. References: the loss written out by hand over `unroll`'s levels,
the target's own logits, and exact counting with `collections.Counter`."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm.drafting.distill import Sample
from minillm.drafting.objectives import (coverage_vocab, eagle_loss, greedy_labels,
                                         medusa_targets, unroll)
from minillm.spec.heads import EagleDrafter


@pytest.fixture(scope="module")
def model(one_thread):
    return minillm.tiny_model(seed=0, dtype=torch.float32)   # training runs in float32


@pytest.fixture(scope="module")
def sample(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (40,), generator=g)                        # fixed text
    with torch.inference_mode():
        _, h = model(ids[None], return_hidden=True)
    return Sample(ids, h[0].float(), 10)


def _by_hand(d, model, s, a, L, depth, w, targets=None, soft=False):
    """The loss the objective describes, written out: rows i in [a, a + L), level l predicts
    feature i + l (smooth L1) and token i + l + 1 (answer tokens only)."""
    ids, hid, S = s.ids, s.hidden, s.ids.numel()
    targets = ids if targets is None else targets
    L = min(L, S - 1 - a)
    toks = ids[[min(a + 1 + j, S - 1) for j in range(L + depth)]]         # past the end: masked
    outs = unroll(d, hid[a:a + L], toks, a, depth, model.embed)
    total = 0.0
    for lvl, out in enumerate(outs, start=1):
        rows = [i for i in range(a, a + L) if i + lvl < S]
        fl = F.smooth_l1_loss(out[[i - a for i in rows]], hid[[i + lvl for i in rows]])
        logits = model.lm_head(out)                                           # (L, V)
        if soft:
            keep = [i for i in rows if i + lvl + 1 >= s.start]
            p = model.lm_head(hid[[i + lvl for i in keep]]).softmax(-1)
            cl = -(p * logits[[i - a for i in keep]].log_softmax(-1)).sum(-1).mean()
        else:
            keep = [i for i in rows if s.start <= i + lvl + 1 < S]
            cl = F.cross_entropy(logits[[i - a for i in keep]], targets[[i + lvl + 1 for i in keep]])
        total = total + fl + w * cl
    return total


def test_eagle_loss_targets_from_ids_labels_or_the_targets_distribution(model, sample):
    d = EagleDrafter(model.config, seed=1, norm_inputs=True)
    g = torch.Generator().manual_seed(0)
    other = torch.randint(0, 256, sample.ids.shape, generator=g)
    with torch.inference_mode():
        for a, L, depth in ((8, 12, 2), (30, 16, 3)):                         # second runs off the end
            old = eagle_loss(d, model.lm_head, model.embed, sample, a, L, depth, 0.0, 0.3, g)
            same = eagle_loss(d, model.lm_head, model.embed, sample, a, L, depth, 0.0, 0.3, g,
                              labels=sample.ids.clone())
            assert torch.equal(old, same)
            torch.testing.assert_close(old, _by_hand(d, model, sample, a, L, depth, 0.3))
            got = eagle_loss(d, model.lm_head, model.embed, sample, a, L, depth, 0.0, 0.3, g,
                             labels=other)
            torch.testing.assert_close(got, _by_hand(d, model, sample, a, L, depth, 0.3, other))
            soft = eagle_loss(d, model.lm_head, model.embed, sample, a, L, depth, 0.0, 0.3, g,
                              soft=True)
            torch.testing.assert_close(soft, _by_hand(d, model, sample, a, L, depth, 0.3, soft=True))
    rows, tgt = medusa_targets(sample, 2, labels=other)
    assert tgt[0].tolist() == other[rows[0] + 2:rows[0] + 4].tolist()
    with pytest.raises(ValueError, match="labels"):
        eagle_loss(d, model.lm_head, model.embed, sample, 8, 4, 1, 0.0, 0.3, g, labels=other[:5])


def test_training_on_labels_learns_the_labels(model, sample):
    """Labels that are not the text's next tokens (a fixed relabelling of it): a few steps on
    them lower the loss toward them far more than toward the text itself."""
    relabel = (sample.ids * 37 + 11) % 256

    def ce(d, targets):
        with torch.no_grad():
            return float(_by_hand(d, model, sample, 9, 30, 1, 1.0, targets))
    d = EagleDrafter(model.config, seed=2, norm_inputs=True)
    before = ce(d, relabel), ce(d, sample.ids)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(25):
        loss = eagle_loss(d, model.lm_head, model.embed, sample, 9, 30, 1, 0.0, 1.0, g,
                          labels=relabel)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = ce(d, relabel), ce(d, sample.ids)
    assert after[0] < 0.5 * before[0]
    assert after[0] < after[1]


def test_greedy_labels_are_the_targets_argmax(model, sample):
    with torch.inference_mode():
        logits = model(sample.ids[None])[0]                                  # (S, V)
    got = greedy_labels(sample.hidden, model.lm_head, sample.ids, chunk=7)
    assert got[0] == sample.ids[0]
    assert torch.equal(got[1:], logits[:-1].argmax(-1))


def test_coverage_vocab_against_exact_counting():
    g = torch.Generator().manual_seed(3)
    tokens = (torch.rand(3000, generator=g) ** 4 * 120).long().tolist()     # skewed, 120 ids
    counts = torch.bincount(torch.tensor(tokens), minlength=200)
    exact = Counter(tokens)
    ranked = sorted(exact, key=lambda t: (-exact[t], t))                     # ties: lower id
    for coverage in (0.5, 0.9, 0.95, 0.999, 1.0):
        n = next(n for n in range(1, len(ranked) + 1)
                 if sum(exact[t] for t in ranked[:n]) >= coverage * len(tokens))
        assert coverage_vocab(counts, coverage).tolist() == sorted(ranked[:n])
    assert coverage_vocab(counts, 1.0).numel() == len(exact) < 200         # no unseen token
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="coverage"):
            coverage_vocab(counts, bad)
    with pytest.raises(ValueError, match="counts"):
        coverage_vocab(torch.zeros(5, dtype=torch.long), 0.9)
