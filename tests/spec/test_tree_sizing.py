"""Tree sizing: tau and speedup formulas, the dynamic program against brute force, theory vs a run.

References: chapter 6's chain formula (`spec_theory.expected_tokens_per_step`) for a chain;
brute-force enumeration of every prefix-closed tree of a few nodes for the sizing; the tokens per
step a real run of the tree loop measures for the predicted tau.
"""
import copy
import random

import pytest
import torch

from minillm import get_config, tiny_model
from minillm.analysis.roofline import get_hardware
from minillm.analysis.spec_theory import expected_tokens_per_step
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.spec.tree import TokenTree
from minillm.spec.tree_sizing import (best_trees, cost_fn, expected_tau, predicted_speedup,
                                      roofline_costs, size_tree)
from test_tree import TopKTreeProposer

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


@pytest.mark.parametrize("a,k", [(0.0, 3), (0.6, 4), (1.0, 2)])
def test_chain_tau_is_chapter_6s_formula(a, k):
    assert expected_tau(TokenTree.chain(k), [a]) == pytest.approx(expected_tokens_per_step(a, k))


def test_tau_by_hand():
    tree = TokenTree([(0,), (1,), (0, 0)])
    acc = {(1, 0): 0.5, (1, 1): 0.2, (2, 0): 0.4}
    assert expected_tau(tree, acc) == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4)
    assert expected_tau(tree, [[0.5, 0.2], [0.4]]) == pytest.approx(1.9)
    costs = {1: 10.0, 2: 11.0, 4: 14.0}
    assert predicted_speedup(tree, acc, costs) == pytest.approx(1.9 * 10 / 14.0)
    assert predicted_speedup(tree, acc, costs, draft_cost=6.0) == pytest.approx(1.9 * 10 / 20)
    assert cost_fn(costs)[0](3) == pytest.approx(12.5)          # linear between measured sizes


def all_trees(max_depth, max_rank, max_nodes):
    """Every prefix-closed set of at most max_nodes paths (brute force, by growing frontiers)."""
    seen, frontier = {frozenset()}, [frozenset()]
    while frontier:
        nxt = []
        for t in frontier:
            if len(t) == max_nodes:
                continue
            cands = [(r,) for r in range(max_rank)] + [p + (r,) for p in t if len(p) < max_depth
                                                       for r in range(max_rank)]
            for c in cands:
                if c not in t:
                    u = t | {c}
                    if u not in seen:
                        seen.add(u)
                        nxt.append(u)
        frontier = nxt
    return [sorted(t) for t in seen if t]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sizing_equals_brute_force(seed):
    rng = random.Random(seed)
    D, R, M = 3, 3, 5
    acc = {(d, r): rng.random() for d in range(1, D + 1) for r in range(R)}   # not monotone
    trees = all_trees(D, R, M)
    assert len(trees) > 500
    dp = best_trees(acc, D, R, M)
    for m in range(1, M + 1):
        brute = max(expected_tau(TokenTree(t), acc) for t in trees if len(t) <= m)
        assert dp[m - 1][0] == pytest.approx(brute, abs=1e-12)
        assert expected_tau(TokenTree(dp[m - 1][1]), acc) == pytest.approx(brute, abs=1e-12)
    costs = [1.0 + 0.3 * n ** rng.uniform(0.5, 1.5) for n in range(M + 1)]
    for draft_cost in (0.0, 0.7):
        choice = size_tree(acc, costs, D, R, M + 1, draft_cost)
        brute = max(predicted_speedup(TokenTree(t), acc, costs, draft_cost) for t in trees)
        assert choice.speedup == pytest.approx(brute, abs=1e-12)
        assert choice.tau == pytest.approx(expected_tau(choice.tree, acc))


def test_the_machine_decides_the_tree():
    """Same acceptance, two machines: a verify that costs nearly nothing per token (a GPU) buys
    a big tree; one whose cost grows fast (a 2-core CPU) a small one."""
    acc = [0.7, 0.2, 0.1, 0.05]
    gpu = {n: 1.0 + 0.002 * n for n in range(1, 65)}
    cpu = {n: 1.0 + 0.12 * (n - 1) for n in range(1, 65)}
    big, small = size_tree(acc, gpu), size_tree(acc, cpu)
    assert big.tree.num_nodes > 2 * small.tree.num_nodes
    assert big.tau > small.tau and big.speedup > small.speedup


def test_roofline_trees_side_by_side():
    """The H200's roofline verifies 64 tokens of SmolLM2 at about the price of one: the tree
    grows to the node limit; a 2-core CPU's measured-like costs (9 tokens about 2x) stop early."""
    cfg = get_config("smollm2-135m")
    gpu = roofline_costs(cfg, get_hardware("h200"), 64)
    assert gpu[64] / gpu[1] < 1.2
    acc = [0.6, 0.15, 0.08, 0.04, 0.02]
    cpu = {n: 1.0 + (n - 1) / 8 for n in range(1, 65)}
    big, small = size_tree(acc, gpu), size_tree(acc, cpu)
    print(f"H200 roofline: {big.tree.num_nodes} nodes, tau {big.tau:.2f}, x{big.speedup:.2f}; "
          f"2-core CPU: {small.tree.num_nodes} nodes, tau {small.tau:.2f}, x{small.speedup:.2f}")
    assert big.tree.num_nodes > 40 and small.tree.num_nodes < 12


def test_theory_against_a_run():
    """tau predicted from the run's own per-(depth, rank) acceptance vs the tokens per step it
    measured: equal for a chain up to the budget's cuts, within 15% for a tree."""
    target = tiny_model(vocab_size=32, seed=0, dtype=torch.float64)
    draft, gen = copy.deepcopy(target), torch.Generator().manual_seed(1)
    with torch.no_grad():                     # a drafter that agrees about half the time
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    for tree, tol in [(TokenTree.chain(3), 0.05), (TokenTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]), 0.15)]:
        st = SpecStats()
        for prompt in ([1, 2, 3], [4, 5, 6, 7], [9, 9, 8]):
            speculative_generate(target, TopKTreeProposer(draft), prompt, 60, tree=tree, stats=st)
        pred = expected_tau(tree, st.acceptance_by_position())
        print(f"{tree}: predicted tau {pred:.3f}, measured {st.tokens_per_step:.3f}")
        assert st.tokens_per_step > 1.8
        assert abs(pred / st.tokens_per_step - 1) < tol


def test_bad_input():
    with pytest.raises(ValueError, match="probabilities"):
        expected_tau(TokenTree.chain(2), [1.5])
    with pytest.raises(TypeError, match="acceptance"):
        expected_tau(TokenTree.chain(2), 0.5)
    with pytest.raises(ValueError, match="n = 1"):
        cost_fn({2: 1.0})
    with pytest.raises(ValueError, match="measured up to"):
        predicted_speedup(TokenTree.chain(4), [0.5], [1.0, 1.1])
    with pytest.raises(ValueError, match="max_nodes"):
        size_tree([0.5], [1.0, 1.1], max_nodes=5)
    with pytest.raises(ValueError, match="max_depth"):
        size_tree([0.5], [1.0, 1.1], max_depth=0)
