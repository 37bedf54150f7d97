"""Turning logits into a next token: temperature, top-k, min-p, top-p (nucleus), then a draw.

Letters: B batch, V vocab. `logits_to_probs` is the single place where sampling parameters are
applied, so plain decoding, the engine and speculative decoding (which must apply the same
processing to the target's p and the draft's q) all agree. Randomness always comes from an
explicit `torch.Generator`, so every result can be reproduced.
"""

import torch

from minillm._validate import check_real


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """The one validator of sampling parameters (`generate`, `SamplingParams`, speculative
    decoding): TypeError for the wrong type, ValueError naming the allowed range otherwise."""
    if check_real("temperature", temperature) < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be None or an int, got {type(top_k).__name__} {top_k!r}")
        if top_k < -1:
            raise ValueError(f"top_k must be None, -1/0 (off) or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0 < check_real("top_p", top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, min_p: float = 0.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature, top-k, min-p, then top-p.

    temperature 0 gives a one-hot at the argmax (greedy). top_k None, 0 or -1, top_p None or 1 and
    min_p 0 mean "off". Min-p drops the tokens whose probability is below min_p times the most
    likely one's (vLLM's order: before top-p; it commutes with top-k, which keeps the top token).
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p.

    >>> logits_to_probs(torch.tensor([2.0, 1.0, 0.0]), top_k=2).round(decimals=4)
    tensor([0.7311, 0.2689, 0.0000])
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]   # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if check_real("min_p", min_p, 0, 1) > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)      # (..., V)
        mass_before = sorted_p.cumsum(-1) - sorted_p                # mass of strictly better tokens
        drop_sorted = mass_before >= top_p                          # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row: (B, V) -> (B,) long. One-hot rows (greedy) need no randomness."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be (B, V), got shape {tuple(probs.shape)}")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens; greedy takes the argmax without touching the generator."""
    if temperature == 0:
        check_sampling_args(temperature, top_k, top_p)
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, temperature, top_k, top_p), generator)
