"""Accepting a path of a token tree: exact recursive rejection, and Medusa's lossy contrast.

Letters: N tree nodes, C children of one node, V vocab. Row i of `tree_forward`'s logits is the
next-token law after the path root -> i.

Greedy: follow the child that is the target's argmax; where none is, emit the argmax (identical
to plain greedy decoding). Exact sampling (SpecInfer, one-hot drafts): at a node with law p, try
its children in order against a residual r = p: accept x_j with probability r(x_j), else zero
r(x_j), renormalize and try the next; if all fail, draw from r. An accepted child becomes the
current node; an accepted leaf draws the bonus token from its own row (1 to depth + 1 tokens).
`sibling_rule` is the deterministic half, `tree_accept` draws from it with the request's
generator, `exact_tree_law` (tree_law.py) enumerates it.

Typical acceptance (Medusa-2) accepts x when p(x) > min(epsilon, delta * exp(-H(p))): longer
paths, but NOT exact (the tests measure its total-variation distance by enumeration).

Left out on purpose: stochastic (non one-hot) tree drafts with their own q, batches of trees.
"""
import torch

from minillm.model.sampling import check_sampling_args, logits_to_probs
from minillm.spec.rejection import sample_from_uniform
from minillm.spec.tree import TreeDraft


def sibling_rule(p: torch.Tensor, child_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p (V,) float64 and the children's distinct tokens -> (P(child j is accepted) (C,),
    residual (V,) the fallback law when all are rejected). Trying the children in order."""
    accept = torch.zeros(len(child_tokens), dtype=p.dtype)
    r, reach = p.clone(), 1.0                   # reach: P(every earlier child was rejected)
    for j, x in enumerate(child_tokens):
        a = float(r[x])
        accept[j] = reach * a
        reach *= 1.0 - a
        if a >= 1.0:                           # certain accept: later children are never tried
            break
        r[x] = 0.0
        r = r / r.sum()
    return accept, r


def _check(logits, draft):
    if not isinstance(draft, TreeDraft):
        raise TypeError(f"draft must be a TreeDraft, got {type(draft).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != draft.num_nodes:
        raise ValueError(f"logits must be (N, V) with N = {draft.num_nodes} (the draft's nodes), "
                         f"got {getattr(logits, 'shape', type(logits).__name__)}")


def _uniform(generator, device) -> float:
    dev = generator.device if generator is not None else device
    return float(torch.rand(1, generator=generator, dtype=torch.float64, device=dev))


def tree_accept(logits: torch.Tensor, draft: TreeDraft, temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """logits (N, V) from `tree_forward` -> (accepted nodes [0, ...] root first, next token).

    Greedy at temperature 0 (no randomness used); otherwise exact recursive rejection over each
    node's children with p = logits_to_probs(logits, temperature, top_k, top_p)."""
    _check(logits, draft)
    check_sampling_args(temperature, top_k, top_p)
    toks = draft.tokens.tolist()
    path = [0]
    if temperature == 0:
        best = logits.argmax(-1).tolist()                                 # (N,)
        while True:
            nxt = next((c for c in draft.children(path[-1]) if toks[c] == best[path[-1]]), None)
            if nxt is None:
                return path, best[path[-1]]
            path.append(nxt)
    # the rule walks a few rows element by element: on the host, in float64
    p = logits_to_probs(logits, temperature, top_k, top_p).to("cpu", torch.float64)   # (N, V)
    while True:
        kids = draft.children(path[-1])
        accept, residual = sibling_rule(p[path[-1]], [toks[c] for c in kids])
        u = _uniform(generator, p.device)
        chosen = int((u >= accept.cumsum(0)).sum()) if len(kids) else 0   # first j with u < cum
        if chosen < len(kids):
            path.append(kids[chosen])
            continue
        v = torch.tensor([_uniform(generator, p.device)], dtype=torch.float64)
        return path, int(sample_from_uniform(residual[None], v)[0])


def typical_accept(logits: torch.Tensor, draft: TreeDraft, temperature: float = 0.7,
                   posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa's typical acceptance (lossy): a candidate x under law p is accepted when
    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))); the deepest node whose whole
    path is accepted wins (the first in node order among equals), and the next token is drawn
    from its row of p. Medusa's names and defaults (epsilon = 0.09, delta = 0.3); greedy at
    temperature 0."""
    _check(logits, draft)
    if not 0 < posterior_threshold <= 1 or not 0 < posterior_alpha:
        raise ValueError(f"need posterior_threshold in (0, 1] and posterior_alpha > 0, got "
                         f"{posterior_threshold}, {posterior_alpha}")
    if temperature == 0:
        return tree_accept(logits, draft, 0.0)
    p = logits_to_probs(logits, temperature).to("cpu", torch.float64)           # (N, V)
    entropy = -(p * p.clamp(min=1e-300).log()).sum(-1)                          # (N,)
    bar = torch.minimum(torch.full_like(entropy, posterior_threshold),
                        posterior_alpha * torch.exp(-entropy))                  # (N,)
    ok, best = [True] + [False] * (draft.num_nodes - 1), 0
    for i in range(1, draft.num_nodes):
        par = draft.parents[i]
        ok[i] = ok[par] and bool(p[par, draft.tokens[i]] > bar[par])
        if ok[i] and draft.depths[i] > draft.depths[best]:
            best = i
    v = torch.tensor([_uniform(generator, p.device)], dtype=torch.float64)
    return draft.path_to(best), int(sample_from_uniform(p[best][None], v)[0])
