"""How `EagleProposer` gets its drafter's outputs while a draft grows (chapter 10): the reference
that recomputes everything each depth, and the one that keeps keys and values.

Letters: W window rows, N draft nodes (node 0 = the root, the context's last token), R cached
rows, T rows run in one call, C d_model.

A draft is a `Draft`: node tokens, parents, depths and each node's input feature (its parent's
predicted feature). Node 0's input is the window's last row. Node n sits at position
(root position + depth n) and sees the window, its ancestors and itself.

- `WindowRun` (the reference, kept forever): each call runs the drafter over all W window rows
  plus every node drafted so far, under the tree mask, and reads the rows asked for.
- `CachedRun`: one drafter layer means a row's keys and values depend on that row's inputs
  only. The first W - 1 window rows are reduced to keys and values once per proposal
  (`EagleDrafter.keys_values`, no attention or MLP); each call then runs just the nodes asked
  for (the frontier: one row per depth on a chain) against those plus their ancestors' cached
  keys and values (`EagleDrafter.extend`). Same outputs, to float rounding.

Left out on purpose: keeping the window's keys and values across proposals (EAGLE's stable KV:
the engine would have to say which sequence is which), batching several sequences' drafts.
"""
from dataclasses import dataclass, field

import torch

from minillm.spec.heads import DraftKV, EagleDrafter


@dataclass
class Draft:
    """The nodes drafted so far: node 0 is the root."""
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    inputs: list = field(default_factory=lambda: [None])      # (C,) parent's predicted feature

    def add(self, token: int, parent: int, feature: torch.Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.inputs.append(feature)
        return len(self.tokens) - 1


class WindowRun:
    """The reference: window + every node through the drafter on every call."""

    def __init__(self, drafter: EagleDrafter, embed, win):
        self.drafter, self.embed, self.win = drafter, embed, win  # win: feats (W, C), toks, pos

    def __call__(self, draft: Draft, nodes: list[int]) -> torch.Tensor:
        """-> the predicted features of `nodes`, (len(nodes), C)."""
        f, t, pos = self.win
        W, n, dev = f.shape[0], len(draft.tokens) - 1, f.device
        mask = torch.zeros(W + n, W + n, dtype=torch.bool, device=dev)     # True = seen
        mask[:W, :W] = torch.ones(W, W, dtype=torch.bool, device=dev).tril()
        mask[W:, :W] = True
        for i in range(1, n + 1):
            j = i
            while j > 0:                                                   # self and ancestors
                mask[W + i - 1, W + j - 1] = True
                j = draft.parents[j]
        feats = torch.cat([f] + [x[None] for x in draft.inputs[1:]])        # (W + n, C)
        toks = torch.cat([t, torch.tensor(draft.tokens[1:], dtype=torch.long, device=dev)])
        p = torch.cat([pos, pos[-1] + torch.tensor(draft.depths[1:], dtype=torch.long,
                                                   device=dev)])
        out = self.drafter(feats[None], toks[None], self.embed, p, mask)[0]  # (W + n, C)
        return out[[W - 1 + i for i in nodes]]


class CachedRun:
    """Window keys and values once; each call runs only the nodes asked for."""

    def __init__(self, drafter: EagleDrafter, embed, win):
        self.drafter, self.embed, self.win = drafter, embed, win
        f, t, pos = win
        self.kv, self.slot = DraftKV(), {}                          # node -> its row in kv
        if f.shape[0] > 1:                                         # rows before the root's
            self.kv.append(*drafter.keys_values(f[None, :-1], t[None, :-1], embed, pos[:-1]))

    def __call__(self, draft: Draft, nodes: list[int]) -> torch.Tensor:
        """-> the predicted features of `nodes` (never run before), (len(nodes), C)."""
        f, t, pos = self.win
        W, R, T, dev = f.shape[0], self.kv.rows, len(nodes), f.device
        mask = torch.zeros(T, R + T, dtype=torch.bool, device=dev)          # True = seen
        mask[:, :W - 1] = True                                             # the window
        for a, n in enumerate(nodes):
            if n in self.slot:
                raise ValueError(f"draft node {n} was already run")
            mask[a, R + a] = True                                          # itself
            j = draft.parents[n]
            while j >= 0:                                                  # its ancestors
                mask[a, self.slot[j]] = True
                j = draft.parents[j]
        feats = torch.stack([f[-1] if n == 0 else draft.inputs[n] for n in nodes])   # (T, C)
        toks = torch.tensor([draft.tokens[n] for n in nodes], dtype=torch.long, device=dev)
        p = pos[-1] + torch.tensor([draft.depths[n] for n in nodes], dtype=torch.long, device=dev)
        out = self.drafter.extend(feats[None], toks[None], self.embed, p, self.kv, mask)[0]
        self.slot.update({n: R + a for a, n in enumerate(nodes)})
        return out                                                         # (T, C)
