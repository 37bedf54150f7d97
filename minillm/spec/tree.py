"""Token trees: many candidate continuations checked by the target in ONE forward pass.

Letters: N tree nodes (node 0 = the root), S slots before the tree, V vocab, C d_model,
L layers, Hkv kv heads, D head dim.

Each node attends to the prefix and its own ancestors only (a tree mask), at the RoPE position
of its depth, so its logits are those of "prefix + path root -> i".

- `TokenTree`: a static shape as paths of top-k ranks, e.g. [(0,), (1,), (0, 0)] (Medusa's and
  vLLM's `speculative_token_tree` spelling); a proposer fills it with tokens.
- `TreeDraft`: a concrete draft, tokens and parents (a dynamic drafter returns its own shape).
- `tree_forward`: the verify pass on the contiguous `KVCache`; node i's KV go to slot start + i
  and `TreeAttention` applies the mask (reference and flat forward alike).
- `commit_path`: move the accepted nodes' KV right after the prefix; the rest is overwritten.

Left out on purpose: batches of trees (the paged engine's job), trees deeper than the cache.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.model.kv_cache import KVCache

_ARG = "speculative_token_tree"


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors."""
    N = len(parents)
    mask = torch.eye(N, dtype=torch.bool)
    for i in range(1, N):                    # parents come first, so row parents[i] is complete
        mask[i] |= mask[parents[i]]
    return mask


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


class TokenTree:
    """A static candidate tree: paths of top-k ranks, node 0 the root, node i + 1 = paths[i].

    >>> t = TokenTree([(0,), (1,), (0, 0)])
    >>> t.parents, t.depths, t.ranks, t.children(0)
    ([-1, 0, 0, 1], [0, 1, 1, 2], [-1, 0, 1, 0], [1, 2])
    """

    def __init__(self, paths, max_depth: int | None = None, max_rank: int | None = None):
        if not isinstance(paths, (list, tuple)) or len(paths) == 0:
            raise ValueError(f"{_ARG} must be a non-empty list of paths like [(0,), (1,), (0, 0)], "
                             f"got {paths!r}")
        clean = set()
        for p in paths:
            if not isinstance(p, (tuple, list)) or len(p) == 0 or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
                raise ValueError(f"{_ARG}: every path must be a non-empty tuple of ranks >= 0 "
                                 f"(ints), got {p!r}")
            clean.add(tuple(p))
        if len(clean) != len(paths):
            raise ValueError(f"{_ARG}: a path is listed twice in {paths!r}")
        for p in clean:
            if len(p) > 1 and p[:-1] not in clean:
                raise ValueError(f"{_ARG} must be prefix-closed: {p} is listed but its parent "
                                 f"{p[:-1]} is not")
            if max_depth is not None and len(p) > max_depth:
                raise ValueError(f"{_ARG}: path {p} is deeper than the {max_depth} tokens the "
                                 f"drafter proposes (num_speculative_tokens)")
            if max_rank is not None and max(p) >= max_rank:
                raise ValueError(f"{_ARG}: path {p} uses a rank >= {max_rank}, the top-k the "
                                 f"drafter produces (ranks must be in [0, {max_rank}))")
        self.paths = sorted(clean, key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        self.parents = [-1] + [index.get(p[:-1], 0) for p in self.paths]
        self.depths = [0] + [len(p) for p in self.paths]
        self.ranks = [-1] + [p[-1] for p in self.paths]
        self.num_nodes = len(self.paths) + 1
        self._children = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):       # ranks ascending: paths are sorted
            self._children[self.parents[i]].append(i)

    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        """The chain of chapter 6: the top-1 guess k times, [(0,), (0, 0), ...]."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
        return cls([(0,) * d for d in range(1, k + 1)])

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, i: int) -> list[int]:
        """Node i's children, by rank."""
        return list(self._children[i])

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: [i, j] True when node j is node i or an ancestor of it."""
        return _ancestor_mask(self.parents)

    def __repr__(self) -> str:
        return f"TokenTree({self.paths})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenTree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(tuple(self.paths))


@dataclass
class TreeDraft:
    """A concrete draft: tokens (N,) with tokens[0] = the root (the last sampled token, not yet
    run through the target) and parents (parents[0] = -1, parents[i] < i). Siblings hold distinct
    tokens (the exact acceptance rule tries each candidate once). `ranks` (optional): each node's
    top-k rank, as in the `TokenTree` it fills (statistics per (depth, rank) read it)."""
    tokens: torch.Tensor
    parents: list[int]
    ranks: list[int] | None = None

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dtype != torch.long \
                or self.tokens.dim() != 1 or len(self.tokens) == 0:
            raise TypeError("TreeDraft.tokens must be a non-empty 1-D LongTensor (N,)")
        self.parents = [int(p) for p in self.parents]
        N = len(self.tokens)
        if len(self.parents) != N or self.parents[0] != -1 or \
                any(not 0 <= self.parents[i] < i for i in range(1, N)):
            raise ValueError(f"TreeDraft.parents must have N = {N} entries, parents[0] = -1 and "
                             f"0 <= parents[i] < i, got {self.parents}")
        self._children = [[] for _ in range(N)]
        for i in range(1, N):
            self._children[self.parents[i]].append(i)
        toks = self.tokens.tolist()
        for i, kids in enumerate(self._children):
            if len({toks[c] for c in kids}) != len(kids):
                raise ValueError(f"TreeDraft: node {i}'s children repeat a token "
                                 f"({[toks[c] for c in kids]}); siblings must be distinct")
        self.depths = _depths(self.parents)
        if self.ranks is not None and len(self.ranks) != N:
            raise ValueError(f"TreeDraft.ranks must have N = {N} entries, got {len(self.ranks)}")

    @classmethod
    def from_tree(cls, tree: TokenTree, tokens) -> "TreeDraft":
        """A draft of `tree`'s shape: tokens (N,) in the tree's node order."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.shape != (tree.num_nodes,):
            raise ValueError(f"tokens must be ({tree.num_nodes},) for {tree}, got {tuple(tokens.shape)}")
        return cls(tokens, list(tree.parents), list(tree.ranks))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def children(self, i: int) -> list[int]:
        return list(self._children[i])

    def ancestor_mask(self) -> torch.Tensor:
        return _ancestor_mask(self.parents)

    def path_to(self, i: int) -> list[int]:
        """Nodes from the root to node i."""
        path = [i]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def prune(self, max_depth: int) -> "TreeDraft":
        """The nodes at depth <= max_depth (node order kept), e.g. to fit a token budget."""
        return self._subset([i for i in range(self.num_nodes) if self.depths[i] <= max_depth])

    def first(self, n: int) -> "TreeDraft":
        """The first n nodes (a tree too: parents come before their children)."""
        return self._subset(list(range(min(n, self.num_nodes))))

    def _subset(self, keep: list[int]) -> "TreeDraft":
        new = {old: j for j, old in enumerate(keep)}
        ranks = None if self.ranks is None else [self.ranks[i] for i in keep]
        return TreeDraft(self.tokens[keep], [-1] + [new[self.parents[i]] for i in keep[1:]], ranks)


