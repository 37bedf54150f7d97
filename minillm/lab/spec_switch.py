"""Speculation that steps aside (chapter 8, issue 37): off, always on, and switched per step by
`speculative_disable_by_batch_size`, on chapter 6's input-grounded prompts, measured here.

`compare(model, tokenizer)` does three things in one run, greedy (so every mode must give the
same tokens, which it checks):
1. the sweep: B requests served together (B in `batch_sizes`), plain and with n-gram drafts
   (K = `k`, chapter 6's setup), output tokens/s of each; the speedup always-on / off per B;
2. the threshold: the smallest B of the sweep where drafting stopped paying (speedup < 1): that
   is `speculative_disable_by_batch_size` on this machine (None when it paid at every B; 2, the
   least vLLM allows, when it paid at none), unless `threshold` is given;
3. the three modes (off, always, switch at that threshold), at low load (`low` requests together:
   per-token latency, TPOT, and tokens/s) and at high load (`high` requests: output tokens/s, the
   switch's steps speculated / skipped).
Requests of one run get output lengths spread from max_tokens / 2 to max_tokens (a batch thins
out as it finishes, where the switch speculates again). Each point is timed in `rounds`
interleaved rounds and the best kept (STYLE 18); the load average is recorded beside them.

Letters: B requests served together, K draft tokens.

Left out on purpose: arrivals over time (an offline batch at each load: the per-step switch is the
point, not the server), sampled decoding (its law is tested in tests/test_spec_switch.py), draft
models and trained drafters (chapter 10's; the switch treats them alike).
"""
import os
import time

from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sequence import SamplingParams
from minillm.lab.prompts import SPEC_PROMPTS
from minillm.model.chat import encode_chat


def spread_lengths(batch: int, max_tokens: int) -> list[int]:
    """Output lengths from max_tokens down to about max_tokens / 2, one per request."""
    return [max_tokens - (i * max_tokens) // (2 * batch) for i in range(batch)]


def serve_batch(model, prompts: list[list[int]], lengths: list[int], stop: list[int],
                k: int, min_ngram: int, threshold: int | None = None, mode: str = "off") -> dict:
    """One greedy run of len(prompts) requests together; mode "off", "always" or "switch"."""
    spec = {} if mode == "off" else dict(
        num_speculative_tokens=k, speculative_method="ngram", prompt_lookup_min=min_ngram,
        speculative_disable_by_batch_size=threshold if mode == "switch" else None)
    B, block = len(prompts), 16
    per_seq = -(-(max(map(len, prompts)) + max(lengths) + k + 1) // block) + 1   # blocks, rounded up
    engine = LLMEngine(model, EngineConfig(block_size=block, num_blocks=B * per_seq, max_num_seqs=B,
                                           max_num_batched_tokens=max(512, B * (k + 1)), **spec))
    params = [SamplingParams(max_tokens=n, stop_token_ids=stop) for n in lengths]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    s = engine.spec_stats
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tpot_s": sum(tpots) / len(tpots) if tpots else None, "steps": len(engine.trace),
            "steps_speculated": s.num_steps_speculated, "steps_skipped": s.num_steps_skipped,
            "accepted_fraction": s.accepted_fraction if s.num_draft_tokens else None,
            "outputs": [o.token_ids for o in outs]}


def best_of(runs: dict, key, result: dict) -> None:
    """Keep the faster of two runs of one point (interleaved rounds)."""
    if key not in runs or result["seconds"] < runs[key]["seconds"]:
        runs[key] = result


def choose_threshold(batch_sizes, speedups) -> int | None:
    """The smallest B where drafting stopped paying (speedup < 1), at least 2; None: it paid at
    every B measured."""
    for B, x in zip(batch_sizes, speedups):
        if x < 1:
            return max(2, B)
    return None


def compare(model, tokenizer, *, batch_sizes=(1, 2, 4, 8), low: int = 1, high: int = 16,
            max_tokens: int = 32, k: int = 8, min_ngram: int = 2, rounds: int = 2,
            threshold: int | None = None) -> dict:
    """The sweep, the threshold chosen from it, and the three modes at low and high load (see the
    module docstring). Returns a plain dict of numbers (and the outputs' agreement)."""
    texts = list(SPEC_PROMPTS.values())
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    encoded = [encode_chat(tokenizer, t) for t in texts]

    def work(B):
        return [encoded[i % len(encoded)] for i in range(B)], spread_lengths(B, max_tokens)

    sweep = {}
    for _ in range(rounds):                                  # 1. off vs always, per B
        for B in batch_sizes:
            for mode in ("off", "always"):
                best_of(sweep, (B, mode), serve_batch(model, *work(B), stop, k, min_ngram, mode=mode))
    speedups = [sweep[B, "always"]["tokens_per_s"] / sweep[B, "off"]["tokens_per_s"] for B in batch_sizes]
    chosen = choose_threshold(batch_sizes, speedups) if threshold is None else threshold
    modes = {}
    for _ in range(rounds):                                  # 3. the three modes, low and high
        for load, B in (("low", low), ("high", high)):
            for mode in ("off", "always", "switch"):
                best_of(modes, (load, mode), serve_batch(model, *work(B), stop, k, min_ngram,
                                                         threshold=chosen, mode=mode))
    same = all(r["outputs"] == sweep[B, "off"]["outputs"] for (B, _), r in sweep.items()) and all(
        r["outputs"] == modes[load, "off"]["outputs"] for (load, _), r in modes.items())
    table = {mode: {f"{load}_{key}": modes[load, mode][key] for load in ("low", "high")
                    for key in ("tokens_per_s", "tpot_s", "steps_speculated", "steps_skipped",
                                "accepted_fraction")} for mode in ("off", "always", "switch")}
    return {"batch_sizes": list(batch_sizes),
            "sweep_tokens_per_s": {m: [sweep[B, m]["tokens_per_s"] for B in batch_sizes]
                                   for m in ("off", "always")},
            "sweep_speedup": speedups, "threshold": chosen,
            "threshold_from": "measured" if threshold is None else "given",
            "low": low, "high": high, "modes": table, "same_outputs": same,
            "settings": dict(max_tokens=max_tokens, k=k, min_ngram=min_ngram, rounds=rounds,
                             prompts=list(SPEC_PROMPTS)),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
