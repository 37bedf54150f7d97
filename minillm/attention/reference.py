"""The trusted reference: attention written as five lines of matmul + softmax, and the input checks
every attention function of this package shares.

Letters: B batch, H query heads, Hkv kv heads (GQA: H % Hkv == 0, each kv head serves G = H / Hkv
query heads), T queries, S keys, D head dim. q (B, H, T, D), k and v (B, Hkv, S, D) with S >= T;
the queries are the last T of the S positions (query t sits at position S - T + t, as when
decoding against a cache), so causal means key j is visible to query t when j <= S - T + t.
`mask` (optional) is a bool tensor broadcastable to (B, H, T, S), True = may attend (key padding of
a ragged batch, for instance); it combines with `causal`.

A query row that may attend nothing (every key masked) gets the output 0 here and in the tiled
version (softmax over an empty set has no value; 0 is the choice FlashAttention's kernels make),
never NaN. Left out on purpose: dropout, attention bias, sliding windows.
"""
import math

import torch

from minillm._validate import ArgumentTypeError, check_real


def check_attention_inputs(q, k, v, mask=None, scale=None) -> float:
    """Validate shapes, dtypes and the mask; return the softmax scale (1/sqrt(D) by default)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, T, D)" if name == "q" else "(B, Hkv, S, D)"
            raise ValueError(f"{name} must be a 4-D tensor {want}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, S, D), got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    (B, H, T, D), (Bk, Hkv, S, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"k's batch size must equal q's (B = {B}), got {Bk}")
    if Dk != D:
        raise ValueError(f"k's head dim must equal q's (D = {D}), got {Dk}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"k's head count Hkv must divide q's head count H = {H} "
                         f"(Hkv in the divisors of {H}), got Hkv = {Hkv}")
    if S < T:
        raise ValueError(f"k's length S must be >= q's length T = {T} (the queries are the last T "
                         f"of the S positions), got S = {S}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ArgumentTypeError(f"q, k and v must share one floating dtype, got {q.dtype}, "
                                f"{k.dtype}, {v.dtype}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ArgumentTypeError(f"mask must be a bool tensor broadcastable to (B, H, T, S) = "
                                    f"{(B, H, T, S)}, got {getattr(mask, 'dtype', type(mask).__name__)}")
        try:
            ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, (B, H, T, S)) == (B, H, T, S)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"mask must be broadcastable to (B, H, T, S) = {(B, H, T, S)}, "
                             f"got shape {tuple(mask.shape)}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    return check_real("scale", scale, low=0, low_open=True)


def visible(T: int, S: int, causal: bool, device=None) -> torch.Tensor:
    """(T, S) bool: may query t (at position S - T + t) see key j?"""
    if not causal:
        return torch.ones(T, S, dtype=torch.bool, device=device)
    return torch.arange(S, device=device) <= (S - T + torch.arange(T, device=device))[:, None]


def attention_reference(q, k, v, *, causal: bool = True, mask=None, scale=None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) @ v, materializing the (B, H, T, S) scores. -> (B, H, T, D)."""
    scale = check_attention_inputs(q, k, v, mask, scale)
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)      # (B, H, S, D)
    scores = (q @ k.transpose(-2, -1)) * scale                                # (B, H, T, S)
    allowed = visible(q.shape[2], k.shape[2], causal, q.device)               # (T, S)
    allowed = allowed if mask is None else allowed & mask                     # (B?, H?, T, S)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    p = p.masked_fill(~allowed.any(-1, keepdim=True), 0.0)     # rows that see nothing: 0, not NaN
    return p @ v                                                              # (B, H, T, D)