class TreeAttention:
    """The cache protocol over a `KVCache` for one tree pass: node i's k/v are stored at slot
    start + i; a node attends to the slots before start and to its ancestors and itself."""

    def __init__(self, cache: KVCache, start: int, ancestor_mask: torch.Tensor):
        N = ancestor_mask.shape[0]
        self.cache, self.start, self.end = cache, start, start + N
        seen = torch.cat([torch.ones(N, start, dtype=torch.bool), ancestor_mask], dim=1)  # (N, S+N)
        self.mask = torch.zeros(seen.shape, dtype=cache.k.dtype).masked_fill_(~seen, float("-inf"))
        self.mask = self.mask.to(cache.k.device)

    def attend(self, layer_idx: int, q, k, v, positions=None):
        # q (1, H, N, D), k/v (1, Hkv, N, D) -> (1, H, N, D); positions (depths) only rotate
        self.cache.k[layer_idx, :, :, self.start:self.end] = k
        self.cache.v[layer_idx, :, :, self.start:self.end] = v
        keys = self.cache.k[layer_idx, :, :, :self.end]                # (1, Hkv, S + N, D)
        values = self.cache.v[layer_idx, :, :, :self.end]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask.to(q.dtype),
                                              enable_gqa=keys.shape[1] != q.shape[1])


def _check_cache(cache, start: int, n: int) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a minillm KVCache (contiguous), got {type(cache).__name__}")
    if cache.k.shape[1] != 1:
        raise ValueError(f"tree verification runs at batch 1: the cache has batch size {cache.k.shape[1]}")
    if not isinstance(start, int) or not 0 <= start or start + n > cache.max_seq_len:
        raise ValueError(f"start must be an int with 0 <= start and start + {n} <= max_seq_len "
                         f"{cache.max_seq_len}, got {start!r}")


def tree_forward(model, cache: KVCache, draft: TreeDraft, start: int, return_hidden: bool = False):
    """Logits (N, V) of every node of `draft` (with `return_hidden`, also hidden (N, C)).

    The cache holds the prefix in slots < start; node i's keys and values are written to slot
    start + i, its RoPE position is start + depth(i), and it attends to the prefix and its own
    ancestors. Node i's logits are the target's next-token logits after prefix + path(root -> i).
    """
    if not isinstance(draft, TreeDraft):
        raise TypeError(f"draft must be a TreeDraft, got {type(draft).__name__}")
    N, dev = draft.num_nodes, model.device
    _check_cache(cache, start, N)
    positions = torch.tensor(draft.depths, device=dev) + start                 # (N,)
    attn = TreeAttention(cache, start, draft.ancestor_mask())
    out = model(draft.tokens.to(dev)[None], positions, attn, return_hidden=return_hidden)
    if return_hidden:
        return out[0][0], out[1][0]                                            # (N, V), (N, C)
    return out[0]                                                              # (N, V)


def commit_path(cache: KVCache, start: int, nodes: list[int]) -> None:
    """Move the keys and values of the accepted nodes (root first, node order) to slots start,
    start + 1, ...; slots after them hold stale entries the next pass overwrites."""
    nodes = [int(n) for n in nodes]
    if not nodes or nodes[0] != 0 or any(b <= a for a, b in zip(nodes, nodes[1:])):
        raise ValueError(f"nodes must start with the root 0 and increase (a root-to-node path), "
                         f"got {nodes}")
    _check_cache(cache, start, nodes[-1] + 1)
    src = torch.tensor(nodes, device=cache.k.device) + start
    dst = slice(start, start + len(nodes))
    cache.k[:, :, :, dst] = cache.k[:, :, :, src]          # gather copies first: overlap is safe
    cache.v[:, :, :, dst] = cache.v[:, :, :, src]
