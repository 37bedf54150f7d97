"""Exact speculative sampling: accept or reject a drafter's K tokens so the output follows p.

Letters: B batch, K draft tokens per row, V vocab. Drafts x_1..x_K with (processed) laws
q_1..q_K; the target gives p_1..p_{K+1}. Left to right, x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the replacement comes from
norm(max(p_i - q_i, 0)); if all K pass, a bonus token comes from p_{K+1} (Leviathan et al. 2023,
Chen et al. 2023). `draft_probs=None` means q one-hot at the draft (deterministic drafters);
`greedy_verify` is the greedy case. `acceptance_probs` and `residual_probs` are the deterministic
halves, `rejection_sample` adds the coin flips from one `torch.Generator` or a list of B (then
row b of a batch gives what row b alone gives).

Left out on purpose: tree (multi-branch) verification, typical acceptance, per-row K.
"""
import torch

_SUM_TOL = {torch.float64: 1e-6, torch.float32: 1e-3}


def _check_probs(name: str, probs: torch.Tensor) -> None:
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {type(probs).__name__}")
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError(f"{name} must be finite and >= 0 (probabilities, not logits)")
    err = (probs.sum(-1, dtype=torch.float64) - 1).abs().max().item()
    if err > _SUM_TOL.get(probs.dtype, 1e-2):
        raise ValueError(f"{name} must sum to 1 over the vocabulary (last dim); "
                         f"the worst row is off by {err:.3g}")


def check_spec_inputs(target_probs, draft_probs, draft_token_ids) -> tuple[int, int, int]:
    """Validate shapes, dtypes and values; return (B, K, V). Raises ValueError/TypeError."""
    _check_probs("target_probs", target_probs)
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be (B, K+1, V), got shape {tuple(target_probs.shape)}")
    B, K1, V = target_probs.shape
    K = K1 - 1
    if K < 1:
        raise ValueError(f"K (draft tokens per row) must be >= 1; target_probs has K+1 = {K1} "
                         f"positions")
    if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dtype != torch.long:
        raise TypeError("draft_token_ids must be a LongTensor of shape (B, K)")
    if tuple(draft_token_ids.shape) != (B, K):
        raise ValueError(f"draft_token_ids must be (B, K) = {(B, K)} to match target_probs "
                         f"(B, K+1, V) = {(B, K1, V)}, got {tuple(draft_token_ids.shape)}")
    if draft_token_ids.numel() and not (0 <= draft_token_ids.min() and draft_token_ids.max() < V):
        raise ValueError(f"draft_token_ids must be in [0, V) = [0, {V})")
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs)
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
            raise ValueError(f"draft_probs must be (B, K, V) with (B, K) = {(B, K)}, got shape "
                             f"{tuple(draft_probs.shape)}")
        if draft_probs.shape[-1] != V:
            raise ValueError(f"vocab mismatch: draft_probs has V = {draft_probs.shape[-1]}, "
                             f"target_probs has V = {V}; draft and target need one vocabulary")
    return B, K, V


def _one_hot(draft_token_ids: torch.Tensor, V: int, dtype) -> torch.Tensor:
    out = torch.zeros(*draft_token_ids.shape, V, dtype=dtype, device=draft_token_ids.device)
    return out.scatter_(-1, draft_token_ids[..., None], 1.0)      # (B, K, V)


def acceptance_probs(target_probs, draft_probs, draft_token_ids) -> torch.Tensor:
    """min(1, p_i(x_i) / q_i(x_i)) for each draft position: (B, K). q = None means one-hot."""
    K = draft_token_ids.shape[1]
    idx = draft_token_ids[..., None]                               # (B, K, 1)
    p_x = target_probs[:, :K].gather(-1, idx).squeeze(-1)          # (B, K)
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.gather(-1, idx).squeeze(-1).to(p_x.dtype)    # (B, K)
    # q_x == 0 means the drafter proposed a token it gave no mass; accept iff p wants it at all
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=torch.finfo(p_x.dtype).tiny)).clamp(max=1.0),
                       (p_x > 0).to(p_x.dtype))


