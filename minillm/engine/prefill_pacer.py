"""The prefill pacer: prompt chunks sized in time, not tokens, from the engine's own steps.

    engine = LLMEngine(model, EngineConfig(prefill_step_target_ms=500))
    engine.pacer.cap                   # the largest prompt chunk of the next step, in tokens

Why. A chunk of `long_prefill_token_threshold` tokens costs what this CPU makes of it: on a quiet
2-core CPU a 384-token chunk of SmolLM2-135M near its 8k context takes about a second, on the
same CPU at load 7 it took 7-18 s. A short request that arrives beside a long prompt waits for
the step in flight, then runs each of its steps beside another chunk, so its first token and
every later one wait for chunks; sized in tokens, those chunks cost seconds exactly when the
machine is loaded. Sized in time, a step that carries a chunk takes about the target whatever
the load, and the short request's latency is a few targets.

The rule. After every step that ran prompt tokens, the next chunk is at most
`prefill_tokens * target / step_seconds`: the tokens this machine prefilled in the target at the
speed it just showed (never below `floor`, one block, so a prompt always moves). A step costs
about F + p * c (a fixed part F: the weights read once, the decodes beside, Python; p per prompt
token, growing with the context), so the cap c' = c * T / (F + p * c) climbs or falls to the c
where the step takes T, without overshooting it (c' < c* exactly when c < c*), and follows p as
the context grows and the machine's load moves. The first cap, before any step was measured, is
the floor: a new engine does not bet a long first step on a guess (a few steps reach the target:
each multiplies the cap by T / step_seconds).

It moves chunk boundaries only, as the token budget already does: test_prefill_pacer.py checks
that ragged, timing-driven chunks give every request `generate`'s tokens.

Left out on purpose: a model of the step cost (the ratio is measured, never fitted), pacing the
decodes (a decode-only step is what it is), and waking a step early for a new request.
"""
import math


class PrefillPacer:
    """Sets `scheduler.prefill_chunk_cap` after each step (see the module docstring)."""

    def __init__(self, scheduler, target_ms: float, floor: int):
        """target_ms: EngineConfig.prefill_step_target_ms (checked there); floor: the smallest cap."""
        self.scheduler, self.target_s, self.floor = scheduler, target_ms / 1e3, floor
        self.cap = floor                     # the scheduler's, from now on

    @property
    def cap(self) -> int:
        return self.scheduler.prefill_chunk_cap

    @cap.setter
    def cap(self, value: int) -> None:
        self.scheduler.prefill_chunk_cap = value

    def observe(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step ran `num_prefill_tokens` prompt tokens (beside any decodes) in `seconds`."""
        if num_prefill_tokens < 1 or not seconds > 0:
            return                           # a decode-only step says nothing about chunks
        tokens = num_prefill_tokens * self.target_s / seconds
        ceiling = self.scheduler.max_num_batched_tokens      # a number, not infinity
        self.cap = max(self.floor, min(ceiling, math.floor(tokens)))
