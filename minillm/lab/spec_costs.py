"""What one speculative step costs, measured (chapter 6): forward times of target and draft models
after a cached context, prefill times, and the best-of-n wall time of a whole generation.

Letters: T new tokens of a forward, S cached context tokens.

Medians of interleaved rounds, not minimums: every case sees the same drift of a shared machine,
and a long generation loop pays the median. `bench.spec` builds its predictions from these.
"""
import statistics
import time

import torch

from minillm.bench.common import prefilled
from minillm.model.kv_cache import KVCache


def _best(fn, repeat: int):
    """(best wall seconds, result of the last call)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


@torch.inference_mode()
def forward_times(models: dict, context_len: int, new_tokens: dict, rounds: int = 7) -> dict:
    """Median forward time of each (model, number of new tokens) after `context_len` cached
    tokens. Rounds interleave all the cases, so any drift of the machine spreads evenly; the
    median (not the minimum) is what a long generation loop sees on average."""
    forwards = {name: prefilled(m, 1, context_len, max(new_tokens[name]))[1]
                for name, m in models.items()}
    samples = {(n, t): [] for n in models for t in new_tokens[n]}
    for _ in range(rounds):
        for (name, t), times in samples.items():
            x = torch.ones(1, t, dtype=torch.long, device=models[name].device)
            t0 = time.perf_counter()
            forwards[name](x)
            times.append(time.perf_counter() - t0)
    return {key: statistics.median(times) for key, times in samples.items()}


@torch.inference_mode()
def prefill_times(models: dict, prompt_len: int, rounds: int = 3) -> dict:
    """Median time of each model's forward over a whole prompt (what `generate` does first, and
    what a draft model must also do before it can propose)."""
    x = {name: torch.ones(1, prompt_len, dtype=torch.long, device=m.device) for name, m in models.items()}
    samples = {name: [] for name in models}
    for _ in range(rounds):
        for name, m in models.items():
            cache = KVCache(m.config, 1, prompt_len, m.device, m.dtype)
            t0 = time.perf_counter()
            m(x[name], torch.arange(prompt_len, device=m.device), cache,
              logits_index=torch.tensor([prompt_len - 1]))
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, times in samples.items()}
