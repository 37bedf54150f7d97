"""This machine's step costs for chapter 11's simulator: the engine's own steps, timed, then
fitted by DistServe's formulas (analysis/step_fit.py).

`measure_step_costs(model, prompt_lengths, batch_sizes, contexts)` builds an `LLMEngine` over
the model (token budget large enough that every prompt prefills in one step, no chunk cap) and
reads the times off its trace (`t_start`, `t_end` of each step):
- prefill: one prompt of each length, alone, `max_tokens=1`;
- decode: B prompts of S tokens each prefilled, then the steps that hold only their B decodes,
  at contexts S, S + 1, ... (the tokens each sequence has cached, as the simulator counts them);
- mixed (a check, not fitted): the same B decodes with one more prompt admitted beside them, the
  step the colocated simulation prices with `StepCosts.step_seconds`.
Rounds interleave the cases, so drift spreads over all of them; `threads` sets torch's threads
for the measurement (a server's engine runs with its own: 2 colocated, 1 a side disaggregated).

Letters: L prompt tokens, S context, B sequences in a decode step.
Left out on purpose: prefix caching, speculative decoding, and a GPU (the trace times are wall
clock, which on a GPU includes the host's wait for the device only because sampling syncs).
"""
import statistics

import torch

from minillm._validate import check_int
from minillm.analysis.step_fit import StepCosts, fit_error, fit_step_costs
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams


def _model(model_or_llm):
    engine = getattr(model_or_llm, "llm_engine", None)
    return engine.model if engine is not None else model_or_llm


def _ids(length: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Queue the prompts together, step until they finish; -> the trace rows of those steps."""
    first = len(engine.trace)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.trace[first:]


def _seconds(row: dict) -> float:
    return row["t_end"] - row["t_start"]


def measure_step_costs(model_or_llm, prompt_lengths=(32, 128, 256, 512, 768),
                       batch_sizes=(1, 4, 8), contexts=(32, 256, 512), decode_steps: int = 4,
                       rounds: int = 2, threads: int | None = None, seed: int = 0) -> dict:
    """Time the engine's steps and fit them. -> {"prefill": [([L], s), ...], "decode":
    [([S + j] * B, s), ...], "mixed": [(chunks [(L, 0)], contexts, s), ...] (medians over the
    rounds), "costs": StepCosts, "error": fit_error of the fit on its own samples plus "mixed"
    (mean and max relative error of step_seconds), "threads"}."""
    model = _model(model_or_llm)
    lengths = [check_int("prompt_lengths[]", n, 2) for n in prompt_lengths]
    batches = [check_int("batch_sizes[]", b, 1) for b in batch_sizes]
    ctxs = [check_int("contexts[]", s, 2) for s in contexts]
    check_int("decode_steps", decode_steps, 1)
    check_int("rounds", rounds, 1)
    if len(set(lengths)) < 3 or len(batches) * len(ctxs) < 3:
        raise ValueError("need at least 3 distinct prompt_lengths and 3 (batch, context) pairs")
    budget = max(max(lengths), max(batches) * max(ctxs)) + max(batches)
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max(batches) + 1,
                       enable_chunked_prefill=True, attention_backend="paged",
                       kv_cache_memory_bytes=256 * 2**20)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, 1))
    try:
        engine = LLMEngine(model, cfg)
        g, vocab = torch.Generator().manual_seed(seed), model.config.vocab_size
        pre, dec, mix = {}, {}, {}
        _run(engine, [_ids(16, vocab, g)], 2)                          # warm-up
        for _ in range(rounds):
            for n in lengths:
                pre.setdefault(n, []).append(_seconds(_run(engine, [_ids(n, vocab, g)], 1)[0]))
            for b in batches:
                for s in ctxs:
                    rows = _run(engine, [_ids(s, vocab, g) for _ in range(b)], 1 + decode_steps)
                    steps = [r for r in rows if r["num_prefill_tokens"] == 0]
                    for j, r in enumerate(steps[:decode_steps]):
                        dec.setdefault((b, s + j), []).append(_seconds(r))
                    mixed = _mixed_step(engine, b, s, min(lengths), vocab, g)
                    if mixed is not None:
                        mix.setdefault((b, s), []).append(mixed)
    finally:
        torch.set_num_threads(before)
    med = statistics.median
    prefill = [([n], med(t)) for n, t in pre.items()]
    decode = [([s] * b, med(t)) for (b, s), t in dec.items()]
    mixed = [([(min(lengths), 0)], [s + 1] * b, med(t)) for (b, s), t in mix.items()]
    costs = fit_step_costs(prefill, decode)
    err = fit_error(costs, prefill, decode)
    errs = [abs(costs.step_seconds(c, x) - t) / t for c, x, t in mixed]
    err["mixed"] = {"mean": sum(errs) / len(errs), "max": max(errs)} if errs else None
    return {"prefill": prefill, "decode": decode, "mixed": mixed, "costs": costs, "error": err,
            "threads": torch.get_num_threads() if threads is None else threads}


def _mixed_step(engine: LLMEngine, b: int, s: int, length: int, vocab: int, g) -> float | None:
    """B prompts of S tokens prefilled and one decode step run, then a prompt of `length`
    tokens joins: the seconds of the step holding its prefill and the B decodes."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = len(engine.trace)
    for _ in range(b):
        engine.add_request(_ids(s, vocab, g), params)
    while not any(r["num_decode_tokens"] == b for r in engine.trace[first:]):
        engine.step()
    engine.add_request(_ids(length, vocab, g), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    row = engine.trace[-1]
    while engine.has_unfinished_requests():
        engine.step()
    ok = row["num_decode_tokens"] == b and row["num_prefill_tokens"] == length
    return _seconds(row) if ok else None


def costs_table(result: dict) -> str:
    """The fitted coefficients in ms and the fit's errors, one line each, for a notebook."""
    c: StepCosts = result["costs"]
    lines = [f"prefill: {1e3 * c.prefill_a:.2f} ms + {1e3 * c.prefill_b:.4f} ms/token + "
             f"{1e6 * c.prefill_c:.5f} us/token^2",
             f"decode:  {1e3 * c.decode_a:.2f} ms + {1e6 * c.decode_b:.3f} us/context token + "
             f"{1e3 * c.decode_c:.3f} ms/sequence"]
    for part in ("prefill", "decode", "mixed"):
        e = result["error"].get(part)
        if e:
            lines.append(f"{part:8s} fit error: mean {100 * e['mean']:.1f}%, max {100 * e['max']:.1f}%")
    return "\n".join(lines)
