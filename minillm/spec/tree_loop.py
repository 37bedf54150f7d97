"""The batch-1 speculative loop with token trees: one tree verify pass per step.

Letters: N draft nodes (node 0 = root), S context, C d_model, V vocab. One step:

1. the proposer fills a tree (`propose_tree(context, features, tree) -> TreeDraft`); the root is
   the last emitted token, which the target has not run yet;
2. `tree_forward` runs every node in ONE target pass (row i: the law after "context + path to i");
3. `tree_accept` keeps a root-to-node path and one more token (greedy or exact sampling);
4. `commit_path` moves the path's KV after the prefix; rejected slots are overwritten next pass.

Features (proposers with `needs_features`): the final norm's output of every context token but
the last, (S - 1, C); each step appends the hidden rows of the accepted path. `SpecStats` counts
drafted and accepted nodes and, per (depth, rank), how often a node was tested and accepted
(`acceptance_by_position()`, what `tree_sizing` reads).

Left out on purpose: adaptive K, batches (the engine), stop strings.
"""
import time

import torch

from minillm.model.kv_cache import KVCache
from minillm.spec.tree import TokenTree, TreeDraft, commit_path, tree_forward
from minillm.spec.tree_rejection import tree_accept


def check_tree(tree, num_speculative_tokens: int) -> TokenTree:
    """tree None -> the chain of K; a TokenTree or a list of paths -> a TokenTree."""
    if tree is None:
        return TokenTree.chain(num_speculative_tokens)
    if isinstance(tree, TokenTree):
        return tree
    return TokenTree(tree)


def count_positions(stats, draft: TreeDraft, path: list[int]) -> None:
    """Add one step's tested / accepted counts per (depth, rank) of the draft's nodes."""
    on_path = set(path)
    for i in range(draft.num_nodes):
        if i not in on_path:
            continue
        for place, c in enumerate(draft.children(i)):
            key = (draft.depths[c], place if draft.ranks is None else draft.ranks[c])
            stats.node_tested[key] = stats.node_tested.get(key, 0) + 1
            if c in on_path:
                stats.node_accepted[key] = stats.node_accepted.get(key, 0) + 1


def tree_generate(target, proposer, prompt: list[int], max_new_tokens: int, tree: TokenTree,
                  params: tuple, generator, stop: set, stats) -> list[int]:
    """The tree loop behind `speculative_generate(..., tree=...)` (already validated there)."""
    dev, needs = target.device, proposer.needs_features
    room = min(target.config.max_seq_len, len(prompt) + max_new_tokens + tree.num_nodes)
    cache = KVCache(target.config, 1, room, dev, target.dtype)
    features = torch.zeros(0, target.config.d_model, dtype=target.dtype, device=dev)
    if len(prompt) > 1:
        out = target(torch.tensor([prompt[:-1]], device=dev), torch.arange(len(prompt) - 1, device=dev),
                     cache, logits_index=torch.tensor([len(prompt) - 2]), return_hidden=needs)
        if needs:
            features = out[1][0]                                               # (S - 1, C)
    out: list[int] = []
    while len(out) < max_new_tokens and not (out and out[-1] in stop):
        new, hidden = _step(target, proposer, cache, prompt + out, features if needs else None,
                            tree, max_new_tokens - len(out), params, generator, stats)
        if needs:
            features = torch.cat([features, hidden])
        for tok in new[:max_new_tokens - len(out)]:
            out.append(tok)
            if tok in stop:
                break
    return out


def _step(target, proposer, cache, context, features, tree, budget, params, generator, stats):
    """One propose + verify step -> (new tokens, hidden rows of the accepted path or None)."""
    start = len(context) - 1                                  # the cache holds context[:-1]
    t0 = time.perf_counter()
    if budget > 1:
        draft = proposer.propose_tree(context, features, tree)
        if not isinstance(draft, TreeDraft):
            raise TypeError(f"propose_tree must return a TreeDraft, got {type(draft).__name__}")
        if int(draft.tokens[0]) != context[-1]:
            raise ValueError(f"propose_tree: the draft's root token {int(draft.tokens[0])} must be "
                             f"the context's last token {context[-1]}")
        if max(draft.depths) > budget - 1:                    # no path longer than the budget
            draft = draft.prune(budget - 1)
    else:
        draft = TreeDraft(torch.tensor([context[-1]]), [-1])
    fits = cache.max_seq_len - start                          # a big dynamic tree near the end
    if draft.num_nodes > fits:
        draft = draft.first(fits)
    t1 = time.perf_counter()
    out = tree_forward(target, cache, draft, start, return_hidden=features is not None)
    logits, hidden = out if features is not None else (out, None)            # (N, V), (N, C)
    path, nxt = tree_accept(logits, draft, *params, generator=generator)
    commit_path(cache, start, path)
    proposer.observe(draft, logits, path)                   # lookahead's Jacobi step
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.num_proposed.append(draft.num_nodes - 1)
    stats.num_accepted.append(len(path) - 1)
    count_positions(stats, draft, path)
    new = draft.tokens[path[1:]].tolist() + [nxt]
    return new, (hidden[path] if hidden is not None else None)
