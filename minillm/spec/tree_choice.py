"""Tree or chain: the engine verifies a token tree only where tree sizing says it pays here.

Letters: K = num_speculative_tokens, N tree nodes (root included), a(d, r) the measured
P(node accepted | its parent was) at depth d and rank r, cost(n) a verify pass of n tokens.

`TreeSwitch` decides once. Its first `probe_steps` tree verifies use the configured tree (for
"auto", `probe_tree`: the chain plus a rank-1 sibling at every depth) and count per (depth, rank)
how often a node was tested and kept (`record`); then `decide_tree`, a pure function of counts
and costs, keeps the tree only if tree_sizing predicts it faster (tau * cost(1) / cost(N)) than
the chain of K, and `line` states both numbers. Costs are `verify_costs(model, ...)`, timed here
when the decision is due, unless given (`TreeSwitch(costs=...)`).

Left out on purpose: deciding again later, the drafter's own cost, batches (cost(n) is timed at
batch 1; `SpecDecoder.select`'s switch answers load).
"""
import time

import torch

from minillm.model.kv_cache import KVCache
from minillm.spec.tree import TokenTree
from minillm.spec.tree_sizing import expected_tau, predicted_speedup, size_tree

PROBE_STEPS = 32


def probe_tree(k: int, max_rank: int | None = None) -> TokenTree:
    """The chain of K plus one rank-1 sibling per depth: 2K draft nodes that measure a(d, 0) and
    a(d, 1) for every depth (rank 0 alone when the drafter gives one candidate per node)."""
    paths = [(0,) * d for d in range(1, k + 1)]
    if max_rank is None or max_rank > 1:
        paths += [(0,) * (d - 1) + (1,) for d in range(1, k + 1)]
    return TokenTree(paths)


def decide_tree(tree, k: int, acceptance: dict, costs, max_rank: int | None = None):
    """(the tree to verify or None for the chain, one line saying why). `tree`: a `TokenTree`, or
    "auto" for `size_tree`'s best over depth <= K and the ranks measured in `acceptance`."""
    chain = TokenTree.chain(k)
    if tree == "auto":
        ranks = 1 + max((r for _, r in acceptance), default=0)
        ranks = ranks if max_rank is None else min(ranks, max_rank)
        tree = size_tree(acceptance, costs, max_depth=k, max_rank=ranks).tree
    s_tree = predicted_speedup(tree, acceptance, costs)
    s_chain = predicted_speedup(chain, acceptance, costs)
    use = tree != chain and s_tree > s_chain
    line = (f"token tree: {'tree' if use else 'chain'} ({tree.num_nodes} nodes predict "
            f"{s_tree:.2f}x, tau {expected_tau(tree, acceptance):.2f}; the chain of {k} "
            f"{s_chain:.2f}x, tau {expected_tau(chain, acceptance):.2f}; on these verify costs)")
    return (tree if use else None), line


@torch.inference_mode()
def verify_costs(model, max_tokens: int, context: int = 64, rounds: int = 3) -> dict:
    """{n: seconds} of one batch-1 forward of n tokens (logits at every one) after `context`
    cached tokens, n = 1, 2, 4, ... and max_tokens: the fastest of `rounds` interleaved rounds
    (tree_sizing interpolates between the sizes)."""
    sizes = sorted({1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens}
                   | {max_tokens})
    cfg, dev = model.config, model.device
    context = min(context, cfg.max_seq_len - max_tokens)
    cache = KVCache(cfg, 1, context + max_tokens, dev, model.dtype)
    ids = torch.zeros(1, context + max_tokens, dtype=torch.long, device=dev)
    model(ids[:, :context], torch.arange(context, device=dev), cache)          # the context
    best = {n: float("inf") for n in sizes}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(rounds + 1):                                                # + one warm-up
        for n in sizes:
            sync()
            t0 = time.perf_counter()
            model(ids[:, context:context + n], torch.arange(context, context + n, device=dev), cache)
            sync()
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


class TreeSwitch:
    """The probe-then-decide switch of one engine (module docstring). `tree`: the configured
    `TokenTree` or "auto"; `current`: the tree to draft now (None: the chain); `line`: the
    decision, once made."""

    def __init__(self, tree, k: int, model=None, costs=None, max_rank: int | None = None,
                 max_tokens: int = 64, probe_steps: int = PROBE_STEPS):
        self.tree, self.k, self.model, self.costs = tree, k, model, costs
        self.max_rank, self.probe_steps = max_rank, probe_steps
        self.current = probe_tree(k, max_rank) if tree == "auto" else tree
        # the largest pass to time: the configured tree (and the chain), or for "auto" the trees
        # sizing may choose from (the step's token budget, at most 32)
        self.max_nodes = (max(tree.num_nodes, k + 1) if tree != "auto" else
                          max(2 * k + 1, min(max_tokens, 32)))
        self.steps, self.decided, self.line = 0, False, None
        self.tested: dict = {}
        self.kept: dict = {}

    def acceptance(self) -> dict:
        """{(depth, rank): kept / tested} over the probe."""
        return {key: self.kept.get(key, 0) / n for key, n in sorted(self.tested.items())}

    def record(self, parents: list[int], path: list[int]) -> None:
        """One probe verify: the tree's parents (node order) and the kept path (root first)."""
        if self.decided:
            return
        depth, place, on_path = [0] * len(parents), [0] * len(parents), set(path)
        seen: dict = {}
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
            place[i] = seen.get(parents[i], 0)       # rank = place among its siblings, in order
            seen[parents[i]] = place[i] + 1
            if parents[i] in on_path:
                key = (depth[i], place[i])
                self.tested[key] = self.tested.get(key, 0) + 1
                self.kept[key] = self.kept.get(key, 0) + (i in on_path)
        self.steps += 1
        if self.steps >= self.probe_steps:
            self.decide()

    def decide(self) -> None:
        if self.costs is None:
            self.costs = verify_costs(self.model, self.max_nodes)
        self.current, self.line = decide_tree(self.tree, self.k, self.acceptance(), self.costs,
                                              self.max_rank)
        self.decided = True
