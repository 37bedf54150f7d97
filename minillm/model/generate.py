"""Autoregressive generation, two ways: `generate` with the contiguous KV cache (prefill once,
then one token per forward pass) and `generate_naive`, which recomputes the whole context every
step. The naive one is the reference the cached one is tested against.

Both return the list of new token ids (the prompt is not repeated). Letters: T prompt length.
"""
import torch

from minillm._validate import check_int
from minillm.model.kv_cache import KVCache
from minillm.model.sampling import check_sampling_args, next_token


def _check(model, prompt_ids, max_new_tokens, temperature, top_k, top_p) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty list of token ids")
    vocab, ctx = model.config.vocab_size, model.config.max_seq_len
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_ids must be ints in [0, {vocab}), got {bad[:3]}")
    check_int("max_new_tokens", max_new_tokens, 1)
    if len(prompt_ids) + max_new_tokens > ctx:
        raise ValueError(f"prompt length {len(prompt_ids)} + max_new_tokens {max_new_tokens} "
                         f"exceeds the model's context of {ctx} tokens")
    check_sampling_args(temperature, top_k, top_p)
    return list(prompt_ids)


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None,
             stop_token_ids: list[int] | None = None) -> list[int]:
    """Generate with a KV cache: one prefill pass over the prompt, then one token per pass."""
    prompt = _check(model, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    stop = set(stop_token_ids or [])
    cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, model.device, model.dtype)
    T, dev = len(prompt), model.device
    x = torch.tensor([prompt], device=dev)                         # (1, T)
    last = torch.tensor([T - 1], device=dev)
    logits = model(x, torch.arange(T, device=dev), cache, logits_index=last)[:, -1]   # (1, V)
    out: list[int] = []
    while True:
        tok = next_token(logits, temperature, top_k, top_p, generator)   # (1,)
        out.append(int(tok))
        if len(out) == max_new_tokens or out[-1] in stop:
            return out
        position = torch.tensor([T + len(out) - 1], device=dev)    # (1,): where tok sits
        logits = model(tok[:, None], position, cache)[:, -1]       # (1, V)


@torch.inference_mode()
def generate_naive(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None,
                   generator: torch.Generator | None = None,
                   stop_token_ids: list[int] | None = None) -> list[int]:
    """The reference: every step runs the model over the full context, no cache at all."""
    ids = _check(model, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    stop = set(stop_token_ids or [])
    out: list[int] = []
    while True:
        x = torch.tensor([ids + out], device=model.device)         # (1, T + t)
        logits = model(x)[:, -1]                                   # (1, V)
        tok = next_token(logits, temperature, top_k, top_p, generator)
        out.append(int(tok))
        if len(out) == max_new_tokens or out[-1] in stop:
            return out


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of B equal-length prompts in one batch (used by the decode benchmark)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts must all have the same length, got lengths {sorted(lengths)}")
    T = lengths.pop()
    cache = KVCache(model.config, len(prompts), T + max_new_tokens, model.device, model.dtype)
    dev = model.device
    x = torch.tensor(prompts, device=dev)                          # (B, T)
    logits = model(x, torch.arange(T, device=dev), cache, logits_index=torch.tensor([T - 1]))[:, -1]
    out = [logits.argmax(-1)]                                      # (B,) tokens per step
    while len(out) < max_new_tokens:
        position = torch.tensor([T + len(out) - 1], device=dev)    # (1,), shared by the rows
        logits = model(out[-1][:, None], position, cache)[:, -1]   # (B, V)
        out.append(logits.argmax(-1))
    return torch.stack(out, dim=1).tolist()                        # (B, max_new_tokens)
