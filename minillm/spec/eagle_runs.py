"""How `EagleProposer` gets its drafter's outputs while a draft grows (chapter 10).

Letters: W window rows, N draft nodes (node 0 = the root, the context's last token), R cached
rows, T rows run in one call, C d_model.

A `Draft` holds node tokens, parents, depths and each node's input feature (its parent's
prediction); node n sits at position root + depth n and sees the window, its ancestors, itself.
- `WindowRun`, the reference: every call reruns all W window rows and every node so far.
- `CachedRun`: with one layer a row's keys and values depend only on its inputs, so the window
  rows before the root are reduced to keys and values once (`EagleDrafter.keys_values`) and each
  call runs only the nodes asked for against them (`EagleDrafter.extend`). Same outputs.
- `StableWindow` (EAGLE's stable KV): those window keys and values kept between proposals. A
  context that starts with a kept one reuses the rows it covered and computes only the tokens
  accepted since; sequences are recognised by their tokens (`slots` kept, least recent dropped).

Left out on purpose: batching several sequences' drafts.
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


class StableWindow:
    """Window keys and values kept across proposals, for up to `slots` sequences."""

    def __init__(self, slots: int = 64):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.slots, self.kept = slots, []     # [(context, first position, k, v)], newest last
        self.rows_reused = self.rows_computed = 0

    def _match(self, context: list[int]):
        S = len(context)
        for i in range(len(self.kept) - 1, -1, -1):
            ctx = self.kept[i][0]
            n = len(ctx)                      # cheap tests first, then the whole prefix
            if n <= S and ctx[-1] == context[n - 1] and ctx[n // 2] == context[n // 2] \
                    and context[:n] == ctx:
                return self.kept.pop(i)
        return None

    def keys_values(self, drafter: EagleDrafter, embed, context: list[int], win) -> DraftKV:
        """The keys and values of the window rows before the root's (positions pos[0] ..
        S - 2), reused where a kept context covers them; the result is kept for next time."""
        f, t, pos = win
        first, need = int(pos[0]), f.shape[0] - 1                  # rows wanted: first + [0, need)
        k = v = None
        reuse = 0
        found = self._match(context)
        if found is not None and found[1] <= first:
            ctx, p0, k_old, v_old = found
            reuse = max(0, min(len(ctx) - 2 - first + 1, need))    # positions first .. len(ctx)-2
            lo = first - p0
            k, v = k_old[:, :, lo:lo + reuse], v_old[:, :, lo:lo + reuse]
        kv = DraftKV()
        if reuse:
            kv.append(k, v)
        if need > reuse:                                           # rows accepted since
            kv.append(*drafter.keys_values(f[None, reuse:need], t[None, reuse:need], embed,
                                           pos[reuse:need]))
        self.rows_reused += reuse
        self.rows_computed += need - reuse
        if kv.rows:
            self.kept.append((list(context), first, kv.k, kv.v))
            del self.kept[:-self.slots]
        return kv

    def clear(self) -> None:
        self.kept.clear()


class CachedRun:
    """Window keys and values once (or from a `StableWindow`); each call runs only the nodes
    asked for. `stable` and `context` (the context's token ids) go together."""

    def __init__(self, drafter: EagleDrafter, embed, win, stable: StableWindow | None = None,
                 context: list[int] | None = None):
        self.drafter, self.embed, self.win = drafter, embed, win
        f, t, pos = win
        self.slot = {}                                             # node -> its row in kv
        if stable is not None and f.shape[0] > 1:
            self.kv = stable.keys_values(drafter, embed, context, win)
        else:
            self.kv = DraftKV()
            if f.shape[0] > 1:                                     # rows before the root's
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
