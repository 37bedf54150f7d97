"""STAND-IN for the tree helper's module (token trees), only what the trained proposers need:
`TokenTree(paths)` and `TreeDraft(tokens, parents)`. The tree helper's full module replaces
this file at merge; the interface below is the shared one.

Letters: N tree nodes (node 0 = the root, the last sampled token).
"""
from dataclasses import dataclass

import torch


class TokenTree:
    """A static candidate tree: paths of top-k ranks, e.g. [(0,), (1,), (0, 0)]."""

    def __init__(self, paths, max_depth: int | None = None, max_rank: int | None = None):
        if not paths or not all(isinstance(p, tuple) and p for p in paths):
            raise ValueError("speculative_token_tree must be a non-empty list of non-empty tuples")
        paths = sorted(set(paths), key=lambda p: (len(p), p))
        known = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"speculative_token_tree is not prefix-closed: {p} without {p[:-1]}")
            if max_depth is not None and len(p) > max_depth:
                raise ValueError(f"speculative_token_tree path {p} is deeper than {max_depth}")
            if max_rank is not None and max(p) >= max_rank:
                raise ValueError(f"speculative_token_tree path {p} uses a rank >= {max_rank}")
        self.paths = paths
        index = {p: i + 1 for i, p in enumerate(paths)}
        self.parents = [-1] + [index.get(p[:-1], 0) for p in paths]
        self.depths = [0] + [len(p) for p in paths]
        self.ranks = [-1] + [p[-1] for p in paths]
        self.num_nodes = len(paths) + 1

    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        return cls([(0,) * d for d in range(1, k + 1)])

    def children(self, i: int) -> list[int]:
        return [j for j, p in enumerate(self.parents) if p == i]


@dataclass
class TreeDraft:
    """A concrete draft: tokens (N,) with tokens[0] = root, parents[0] = -1."""
    tokens: torch.Tensor
    parents: list[int]
