"""Tree acceptance: exact by enumeration and by a G-test with shown power; typical acceptance lossy.

The reference is the target's own law, p(y_1) p(y_2 | y_1) ..., enumerated from a
context-dependent random table (`target_law`), never the code under test. `exact_tree_law`
enumerates the tree rule's law through the package's `sibling_rule`; three broken rules swapped
in for it (no renormalization after a rejection, a uniform q over the siblings as if the drafts
were sampled, the fallback drawn from p instead of the residual) must move the law, and samples
of `tree_accept` must pass a G-test (likelihood ratio, cells with expected count < 5 pooled,
p from the chi-square survival function) at p > 1e-3 while the broken rules fail it at p < 1e-6.
Fixed seeds: the test is deterministic.
"""
import itertools
import math

import pytest
import torch

from minillm.model.sampling import logits_to_probs
from minillm.spec import tree_rejection
from minillm.spec.tree import TokenTree, TreeDraft
from minillm.spec.tree_law import exact_tree_law
from minillm.spec.tree_rejection import tree_accept, typical_accept

F64 = torch.float64
SHAPE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


def random_logits(V, seed, zero_frac):
    """prefix tuple -> (V,) float64 logits, some -inf (tokens the target never emits there)."""
    gen, table = torch.Generator().manual_seed(seed), {}

    def logits(prefix):
        if prefix not in table:
            x = 2 * torch.randn(V, generator=gen, dtype=F64)
            x[torch.rand(V, generator=gen) < zero_frac] = float("-inf")
            if torch.isinf(x).all():
                x[torch.randint(V, (1,), generator=gen)] = 0.0
            table[prefix] = x
        return table[prefix]
    return logits


def target_law(p, length, V):
    """The trusted reference: sample from p one token at a time, law of the first `length`."""
    law = torch.zeros((V,) * length, dtype=F64)
    for y in itertools.product(range(V), repeat=length):
        law[y] = math.prod(float(p(y[:i])[y[i]]) for i in range(length))
    return law


def top_rank_drafter(V, seed, tree=SHAPE):
    """prefix -> a TreeDraft of `tree`'s shape whose rank-r children are the r-th most likely
    tokens of another random table (a stand-in for Medusa heads)."""
    guess = random_logits(V, seed, 0.0)

    def tree_fn(prefix):
        toks = [0]
        for i in range(1, tree.num_nodes):
            path = tuple(toks[j] for j in _path(tree, tree.parents[i])[1:])
            order = guess(prefix + path).argsort(descending=True).tolist()
            toks.append(order[tree.ranks[i]])
        return TreeDraft.from_tree(tree, toks)
    return tree_fn


def _path(tree, i):
    path = [i]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def node_logits(logits_fn, prefix, draft):
    """(N, V): row i = the target's logits after prefix + the path to node i (what tree_forward
    computes in one pass)."""
    toks = draft.tokens.tolist()
    return torch.stack([logits_fn(prefix + tuple(toks[j] for j in draft.path_to(i)[1:]))
                        for i in range(draft.num_nodes)])


def samples(logits_fn, tree_fn, length, n, params, seed, accept=tree_accept):
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        seq = ()
        while len(seq) < length:
            draft = tree_fn(seq)
            path, nxt = accept(node_logits(logits_fn, seq, draft), draft, *params, generator=gen)
            seq += tuple(draft.tokens[path[1:]].tolist()) + (nxt,)
        out.append(seq[:length])
    return torch.tensor(out)


