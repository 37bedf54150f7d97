"""Exactness of tree verification by enumeration: the law of the first tokens, every outcome counted.

Letters: V vocab, L tokens whose joint law is computed. The decoding being enumerated is the
batch-1 tree loop: from a prefix, the drafter gives a `TreeDraft`, the acceptance rule keeps a
path and one more token, and steps repeat until L tokens are out. For a tiny vocabulary every
outcome of every step can be listed with its probability, so the joint law of the L tokens is
exact (float64). The rule is exact if and only if that law equals the target's own law
p(y_1) p(y_2 | y_1) ... token by token.

It runs the package's own rule: `tree_rejection.sibling_rule`, looked up at call time, so a test
can swap in a broken rule (`monkeypatch.setattr(tree_rejection, "sibling_rule", ...)`) and watch
the law move. `rule="typical"` enumerates Medusa's typical acceptance instead (deterministic
paths, then a draw from the chosen node's law), the lossy contrast.

Left out on purpose: anything but brute force; the cost grows as V^L times the tree's size.
"""
import math

import torch

from minillm.spec import tree_rejection
from minillm.spec.tree import TreeDraft


def _exact_outcomes(p_of, draft: TreeDraft, node: int, path_toks: tuple, weight: float, out: list):
    """Append (probability, new tokens) for every way one exact tree step can end from `node`."""
    toks = draft.tokens.tolist()
    kids = draft.children(node)
    p = p_of(path_toks)
    accept, residual = tree_rejection.sibling_rule(p, [toks[c] for c in kids])
    for j, c in enumerate(kids):
        if float(accept[j]) > 0:
            _exact_outcomes(p_of, draft, c, path_toks + (toks[c],), weight * float(accept[j]), out)
    fallback = 1.0 - float(accept.sum())
    if fallback > 1e-15:
        for y in torch.nonzero(residual > 0).flatten().tolist():
            out.append((weight * fallback * float(residual[y]), path_toks + (y,)))


def _typical_outcomes(p_of, draft: TreeDraft, threshold: float, alpha: float, out: list):
    toks = draft.tokens.tolist()
    ok, best, paths = [True] + [False] * (draft.num_nodes - 1), 0, {0: ()}
    for i in range(1, draft.num_nodes):
        par = draft.parents[i]
        paths[i] = paths[par] + (toks[i],)
        if not ok[par]:
            continue
        p = p_of(paths[par])
        h = -float((p * p.clamp(min=1e-300).log()).sum())
        ok[i] = float(p[toks[i]]) > min(threshold, alpha * math.exp(-h))
        if ok[i] and draft.depths[i] > draft.depths[best]:
            best = i
    p = p_of(paths[best])
    for y in torch.nonzero(p > 0).flatten().tolist():
        out.append((float(p[y]), paths[best] + (y,)))


def exact_tree_law(target_fn, tree_fn, vocab_size: int, length: int, rule: str = "exact",
                   posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> torch.Tensor:
    """Exact joint law (V,) * length, float64, of the first `length` tokens of tree decoding.

    target_fn(prefix) -> (V,) processed probabilities after the token tuple `prefix` (the tokens
    generated so far); tree_fn(prefix) -> the `TreeDraft` drafted there (tokens[0], the root, is
    not read). rule: "exact" (tree_accept's recursive rejection) or "typical" (Medusa's)."""
    if rule not in ("exact", "typical"):
        raise ValueError(f"rule must be 'exact' or 'typical', got {rule!r}")
    law = torch.zeros((vocab_size,) * length, dtype=torch.float64)

    def step(prefix: tuple) -> list:
        def p_of(path_toks):
            return target_fn(prefix + path_toks).to(torch.float64)
        draft, out = tree_fn(prefix), []
        if rule == "exact":
            _exact_outcomes(p_of, draft, 0, (), 1.0, out)
        else:
            _typical_outcomes(p_of, draft, posterior_threshold, posterior_alpha, out)
        return out

    def fill(prefix: tuple, weight: float):
        for w, new in step(prefix):
            seq = prefix + new
            if len(seq) >= length:
                law[seq[:length]] += weight * w
            else:
                fill(seq, weight * w)

    fill((), 1.0)
    return law
