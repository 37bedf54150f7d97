"""A token tree sized for this machine: expected tokens per step against the verify pass's cost.

Letters: N tree nodes (root included), d depth, r rank (a node's place among its siblings),
a(d, r) the measured P(node accepted | its parent was accepted).

    P(node accepted) = product of a(d_j, r_j) along its path
    tau = 1 + sum over draft nodes of P(node accepted)          (expected tokens per step)
    speedup = tau * cost(1) / (cost(N) + draft cost)

`size_tree` finds, for every node budget, the tree with the largest tau exactly (dynamic
programming over depth, rank and nodes left; tested against brute force over every prefix-closed
tree), then picks the budget whose tree maximizes the speedup under the measured costs. a(d, r)
comes from `SpecStats.acceptance_by_position()` after `speculative_generate`.

Left out on purpose: Sequoia's sampling-without-replacement acceptance model, hardware-aware
depth limits beyond max_depth, acceptance that depends on more than (depth, rank).
"""
from functools import lru_cache
from typing import NamedTuple

from minillm.analysis.roofline import Hardware, step_costs, step_time
from minillm.spec.tree import TokenTree


class TreeChoice(NamedTuple):
    tree: TokenTree
    tau: float           # expected tokens per step, bonus token included
    speedup: float       # predicted, over plain decoding


def acceptance_fn(acceptance):
    """(depth, rank) -> a(d, r), from {(d, r): a}, a per-rank list (every depth alike) or a
    per-depth list of per-rank lists (acc[d - 1][r]); what is not given is 0."""
    if isinstance(acceptance, dict):
        table = {(int(d), int(r)): float(a) for (d, r), a in acceptance.items()}
    elif isinstance(acceptance, (list, tuple)) and all(isinstance(a, (int, float)) for a in acceptance):
        table = None
        ranks = [float(a) for a in acceptance]
    elif isinstance(acceptance, (list, tuple)):
        table = {(d + 1, r): float(a) for d, row in enumerate(acceptance) for r, a in enumerate(row)}
    else:
        raise TypeError(f"acceptance must be a dict {{(depth, rank): p}} or a list, got "
                        f"{type(acceptance).__name__}")
    values = table.values() if table is not None else ranks
    if not all(0 <= a <= 1 for a in values):
        raise ValueError(f"acceptance values must be probabilities in [0, 1], got {acceptance!r}")
    if table is None:
        return lambda d, r: ranks[r] if r < len(ranks) else 0.0
    return lambda d, r: table.get((d, r), 0.0)


def cost_fn(costs):
    """n -> the verify time of n tokens, from {n: time} (keys int or str, e.g. forward_cost's
    "auto" row) or a list (costs[n - 1]); linear between measured sizes. Returns (fn, largest n)."""
    if isinstance(costs, dict):
        pts = sorted((int(n), float(t)) for n, t in costs.items())
    elif isinstance(costs, (list, tuple)):
        pts = [(i + 1, float(t)) for i, t in enumerate(costs)]
    else:
        raise TypeError(f"costs must be a dict {{num_tokens: time}} or a list, got {type(costs).__name__}")
    if not pts or pts[0][0] != 1 or any(t <= 0 for _, t in pts):
        raise ValueError(f"costs must include n = 1 and be positive times, got {costs!r}")

    def cost(n: int) -> float:
        if not 1 <= n <= pts[-1][0]:
            raise ValueError(f"no verify cost for {n} tokens: costs were measured up to {pts[-1][0]}")
        for (n0, t0), (n1, t1) in zip(pts, pts[1:] + [pts[-1]]):
            if n0 <= n <= n1:
                return t0 if n1 == n0 else t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return pts[-1][1]
    return cost, pts[-1][0]


def roofline_costs(cfg, hardware: Hardware, max_tokens: int = 64, dtype="bf16",
                   context: int = 128) -> dict:
    """{n: seconds} for n = 1..max_tokens: the roofline's lower bound of a verify pass over n
    tokens (logits at every one) after `context` cached, for a machine not at hand (a GPU's
    datasheet); on the reader's machine, measure instead (`minillm.lab.forward_cost`)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    return {n: step_time(step_costs(cfg, 1, n, context, dtype, logits_tokens=n), hardware, dtype)
            for n in range(1, max_tokens + 1)}


def expected_tau(tree: TokenTree, acceptance) -> float:
    """1 + sum over the draft nodes of the product of a(d, r) along the node's path."""
    a = acceptance_fn(acceptance)
    reach = [1.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        reach[i] = reach[tree.parents[i]] * a(tree.depths[i], tree.ranks[i])
    return sum(reach)


def predicted_speedup(tree: TokenTree, acceptance, costs, draft_cost=0.0) -> float:
    """tau * cost(1) / (cost(N) + draft_cost): draft_cost a time in the costs' unit, or a
    function of the tree."""
    cost, _ = cost_fn(costs)
    extra = draft_cost(tree) if callable(draft_cost) else float(draft_cost)
    return expected_tau(tree, acceptance) * cost(1) / (cost(tree.num_nodes) + extra)


def best_trees(acceptance, max_depth: int, max_rank: int, max_draft_nodes: int) -> list:
    """For m = 1..max_draft_nodes: (largest tau, its paths) over prefix-closed trees of at most m
    draft nodes, depth <= max_depth, ranks < max_rank (dynamic programming, exact)."""
    a = acceptance_fn(acceptance)

    @lru_cache(maxsize=None)
    def forest(d: int, r: int, m: int):
        """Best (sum, paths relative to the parent) with children of ranks >= r at depth d."""
        if d > max_depth or r >= max_rank or m == 0:
            return 0.0, ()
        best = forest(d, r + 1, m)                                # no child of rank r
        for k in range(m):                                        # rank r's subtree: 1 + k nodes
            sub_val, sub_paths = forest(d + 1, 0, k)
            rest_val, rest_paths = forest(d, r + 1, m - 1 - k)
            val = a(d, r) * (1.0 + sub_val) + rest_val
            if val > best[0] + 1e-12:
                best = (val, ((r,),) + tuple((r,) + p for p in sub_paths) + rest_paths)
        return best

    return [(1.0 + forest(1, 0, m)[0], list(forest(1, 0, m)[1])) for m in range(1, max_draft_nodes + 1)]


def size_tree(acceptance, costs, max_depth: int = 8, max_rank: int = 8,
              max_nodes: int | None = None, draft_cost=0.0) -> TreeChoice:
    """The tree (at most max_nodes nodes, root included; default: the largest measured cost)
    with the largest predicted speedup, with its tau and speedup."""
    for name, v in (("max_depth", max_depth), ("max_rank", max_rank)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    _, largest = cost_fn(costs)
    max_nodes = largest if max_nodes is None else max_nodes
    if not isinstance(max_nodes, int) or not 2 <= max_nodes <= largest:
        raise ValueError(f"max_nodes must be an int in [2, {largest}] (the measured costs), got {max_nodes!r}")
    best = None
    for _, paths in best_trees(acceptance, max_depth, max_rank, max_nodes - 1):
        if not paths:
            continue
        tree = TokenTree(paths)
        choice = TreeChoice(tree, expected_tau(tree, acceptance),
                            predicted_speedup(tree, acceptance, costs, draft_cost))
        if best is None or choice.speedup > best.speedup + 1e-12:
            best = choice
    if best is None:                           # nothing is ever accepted: the smallest tree
        tree = TokenTree([(0,)])
        best = TreeChoice(tree, 1.0, predicted_speedup(tree, acceptance, costs, draft_cost))
    return best
