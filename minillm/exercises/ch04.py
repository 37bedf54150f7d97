"""Chapter 4's exercises (continuous batching). Keys as numbered in the notebook:

- 04.1 (numeric): static batching's step count for section 1's workload in batches of 4, from
  lengths alone;
- 04.2 (numeric): the arrival rate (requests per step) at which the benchmark's workload (256
  requests), served with 8 slots instead of its 16, reaches an offered load of 1;
- 04.3 (code): an admission rule that turns the chapter's loop into static batching;
- 04.4 (numeric): the bytes a swap-out moves for one SmolLM2-135M sequence.

Every expected value is computed here, when the reader checks, by minillm's own engine and
formulas; none is written down. `serve_loop` is the checker's copy of the chapter's ~20-line
continuous-batching loop, so a reader's edits to their notebook copy cannot change the check.
"""
import math

import torch

from minillm.exercises import code, numeric

# section 1's workload (the Gantt chart's) and the serving benchmark's (section 3). The questions
# ask about settings the chapter does not run (batches of 4; the benchmark's workload on 8 slots),
# so the answers never appear in its outputs.
GANTT = dict(num_requests=24, seed=0, prompt_len=(8, 64), output_len=(4, 96))
STATIC_SEATS = 4
BENCH = dict(num_requests=256, seed=0, prompt_len=(8, 64), output_len=(4, 128))
BENCH_SEATS = 8


def _workload(spec: dict, rate: float = math.inf, vocab_size: int = 256):
    from minillm.lab.workloads import poisson_workload
    s = dict(spec)
    return poisson_workload(s.pop("num_requests"), rate, vocab_size, **s)


def _tiny():
    from minillm.model.loading import tiny_model
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@torch.inference_mode()
def serve_loop(model, work, max_num_seqs: int, admit) -> tuple[list[list[int]], int]:
    """The chapter's loop: each step, `admit(num_running, max_num_seqs)` requests join from the
    head of the queue, every running request gets one greedy token (its whole context recomputed,
    no cache), finished ones leave. Returns (tokens per request, steps)."""
    waiting, running = list(range(len(work))), []
    out, steps = {i: [] for i in waiting}, 0
    while waiting or running:
        k = admit(len(running), max_num_seqs)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise AssertionError(f"admit must return an int >= 0 (how many join), got {k!r}")
        if len(running) + min(k, len(waiting)) > max_num_seqs:
            raise AssertionError("admit let more than max_num_seqs requests run at once")
        running, waiting = running + waiting[:k], waiting[k:]
        if not running:
            raise AssertionError("admit left the batch empty while requests wait: the loop would stall")
        for i in running:
            logits = model(torch.tensor([work[i].prompt_token_ids + out[i]]))[0, -1]   # (V,)
            out[i].append(int(logits.argmax()))
        running = [i for i in running if len(out[i]) < work[i].max_tokens]
        steps += 1
    return [out[i] for i in range(len(work))], steps


def _static_steps() -> int:
    from minillm.lab.workloads import replay
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    eng = LLMEngine(_tiny(), EngineConfig(block_size=16, num_blocks=200, max_num_seqs=STATIC_SEATS,
                                          max_num_batched_tokens=512, scheduling="static"))
    replay(eng, _workload(GANTT), time_unit="steps")
    return len(eng.trace)


def _saturation_rate() -> float:
    work = _workload(BENCH)
    return BENCH_SEATS / (sum(w.max_tokens for w in work) / len(work))


def _swap_bytes() -> float:
    from minillm.analysis.kv_math import kv_bytes_per_token
    from minillm.model.config import get_config
    from minillm.paging.block_manager import BlockManager
    blocks = BlockManager(1, 16).blocks_needed(100)
    return blocks * 16 * kv_bytes_per_token(get_config("smollm2-135m"), "fp32")


def _test_static_rule(admit) -> None:
    if not callable(admit):
        raise AssertionError(f"pass your admission function, got {type(admit).__name__}")
    from minillm.lab.workloads import replay
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    model = _tiny()
    work = _workload(dict(num_requests=10, seed=3, prompt_len=(4, 24), output_len=(2, 24)))
    eng = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4,
                                        max_num_batched_tokens=256, scheduling="static"))
    want = [o.token_ids for o in replay(eng, work, time_unit="steps")]
    got, steps = serve_loop(model, work, 4, admit)
    if got != want:
        raise AssertionError("some request's tokens differ from the engine's")
    if steps != len(eng.trace):
        raise AssertionError(f"your loop took {steps} steps; static batching takes a different number")


numeric("04.1", "Static batching, max_num_seqs=4, section 1's 24 requests: how many engine steps? "
        "Work it out from the output lengths alone.", _static_steps, rtol=0, atol=0.5,
        hint="recount batch by batch: what decides how long one batch of 4 holds the engine?")
numeric("04.2", "The serving benchmark's workload (256 requests, outputs of 4 to 128 tokens) served "
        "with max_num_seqs=8: at what arrival rate (requests per engine step) is the offered load 1?",
        _saturation_rate, rtol=0.01,
        hint="recompute the capacity from this workload's own output lengths and its 8 slots")
code("04.3", "Write admit(num_running, max_num_seqs) -> int so that the chapter's loop does static "
     "batching: same tokens and same step count as LLMEngine(scheduling='static').",
     _test_static_rule, hint="a new batch forms only when the previous one has completely left")
numeric("04.4", "Swap preemption: how many bytes move to CPU when one SmolLM2-135M sequence of 100 "
        "computed tokens is swapped out (fp32 KV, block_size=16, whole blocks move)?", _swap_bytes,
        rtol=0.001, hint="whole blocks move: recount the slots the sequence's blocks hold, not its "
        "tokens, and the bytes of one token's K and V in every layer (chapter 2)")
