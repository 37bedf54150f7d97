"""Speculation that steps aside (chapter 8): off, always on, and switched per step by
`speculative_disable_by_batch_size`, on chapter 6's input-grounded prompts, measured here.

Letters: B requests served together, K draft tokens.

`compare(model, tokenizer)`, greedy (every mode must give the same tokens, which it checks):
1. sweeps B over `batch_sizes`, plain and with n-gram drafts (K = `k`), output tokens/s end to end
   and over decode-only steps;
2. takes the threshold: the smallest B from which drafting stopped paying (None if it still paid
   at the largest B, 2 if it paid at none), unless `threshold` is given;
3. times off, always and switch side by side at the smallest and the largest B.
Concurrency B is `max_num_seqs` over max(B, `min_requests`) requests with spread output lengths;
points are the best of `rounds` interleaved rounds, with the load average recorded.

Left out on purpose: arrivals over time (an offline batch at each load: the per-step switch is the
point, not the server), sampled decoding (its law is tested in tests/spec/test_spec_switch.py), draft
models and trained drafters (chapter 10's; the switch treats them alike).
"""
import os
import time

from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.prompts import SPEC_PROMPTS
from minillm.model.chat import encode_chat


def spread_lengths(batch: int, max_tokens: int) -> list[int]:
    """Output lengths from max_tokens down to about max_tokens / 2, one per request."""
    return [max_tokens - (i * max_tokens) // (2 * batch) for i in range(batch)]


def serve_batch(model, prompts: list[list[int]], lengths: list[int], stop: list[int],
                k: int, min_ngram: int, threshold: int | None = None, mode: str = "off",
                concurrency: int | None = None) -> dict:
    """One greedy run of the requests, at most `concurrency` (default all) running at once;
    mode "off", "always" or "switch" (at `threshold`)."""
    spec = {} if mode == "off" else dict(
        num_speculative_tokens=k, speculative_method="ngram", prompt_lookup_min=min_ngram,
        speculative_disable_by_batch_size=threshold if mode == "switch" else None)
    B, block = concurrency or len(prompts), 16
    per_seq = -(-(max(map(len, prompts)) + max(lengths) + k + 1) // block) + 1   # blocks, rounded up
    engine = LLMEngine(model, EngineConfig(block_size=block, num_blocks=B * per_seq, max_num_seqs=B,
                                           max_num_batched_tokens=max(512, B * (k + 1)),
                                           enable_prefix_caching=True, **spec))
    params = [SamplingParams(max_tokens=n, stop_token_ids=stop) for n in lengths]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    # decode-only steps (no prompt tokens): where drafting costs or pays; a token's time is its step's end
    ends = {r["t_end"]: r["t_end"] - r["t_start"] for r in engine.trace if r["num_prefill_tokens"] == 0}
    decode_tokens = sum(t in ends for o in outs for t in o.metrics.token_times)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    s = engine.spec_stats
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "decode_tokens_per_s": decode_tokens / sum(ends.values()) if ends else None,
            "tpot_s": sum(tpots) / len(tpots) if tpots else None, "steps": len(engine.trace),
            "steps_speculated": s.num_steps_speculated, "steps_skipped": s.num_steps_skipped,
            "accepted_fraction": s.accepted_fraction if s.num_draft_tokens else None,
            "outputs": [o.token_ids for o in outs]}


def best_of(runs: dict, key, result: dict) -> None:
    """Keep the faster of two runs of one point (interleaved rounds)."""
    if key not in runs or result["seconds"] < runs[key]["seconds"]:
        runs[key] = result


def choose_threshold(batch_sizes, speedups) -> int | None:
    """The smallest B from which drafting stopped paying: speedup < 1 there and at every larger B
    measured (one noisy point below 1 between wins does not decide), at least 2 (vLLM's floor);
    None: it still paid at the largest B."""
    chosen = None
    for B, x in sorted(zip(batch_sizes, speedups), reverse=True):
        if x >= 1:
            break
        chosen = max(2, B)
    return chosen


def compare(model, tokenizer, *, batch_sizes=(1, 4, 16), max_tokens: int = 16, k: int = 8,
            min_ngram: int = 2, rounds: int = 1, min_requests: int = 2,
            threshold: int | None = None, prompts: dict[str, str] | None = None) -> dict:
    """The sweep, the threshold chosen from it, and the three modes at low load (the smallest of
    `batch_sizes`) and high load (the largest); see the module docstring. A run at concurrency B
    serves max(B, min_requests) requests with max_num_seqs = B; `prompts` {name: text}, default
    chapter 6's `SPEC_PROMPTS`. Returns a plain dict of numbers."""
    prompts = SPEC_PROMPTS if prompts is None else prompts
    texts = list(prompts.values())
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    encoded = [encode_chat(tokenizer, t) for t in texts]
    low, high = min(batch_sizes), max(batch_sizes)

    def run(B, mode, chosen=None):
        n = max(B, min_requests)
        return serve_batch(model, [encoded[i % len(encoded)] for i in range(n)],
                           spread_lengths(n, max_tokens), stop, k, min_ngram, chosen, mode, B)

    runs = {}
    for _ in range(rounds):                                  # 1. off vs always, per B
        for B in batch_sizes:
            for mode in ("off", "always"):
                best_of(runs, (B, mode), run(B, mode))
    speedups = [runs[B, "always"]["decode_tokens_per_s"] / runs[B, "off"]["decode_tokens_per_s"]
                for B in batch_sizes]
    sweep = {m: [runs[B, m]["decode_tokens_per_s"] for B in batch_sizes] for m in ("off", "always")}
    sweep_e2e = {m: [runs[B, m]["tokens_per_s"] for B in batch_sizes] for m in ("off", "always")}
    chosen = choose_threshold(batch_sizes, speedups) if threshold is None else threshold
    modes = {}                # 3. the three modes, each timed `rounds` times beside the others
    for _ in range(rounds):
        for B in (low, high):
            for mode in ("off", "always", "switch"):
                best_of(modes, (B, mode), run(B, mode, chosen))
    same = all(r["outputs"] == runs[B, "off"]["outputs"] for d in (runs, modes) for (B, _), r in d.items())
    keys = ("tokens_per_s", "decode_tokens_per_s", "tpot_s", "steps_speculated", "steps_skipped",
            "accepted_fraction")
    table = {mode: {f"{load}_{key}": modes[B, mode][key] for load, B in (("low", low), ("high", high))
                    for key in keys} for mode in ("off", "always", "switch")}
    return {"batch_sizes": list(batch_sizes), "sweep_decode_tokens_per_s": sweep,
            "sweep_tokens_per_s": sweep_e2e, "sweep_speedup": speedups,
            "threshold": chosen, "threshold_from": "measured" if threshold is None else "given",
            "low": low, "high": high, "modes": table, "same_outputs": same,
            "settings": dict(max_tokens=max_tokens, k=k, min_ngram=min_ngram, rounds=rounds,
                             min_requests=min_requests, prompts=list(prompts)),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