def g_test_pvalue(samples: torch.Tensor, law: torch.Tensor) -> float:
    """G-test (likelihood ratio) of (n, L) samples against the (V,)*L law."""
    V = law.shape[0]
    flat = (samples * (V ** torch.arange(samples.shape[1] - 1, -1, -1))).sum(1)
    counts = torch.zeros(law.numel(), dtype=F64).index_add_(0, flat, torch.ones(len(flat), dtype=F64))
    expected = law.flatten() * len(samples)
    if ((expected == 0) & (counts > 0)).any():
        return 0.0                                         # an impossible sequence came out
    small = expected < 5
    obs = torch.cat([counts[~small & (expected > 0)], counts[small].sum()[None]])
    exp = torch.cat([expected[~small & (expected > 0)], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    g = 2 * (obs * torch.log(torch.where(obs > 0, obs / exp, torch.ones_like(obs)))).sum()
    dof = torch.tensor(len(obs) - 1, dtype=F64)
    return float(torch.special.gammaincc(dof / 2, g / 2))


# ---- broken sibling rules (negative controls) ------------------------------------------------

def no_renormalize(p, kids):
    accept, r, reach = torch.zeros(len(kids), dtype=p.dtype), p.clone(), 1.0
    for j, x in enumerate(kids):
        a = float(r[x])
        accept[j], reach = reach * a, reach * (1 - a)
        r[x] = 0.0                                         # the bug: r is no longer a law
    return accept, r / r.sum()


def uniform_q(p, kids):
    """Chapter 6's p/q rule with q uniform over the siblings, as if they had been sampled."""
    accept, r, reach = torch.zeros(len(kids), dtype=p.dtype), p.clone(), 1.0
    q = torch.zeros_like(p)
    q[kids] = 1.0 / max(1, len(kids))
    for j, x in enumerate(kids):
        a = min(1.0, float(r[x]) / float(q[x]))
        accept[j], reach = reach * a, reach * (1 - a)
        res = (r - q).clamp(min=0)
        r = res / res.sum() if res.sum() > 0 else r
    return accept, r


def fallback_from_p(p, kids):
    accept, _ = REAL_RULE(p, kids)
    return accept, p


REAL_RULE = tree_rejection.sibling_rule
BROKEN = {"no_renormalize": no_renormalize, "uniform_q": uniform_q, "fallback_from_p": fallback_from_p}


# ---- exact enumeration ----------------------------------------------------------------------

@pytest.mark.parametrize("V,zero_frac", [(3, 0.0), (4, 0.3), (5, 0.0)])
@pytest.mark.parametrize("params", [(1.0, None, None), (0.8, 2, 0.9)])
def test_tree_law_equals_target_law(V, zero_frac, params):
    logits = random_logits(V, 7 * V, zero_frac)
    p = lambda prefix: logits_to_probs(logits(prefix), *params)
    length = 3
    law = exact_tree_law(p, top_rank_drafter(V, 100 + V, TokenTree(
        [(0,), (1,), (0, 0), (0, 1), (1, 0)], max_rank=V)), V, length)
    assert (law - target_law(p, length, V)).abs().max() < 1e-6


def test_tree_law_with_random_siblings_and_a_chain():
    V = 4
    logits = random_logits(V, 3, 0.2)
    p = lambda prefix: logits_to_probs(logits(prefix), 1.0)
    gen = torch.Generator().manual_seed(0)
    drafts = {}

    def random_tree(prefix):       # a drafter of its own shape: random distinct siblings
        if prefix not in drafts:
            toks = [0] + torch.randperm(V, generator=gen)[:3].tolist() + \
                   torch.randperm(V, generator=gen)[:2].tolist()
            drafts[prefix] = TreeDraft(torch.tensor(toks), [-1, 0, 0, 0, 1, 1])
        return drafts[prefix]
    assert (exact_tree_law(p, random_tree, V, 3) - target_law(p, 3, V)).abs().max() < 1e-6
    chain = top_rank_drafter(V, 9, TokenTree.chain(3))
    assert (exact_tree_law(p, chain, V, 4) - target_law(p, 4, V)).abs().max() < 1e-6


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_enumeration_sees_broken_rules(bug, monkeypatch):
    V = 4
    logits = random_logits(V, 28, 0.0)
    p = lambda prefix: logits_to_probs(logits(prefix), 1.0)
    monkeypatch.setattr(tree_rejection, "sibling_rule", BROKEN[bug])
    law = exact_tree_law(p, top_rank_drafter(V, 104), V, 3)
    assert (law - target_law(p, 3, V)).abs().max() > 1e-3


def test_typical_acceptance_is_lossy():
    """Medusa's typical acceptance moves the law; the total-variation distance is printed."""
    V = 4
    logits = random_logits(V, 28, 0.0)
    p = lambda prefix: logits_to_probs(logits(prefix), 1.0)
    ref = target_law(p, 3, V)
    tv = {}
    for thr, alpha in [(0.09, 0.3), (0.3, 0.55)]:
        law = exact_tree_law(p, top_rank_drafter(V, 104), V, 3, rule="typical",
                             posterior_threshold=thr, posterior_alpha=alpha)
        assert abs(float(law.sum()) - 1) < 1e-9
        tv[thr] = 0.5 * float((law - ref).abs().sum())
    print(f"typical acceptance TV distance to the target law: {tv}")
    assert min(tv.values()) > 0.02


def test_typical_accept_samples_follow_its_enumerated_law():
    V = 3
    logits = random_logits(V, 5, 0.0)
    p = lambda prefix: logits_to_probs(logits(prefix), 1.0)
    drafter = top_rank_drafter(V, 8, TokenTree([(0,), (1,), (0, 0)]))
    law = exact_tree_law(p, drafter, V, 3, rule="typical")
    typ = lambda lg, d, t, k, tp, generator: typical_accept(lg, d, t, generator=generator)
    s = samples(logits, drafter, 3, 1500, (1.0, None, None), seed=1, accept=typ)
    assert g_test_pvalue(s, law) > 1e-3


# ---- sampling: G-test with power ------------------------------------------------------------

STAT_V, STAT_N = 4, 3000


@pytest.mark.parametrize("params,seed", [((1.0, None, None), 0), ((0.8, 3, 0.9), 1)])
def test_tree_accept_samples_pass_the_g_test(params, seed):
    logits = random_logits(STAT_V, 28, 0.0)
    p = lambda prefix: logits_to_probs(logits(prefix), *params)
    s = samples(logits, top_rank_drafter(STAT_V, 104), 3, STAT_N, params, seed)
    pv = g_test_pvalue(s, target_law(p, 3, STAT_V))
    print(f"tree_accept {params}: p = {pv:.4f}")
    assert pv > 1e-3


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_g_test_rejects_broken_rules(bug, monkeypatch):
    logits = random_logits(STAT_V, 28, 0.0)
    p = lambda prefix: logits_to_probs(logits(prefix), 1.0)
    monkeypatch.setattr(tree_rejection, "sibling_rule", BROKEN[bug])
    s = samples(logits, top_rank_drafter(STAT_V, 104), 3, STAT_N, (1.0, None, None), seed=2)
    pv = g_test_pvalue(s, target_law(p, 3, STAT_V))
    print(f"{bug}: p = {pv:.3g}")
    assert pv < 1e-6


# ---- greedy and bad input -------------------------------------------------------------------

def test_greedy_follows_the_argmax_child():
    V = 6
    logits = random_logits(V, 11, 0.0)
    drafter = top_rank_drafter(V, 12)
    seq, plain = (), ()
    while len(plain) < 30:
        plain += (int(logits(plain).argmax()),)
    steps = 0
    while len(seq) < 30:
        draft = drafter(seq)
        path, nxt = tree_accept(node_logits(logits, seq, draft), draft, 0.0)
        assert len(path) == 1 or draft.parents[path[-1]] == path[-2]
        seq += tuple(draft.tokens[path[1:]].tolist()) + (nxt,)
        steps += 1
    assert seq[:30] == plain
    assert steps < 30                      # some steps accepted more than one token


def test_bad_input():
    d = TreeDraft(torch.tensor([1, 2, 3]), [-1, 0, 0])
    with pytest.raises(ValueError, match="logits"):
        tree_accept(torch.zeros(2, 5), d)
    with pytest.raises(TypeError, match="draft"):
        tree_accept(torch.zeros(3, 5), [1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        tree_accept(torch.zeros(3, 5), d, temperature=-1.0)
    with pytest.raises(ValueError, match="posterior_threshold"):
        typical_accept(torch.zeros(3, 5), d, posterior_threshold=0.0)
    with pytest.raises(ValueError, match="rule"):
        exact_tree_law(lambda p: torch.ones(2) / 2, lambda p: d, 2, 2, rule="lossy")
