"""What one speculative step costs, measured (chapter 6): forward times of target and draft models
after a cached context, prefill times, the best-of-n wall time of a whole generation, and a small
batch served by the engine plain and with n-gram drafts (`small_batch`).

Letters: T new tokens of a forward, S cached context tokens.

Medians of interleaved rounds, not minimums: every case sees the same drift of a shared machine,
and a long generation loop pays the median. The benchmark (`python -m benchmarks spec`) builds its
predictions from these.
"""
import statistics
import time

import torch

from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.common import prefilled
from minillm.model.kv_cache import KVCache


def best_time(fn, repeat: int):
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


def small_batch(model, prompts: list[list[int]], stop: list[int], s: dict) -> dict:
    """All prompts served together by the engine (max_num_seqs = len(prompts)), greedy: plain
    continuous batching vs the same engine with n-gram drafts. One verify pass now carries
    B x (K + 1) tokens against B tokens for a plain step. "acceptance" here is the engine's
    accepted / drafted tokens (`RequestOutput.metrics`), not the per-token rate a of the batch-1
    runs (`spec_theory.estimate_acceptance`), which counts only the drafts actually tested: the
    same summarize run is 34/64 = 0.53 one way and 34/39 = 0.87 the other."""
    params = SamplingParams(max_tokens=s["max_new_tokens"], stop_token_ids=stop)
    B, res = len(prompts), {}
    configs = {"plain": EngineConfig(max_num_seqs=B, max_num_batched_tokens=512),
               "ngram": EngineConfig(max_num_seqs=B, max_num_batched_tokens=512,
                                     num_speculative_tokens=s["k_ngram"], speculative_method="ngram",
                                     prompt_lookup_min=s["min_ngram"])}
    outs = {}
    for _ in range(s["repeat"]):                       # interleaved, best of `repeat`
        for label, cfg in configs.items():
            engine = LLMEngine(model, cfg)
            t0 = time.perf_counter()
            outs[label] = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            if wall < res.get(label, {}).get("seconds", float("inf")):
                tokens = sum(len(o.token_ids) for o in outs[label])
                res[label] = {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                              "steps": len(engine.trace)}
    m = [o.metrics for o in outs["ngram"]]
    # "acceptance*" keys: accepted / drafted (kept for older records; accepted_fraction* the same)
    res["ngram"]["acceptance_per_request"] = [x.accepted_fraction for x in m]
    res["ngram"]["accepted_fraction_per_request"] = res["ngram"]["acceptance_per_request"]
    res["ngram"]["acceptance"] = (sum(x.num_accepted_tokens for x in m)
                                  / max(1, sum(x.num_draft_tokens for x in m)))
    res["ngram"]["accepted_fraction"] = res["ngram"]["acceptance"]
    res["batch"] = B
    res["same_as_plain"] = [o.token_ids for o in outs["ngram"]] == [o.token_ids for o in outs["plain"]]
    res["speedup"] = res["ngram"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    return res
