"""Token trees (stand-in: only `TreeDraft`, the concrete draft a tree proposer returns).

The full module (TokenTree, tree_forward, commit_path) is written beside this one; this file
holds the one name the lookahead proposer needs, with the agreed fields, so the two can merge.
"""
from dataclasses import dataclass

import torch


@dataclass
class TreeDraft:
    """A concrete draft tree of N nodes: tokens[0] is the root (the last token), parents[i] < i
    is node i's parent (parents[0] = -1). Siblings carry distinct tokens."""
    tokens: torch.Tensor        # (N,) long
    parents: list[int]
