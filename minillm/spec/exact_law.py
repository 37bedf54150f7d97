"""Exactness by enumeration: the law of one draft-then-verify step, with every outcome counted.

Letters: K draft tokens, V vocab. For tiny V and K, `exact_step_law` sums over every draft
sequence x_1..x_K (weighted by the drafter's q) and every stopping point n (weighted by the
acceptance probabilities), and puts the replacement or bonus token's law after it. The tokens a
step does not fill are completed by sampling the target, so the result is the joint law of K + 1
tokens. The rule is exact if and only if that law equals the target's own, token by token.

It runs the package's own halves of the rule, `acceptance_probs` and `residual_probs`
(rejection.py), looked up in this module at call time: chapter 6 swaps one of them for a broken
rule (`mock.patch.object(exact_law, "residual_probs", ...)`) and watches the law move.

Left out on purpose: anything but brute force (the cost is V^K drafts times K + 1 outcomes).
"""
from itertools import product

import torch

from minillm.spec.rejection import acceptance_probs, residual_probs


def exact_step_law(target_fn, draft_fn, k: int, vocab_size: int) -> torch.Tensor:
    """Exact law of the first K + 1 tokens after one draft-then-verify step, completed by sampling
    the target for the positions the step did not fill. Shape (V,) * (K+1), float64.

    target_fn(prefix) and draft_fn(prefix) map a tuple of token ids to a (V,) probability vector
    (already processed); a deterministic drafter is a draft_fn that returns one-hot rows. The
    result equals the target law exactly when the rejection rule is right.
    """
    V = vocab_size
    drafts = list(product(range(V), repeat=k))                                   # V^K drafts
    P = torch.stack([torch.stack([target_fn(x[:i]) for i in range(k + 1)]) for x in drafts])
    Q = torch.stack([torch.stack([draft_fn(x[:i]) for i in range(k)]) for x in drafts])
    X = torch.tensor(drafts, dtype=torch.long)                                   # (N, K)
    w = Q.gather(-1, X[..., None]).squeeze(-1).prod(dim=1)                       # (N,) P(draft)
    acc = acceptance_probs(P, Q, X)                                              # (N, K)
    R = residual_probs(P, Q, X)                                                  # (N, K+1, V)
    reach = torch.cat([torch.ones(len(drafts), 1, dtype=acc.dtype), acc.cumprod(1)], 1)
    stop = reach * torch.cat([1 - acc, torch.ones(len(drafts), 1, dtype=acc.dtype)], 1)  # P(n)

    cont: dict[tuple, torch.Tensor] = {}

    def future(prefix: tuple) -> torch.Tensor:       # target law of the tokens after `prefix`
        if len(prefix) == k + 1:
            return torch.ones((), dtype=torch.float64)
        if prefix not in cont:
            cont[prefix] = torch.stack([future(prefix + (y,)) for y in range(V)])
        p = target_fn(prefix).to(torch.float64)
        return p.view(-1, *[1] * (k - len(prefix))) * cont[prefix]

    law = torch.zeros((V,) * (k + 1), dtype=torch.float64)
    for d, x in enumerate(drafts):
        for n in range(k + 1):
            weight = float(w[d] * stop[d, n])
            if weight == 0:
                continue
            future(x[:n])                                                        # fills cont
            r = R[d, n].to(torch.float64).view(-1, *[1] * (k - n))
            law[x[:n]] += weight * r * cont[x[:n]]
    return law
