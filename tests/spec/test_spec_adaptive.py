"""Adaptive K (seed 001's windowed rule) and the two acceptance names of SpecStats."""
import pytest
import torch

from minillm import generate, tiny_model
from minillm.spec.adaptive import WindowedK
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.spec.proposers import DraftModelProposer, NgramProposer


def test_windowed_k_follows_the_rule_by_hand():
    pol = WindowedK(k=4, window=2, raise_above=0.8, lower_below=0.5)
    pol.update(4, 4)
    assert pol.k == 4                       # window not full yet
    pol.update(4, 4)                        # 8/8 = 1.0 > 0.8: up
    assert pol.k == 5
    pol.update(0, 0)                        # nothing tested: ignored
    pol.update(3, 5)
    pol.update(3, 5)                        # 6/10 = 0.6: in the band, unchanged
    assert pol.k == 5
    pol.update(1, 5)                        # window (3,5),(1,5): 4/10 = 0.4 < 0.5: down
    assert pol.k == 4


def test_windowed_k_stays_in_range():
    pol = WindowedK(k=2, k_min=2, k_max=3, window=1)
    for _ in range(5):
        pol.update(0, 2)
    assert pol.k == 2
    for _ in range(5):
        pol.update(pol.k, pol.k)
    assert pol.k == 3


@pytest.mark.parametrize("kw", [dict(k=0), dict(k=5, k_max=4), dict(window=0),
                                dict(raise_above=0.4, lower_below=0.5), dict(k=2.0)])
def test_windowed_k_bad_input(kw):
    with pytest.raises((ValueError, TypeError)):
        WindowedK(**kw)
    with pytest.raises(ValueError, match="num_accepted"):
        WindowedK().update(3, 2)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_adaptive_loop_is_plain_greedy(proposer):
    target = tiny_model(vocab_size=64, seed=0, dtype=torch.float64)
    prop = DraftModelProposer(target) if proposer == "draft" else NgramProposer()
    prompt = [5, 6, 7, 8, 5, 6, 7]
    pol, st = WindowedK(k=2, window=2), SpecStats()
    out = speculative_generate(target, prop, prompt, 40, 2, stats=st, adaptive_k=pol)
    assert out == generate(target, prompt, 40)                  # the reference: plain greedy
    if proposer == "draft":                                     # the target drafts itself: all accepted
        assert max(st.num_proposed) > 2, "K should have grown on fully accepted steps"


def test_adaptive_k_bad_policy():
    target = tiny_model(vocab_size=64, seed=0, dtype=torch.float64)
    with pytest.raises(TypeError, match="adaptive_k"):
        speculative_generate(target, NgramProposer(), [1, 2, 3], 4, 2, adaptive_k=3)


def test_two_acceptance_names():
    # steps: 2 of 4 accepted (3 tested), 4 of 4 (4 tested), 0 of 3 (1 tested)
    st = SpecStats(num_proposed=[4, 4, 3], num_accepted=[2, 4, 0])
    assert st.accepted_fraction == pytest.approx(6 / 11)
    assert st.alpha_estimate == pytest.approx(6 / 8)
    # `acceptance_rate` means accepted / drafted wherever it exists (request metrics); the loop's
    # statistics, whose old alias meant alpha, do not carry the name at all
    assert not hasattr(st, "acceptance_rate")
    assert SpecStats().accepted_fraction != SpecStats().accepted_fraction   # nan without drafts
