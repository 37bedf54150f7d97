"""Proposers built on trained drafters (chapter 10): `MedusaProposer` and `EagleProposer`.

Letters: S context length, C d_model, N tree nodes, K draft depth, V vocab.

Both read the target's features at positions 0..S-2, (S - 1, C) or a tail of them, as the
verifying loop or engine hands them over (None: one forward pass here, `context_features`).
- `propose_tree(context_ids, features, tree) -> TreeDraft` fills a `TokenTree` of top-k ranks.
  Medusa: depth d holds head d-1's ranks, all read from the last feature. EAGLE: the drafter
  runs over the last `window` rows plus the nodes so far (each sees the window, its ancestors
  and itself; `eagle_runs.py` keeps the keys and values); a node's children are the top ranks of
  its own predicted feature. `dynamic=True` grows EAGLE-2's tree: per depth it expands the
  `dynamic_width` most probable nodes, then keeps the `tree.num_nodes - 1` most probable of all.
- `propose(contexts, k, ...) -> Proposal`: the K-chain (the tree's top-1 path), q None: the
  drafts are deterministic, exact at any temperature under rejection sampling.

Left out on purpose: Medusa's typical acceptance (lossy; chapter 10 measures it), batched trees.
"""
import torch

from minillm.spec.eagle_runs import CachedRun, Draft, StableWindow, WindowRun
from minillm.spec.heads import EagleDrafter, MedusaHeads
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import Proposal, _check_k, _contexts
from minillm.spec.tree import TokenTree, TreeDraft


@torch.inference_mode()
def context_features(model, context_ids: list[int]) -> torch.Tensor:
    """The target's features of a context: hidden rows of positions 0..S-2, (S - 1, C)."""
    if len(context_ids) < 2:
        raise ValueError("trained drafters need a context of >= 2 tokens (one feature row)")
    ids = torch.tensor([context_ids[:-1]], device=model.device)              # (1, S - 1)
    _, hidden = model(ids, logits_index=torch.tensor([ids.shape[1] - 1]), return_hidden=True)
    return hidden[0]                                                        # (S - 1, C)


def _check_drafter(model, drafter, cls) -> None:
    if not isinstance(drafter, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(drafter).__name__}")
    cfg = model.config
    if (drafter.hidden_size, drafter.vocab_size) != (cfg.d_model, cfg.vocab_size):
        raise ValueError(f"drafter made for hidden size {drafter.hidden_size}, vocab "
                         f"{drafter.vocab_size}; the model has {cfg.d_model}, {cfg.vocab_size}")


class _TrainedProposer(Proposer):
    needs_features = True                  # Medusa reads the last row, EAGLE a window

    def _features(self, context_ids, features) -> torch.Tensor:
        if features is None:
            return context_features(self.model, context_ids)
        if features.dim() != 2 or not 1 <= features.shape[0] <= len(context_ids) - 1:
            raise ValueError(f"features must be (w, C) with 1 <= w <= S - 1 = "
                             f"{len(context_ids) - 1}: the rows of positions S-1-w..S-2, got "
                             f"{tuple(features.shape)}")
        return features.to(self.model.device, self.model.dtype)

    def propose(self, contexts, k: int, temperature: float = 0.0, top_k=None, top_p=None,
                generator=None, features=None) -> Proposal:
        """(B,) contexts -> the top-1 chain of k tokens per row, (B, k); q None (deterministic).
        `features`: None or one (S - 1, C) tensor per row."""
        contexts, _ = _contexts(contexts), _check_k(k)
        feats = features if features is not None else [None] * len(contexts)
        chain = TokenTree.chain(k)
        rows = [self._chain(c, f, chain).tokens[1:] for c, f in zip(contexts, feats, strict=True)]
        return Proposal(torch.stack(rows).cpu(), None, torch.full((len(contexts),), k))

    def _chain(self, context_ids, features, chain: TokenTree) -> TreeDraft:
        return self.propose_tree(context_ids, features, chain)


class MedusaProposer(_TrainedProposer):
    """Tree drafts from Medusa heads: depth d holds head d-1's top ranks."""

    def __init__(self, model, heads: MedusaHeads):
        _check_drafter(model, heads, MedusaHeads)
        self.model, self.heads = model, heads.to(model.device, model.dtype).eval()

    @torch.inference_mode()
    def ranked(self, feature: torch.Tensor, width: int) -> torch.Tensor:
        """feature (C,) -> each head's top-`width` token ids, (K, width)."""
        logits = self.heads.logits(feature, self.model.lm_head)             # (K, V)
        return self.heads.token_ids(logits.topk(width, dim=-1).indices)     # (K, width)

    @torch.inference_mode()
    def propose_tree(self, context_ids: list[int], features, tree: TokenTree) -> TreeDraft:
        depth = max(tree.depths)
        if depth > self.heads.num_heads:
            raise ValueError(f"speculative_token_tree is {depth} deep but there are "
                             f"{self.heads.num_heads} Medusa heads (depth <= num_heads)")
        feature = self._features(context_ids, features)[-1]                 # (C,)
        top = self.ranked(feature, max(tree.ranks) + 1)                     # (K, width)
        tokens = [context_ids[-1]] + [int(top[d - 1, r]) for d, r in
                                      zip(tree.depths[1:], tree.ranks[1:])]
        return TreeDraft(torch.tensor(tokens, device=self.model.device), list(tree.parents))


