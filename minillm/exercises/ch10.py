"""Chapter 10 exercises (drafting without a copy: token trees, and whether drafting pays). The
first three are code exercises: the reader's function runs through a check that a planted-broken
version fails, against minillm's own tree code (the exact enumeration of the tree rule's law,
`TokenTree.ancestor_mask`, `spec.tree_sizing.expected_tau`) on trees the check draws at random.
The fourth is numeric: section 5's speedup formula, tau / (draft + verify), applied by hand to
two drafts on a CPU, and the better one chosen.

    >>> from minillm import exercises
    >>> exercises.check("10.2", lambda parents: None)      # doctest: +SKIP
    10.2 not yet: ...
"""
import random
from unittest import mock

import torch

from minillm.exercises import call_reader as _call, code, numeric
from minillm.spec import tree_rejection
from minillm.spec.tree import TokenTree, TreeDraft
from minillm.spec.tree_law import exact_tree_law
from minillm.spec.tree_sizing import expected_tau

F64 = torch.float64


def _random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _random_tree(rng: random.Random, max_depth: int = 3, max_rank: int = 3) -> TokenTree:
    paths = {()}
    for _ in range(rng.randrange(2, 9)):
        parent = rng.choice(sorted(paths, key=len))
        if len(parent) < max_depth:
            rank = next((r for r in range(max_rank) if parent + (r,) not in paths), None)
            if rank is not None:
                paths.add(parent + (rank,))
    return TokenTree(sorted(p for p in paths if p))


def _law_setup(V: int, seed: int):
    g, table = torch.Generator().manual_seed(seed), {}

    def p_of(prefix):
        if prefix not in table:
            w = torch.rand(V, generator=g, dtype=F64) * (torch.rand(V, generator=g) > 0.25)
            w[len(prefix) % V] += 0.05
            table[prefix] = w / w.sum()
        return table[prefix]
    shape = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], max_rank=V)

    def tree_of(prefix):
        o = torch.randperm(V, generator=torch.Generator().manual_seed(seed * 131 + len(prefix)))
        return TreeDraft.from_tree(shape, [0, int(o[0]), int(o[1]), int(o[2]), int(o[1]), int(o[0]),
                                           int(o[3])])
    return p_of, tree_of


def _test_sibling_rule(fn) -> None:
    V, L = 4, 3
    for seed in (1, 2, 3):
        p_of, tree_of = _law_setup(V, seed)
        want = exact_tree_law(p_of, tree_of, V, L)                     # the package's rule

        def rule(p, kids):
            acc, resid = _call(fn, p.clone(), list(kids))
            return torch.as_tensor(acc, dtype=F64), torch.as_tensor(resid, dtype=F64)
        with mock.patch.object(tree_rejection, "sibling_rule", rule):
            got = exact_tree_law(p_of, tree_of, V, L)
        dev = float((got - want).abs().max())
        assert dev < 1e-9, (f"with your rule the law of 3 decoded tokens differs from the target's by "
                            f"up to {dev:.4f} (tables seeded {seed})")


def _test_mask(fn) -> None:
    rng = random.Random(10)
    for n in (1, 2, 5, 9, 14):
        parents = _random_parents(rng, n)
        got = torch.as_tensor(_call(fn, list(parents)))
        want = TreeDraft(torch.arange(n), parents).ancestor_mask()
        assert got.shape == want.shape, f"shape {tuple(got.shape)} for {n} nodes, expected ({n}, {n})"
        assert bool((got.bool() == want).all()), f"wrong entries for parents {parents}"


def _test_tau(fn) -> None:
    rng = random.Random(11)
    for _ in range(6):
        tree = _random_tree(rng)
        table = {(d, r): rng.random() for d in range(1, 4) for r in range(3)}
        a = lambda d, r, table=table: table[(d, r)]
        got = float(_call(fn, list(tree.parents), list(tree.depths), list(tree.ranks), a))
        want = expected_tau(tree, table)
        assert abs(got - want) < 1e-9, f"tree {tree.paths}: your tau is off"


code("10.1", "Write sibling_rule(p, child_tokens) -> (accept (C,), residual (V,)): P(child j is "
     "accepted) trying the children in order, and the law sampled when every child is rejected. "
     "The check enumerates the law of 3 tokens of tree decoding with it.", _test_sibling_rule,
     hint="after a rejection the next child is judged under the renormalized rest of p")
code("10.2", "Write tree_mask(parents) -> (N, N) bool: row i is True at i and at every ancestor of "
     "i (parents[0] = -1 is the root).", _test_mask)
code("10.3", "Write tau(parents, depths, ranks, a) -> the expected tokens of one step, with "
     "a(depth, rank) the probability a node is accepted given its parent was.", _test_tau,
     hint="recompute each node's chance along its whole path, as section 6 does, and count the "
          "token every step emits of its own")


def _better_of_two(draft: float = 0.05) -> float:
    verify = {2: 1.15, 8: 1.9}            # tokens verified (root + drafts) -> cost in plain steps
    tau = {2: 1.12, 8: 1.22}              # tokens a step emits with the chain of 1, the tree of 7
    return max(tau[n] / (draft + verify[n]) for n in verify)


numeric("10.4", "On a CPU, a verify pass over 2 tokens costs 1.15 plain decode steps and one over 8 "
        "tokens 1.9; Medusa's heads cost 0.05 step to draft either way. A chain of one guess "
        "emits 1.12 tokens a step, a tree of 7 draft nodes 1.22. Which is faster? Give its "
        "speedup over plain decoding.", _better_of_two, rtol=0.005,
        hint="section 5's formula for each: tokens a step over the step's cost in plain steps "
             "(drafting plus the verify pass); then keep the larger")