def residual_probs(target_probs, draft_probs, draft_token_ids) -> torch.Tensor:
    """The distribution of the replacement token after a rejection at each position, plus p_{K+1}
    for the bonus: (B, K+1, V). Position i < K: norm(max(p_i - q_i, 0)); where that is all zero
    (p_i == q_i, so rejection has probability 0) p_i is returned to keep the rows valid."""
    K, V = draft_token_ids.shape[1], target_probs.shape[-1]
    p = target_probs[:, :K]                                        # (B, K, V)
    q = _one_hot(draft_token_ids, V, p.dtype) if draft_probs is None else draft_probs.to(p.dtype)
    r = (p - q).clamp(min=0)                                       # (B, K, V)
    mass = r.sum(-1, keepdim=True)                                 # (B, K, 1)
    r = torch.where(mass > 0, r / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
    return torch.cat([r, target_probs[:, K:]], dim=1)              # (B, K+1, V)


def _uniforms(B: int, n: int, generator, device) -> torch.Tensor:
    """(B, n) float64 uniforms in [0, 1) from one generator or one generator per row."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"generator must be one torch.Generator or a list of B = {B}, "
                             f"got a list of {len(generator)}")
        # one draw per request generator (a loop over generators, not over the math)
        rows = [torch.rand(n, generator=g, dtype=torch.float64, device=g.device) for g in generator]
        return torch.stack(rows).to(device)                        # (B, n)
    dev = generator.device if generator is not None else device
    return torch.rand(B, n, generator=generator, dtype=torch.float64, device=dev).to(device)


def sample_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: (B, V) probs and (B,) uniforms -> (B,) tokens (never a zero-prob token)."""
    cdf = probs.to(torch.float64).cumsum(-1)                       # (B, V)
    target = u * cdf[:, -1]                                        # (B,)
    tok = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return tok.clamp(max=probs.shape[-1] - 1)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor, generator=None):
    """Verify K draft tokens per row against the target.

    target_probs (B, K+1, V), draft_probs (B, K, V) or None (deterministic drafter: q one-hot),
    draft_token_ids (B, K) long. Both distributions must already be processed with the same
    temperature / top-k / top-p. Returns `(output_token_ids, num_accepted)`: (B, K+1) long where
    row b holds its num_accepted[b] accepted draft tokens, then the replacement (or bonus) token,
    then -1 padding; and (B,) long. Row b gains num_accepted[b] + 1 tokens.

    >>> p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]]); x = torch.tensor([[0]])
    >>> rejection_sample(p, None, x)[0]     # p(0) = 0, so the draft is rejected, 1 replaces it
    tensor([[ 1, -1]])
    """
    B, K, V = check_spec_inputs(target_probs, draft_probs, draft_token_ids)
    device = target_probs.device
    u = _uniforms(B, K + 1, generator, device)                     # (B, K+1): K coins + 1 draw
    accept = u[:, :K] < acceptance_probs(target_probs, draft_probs, draft_token_ids).double()
    # number of leading accepts: cumprod stays 1 until the first rejection
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)        # (B,)
    rows = torch.arange(B, device=device)
    final_dist = residual_probs(target_probs, draft_probs, draft_token_ids)[rows, num_accepted]
    final_tok = sample_from_uniform(final_dist, u[:, K])           # (B,)
    return _assemble(draft_token_ids, num_accepted, final_tok), num_accepted


def _assemble(draft_token_ids, num_accepted, final_tok) -> torch.Tensor:
    """(B, K+1): accepted drafts, then the final token at column num_accepted, then -1."""
    B, K = draft_token_ids.shape
    cols = torch.arange(K + 1, device=draft_token_ids.device)[None, :]           # (1, K+1)
    padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(B, 1)], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, torch.full_like(padded, -1))
    return out.scatter(1, num_accepted[:, None], final_tok[:, None])


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor):
    """Temperature 0: accept while the target's argmax equals the draft, then emit the argmax.

    target_logits (B, K+1, V) (logits or probs: only the argmax matters), draft_token_ids (B, K).
    Same return convention as `rejection_sample`; no randomness is used.
    """
    if target_logits.dim() != 3 or draft_token_ids.dim() != 2 or \
            target_logits.shape[:2] != (draft_token_ids.shape[0], draft_token_ids.shape[1] + 1):
        raise ValueError(f"target_logits must be (B, K+1, V) and draft_token_ids (B, K) with K >= 1, "
                         f"got {tuple(target_logits.shape)} and {tuple(draft_token_ids.shape)}")
    if draft_token_ids.shape[1] < 1:
        raise ValueError("K (draft tokens per row) must be >= 1")
    best = target_logits.argmax(-1)                                # (B, K+1)
    K = draft_token_ids.shape[1]
    num_accepted = (best[:, :K] == draft_token_ids).long().cumprod(dim=1).sum(dim=1)  # (B,)
    final_tok = best.gather(1, num_accepted[:, None]).squeeze(1)   # (B,)
    return _assemble(draft_token_ids, num_accepted, final_tok), num_accepted