class EagleProposer(_TrainedProposer):
    """Tree drafts from an EAGLE drafter, static (the given tree) or dynamic (EAGLE-2).
    `kv_cache=False` runs the reference that recomputes the window at every depth."""

    def __init__(self, model, drafter: EagleDrafter, window: int = 32, dynamic: bool = False,
                 dynamic_width: int = 4, kv_cache: bool = True):
        _check_drafter(model, drafter, EagleDrafter)
        for name, v in (("window", window), ("dynamic_width", dynamic_width)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(kv_cache, bool):
            raise TypeError(f"kv_cache must be a bool, got {kv_cache!r}")
        self.model, self.drafter = model, drafter.to(model.device, model.dtype).eval()
        self.window, self.dynamic, self.dynamic_width = window, dynamic, dynamic_width
        self.kv_cache = kv_cache
        self.stable = StableWindow() if kv_cache else None     # window rows across proposals

    @property
    def feature_window(self) -> int:
        return self.window                           # the drafter reads a window of rows

    def _runner(self, context_ids, features):
        feats = self._features(context_ids, features)                       # (w, C)
        S = len(context_ids)
        feats = feats[-self.window:]                 # a tail: positions S-1-len..S-2
        lo = S - 1 - len(feats)
        dev = feats.device
        toks = torch.tensor(context_ids[lo + 1:], dtype=torch.long, device=dev)   # (W,)
        win = feats, toks, torch.arange(lo + 1, S, device=dev)
        if self.kv_cache:
            return CachedRun(self.drafter, self.model.embed, win, self.stable, context_ids)
        return WindowRun(self.drafter, self.model.embed, win)

    def reset(self) -> None:
        if self.stable is not None:
            self.stable.clear()

    def _children_logp(self, out: torch.Tensor, width: int):
        """out (M, C) predicted features -> (top log-probs, token ids), each (M, width)."""
        logp = self.drafter.vocab_logits(out, self.model.lm_head).float().log_softmax(-1)
        top = logp.topk(width, dim=-1)
        return top.values, self.drafter.token_ids(top.indices)

    @torch.inference_mode()
    def propose_tree(self, context_ids: list[int], features, tree: TokenTree) -> TreeDraft:
        run = self._runner(context_ids, features)
        if self.dynamic:
            return self._dynamic(context_ids, run, tree)
        return self._static(context_ids, run, tree)

    @torch.inference_mode()
    def _chain(self, context_ids, features, chain: TokenTree) -> TreeDraft:
        return self._static(context_ids, self._runner(context_ids, features), chain)

    def _static(self, context_ids, run, tree: TokenTree) -> TreeDraft:
        width = max(tree.ranks) + 1
        draft = Draft([context_ids[-1]])
        order = list(range(1, tree.num_nodes))                              # depth order
        for d in range(1, max(tree.depths) + 1):
            level = [i for i in order if tree.depths[i] == d]
            par = sorted({tree.parents[i] for i in level})                 # nodes to expand
            rows = run(draft, par)                                         # (P, C)
            _, ids = self._children_logp(rows, width)                      # (P, width)
            for i in level:
                pi = par.index(tree.parents[i])
                draft.add(int(ids[pi, tree.ranks[i]]), tree.parents[i], rows[pi])
        return TreeDraft(torch.tensor(draft.tokens, device=self.model.device), draft.parents)

    def _dynamic(self, context_ids, run, tree: TokenTree) -> TreeDraft:
        budget, width = tree.num_nodes - 1, self.dynamic_width
        draft, score, frontier = Draft([context_ids[-1]]), [0.0], [0]
        for _ in range(max(tree.depths)):
            rows = run(draft, frontier)                                    # (P, C)
            logp, ids = self._children_logp(rows, width)                   # (P, width)
            new = []
            for a, p in enumerate(frontier):
                for r in range(width):
                    new.append(draft.add(int(ids[a, r]), p, rows[a]))
                    score.append(score[p] + float(logp[a, r]))
            frontier = sorted(new, key=lambda i: -score[i])[:width]
        depth = draft.depths
        keep = sorted(range(1, len(draft.tokens)), key=lambda i: (-score[i], depth[i], i))[:budget]
        keep = [0] + sorted(keep, key=lambda i: (depth[i], i))
        where = {old: new for new, old in enumerate(keep)}
        return TreeDraft(torch.tensor([draft.tokens[i] for i in keep], device=self.model.device),
                         [-1] + [where[draft.parents[i]] for i in keep[1:]])
