"""The prefill pacer: prompt chunks sized in time, not tokens, from the engine's own steps.

    engine = LLMEngine(model, EngineConfig(prefill_step_target_ms=500))
    engine.pacer.cap                   # the largest prompt chunk of the next step, in tokens

After every step that ran prompt tokens, the next chunk is at most
`prefill_tokens * target / step_seconds`: what this machine prefilled in the target time at the
speed it just showed, never below `floor` (one block, so a prompt always moves); the first cap is
the floor. A step costs about F + p * c, so the cap settles on the chunk whose step takes the
target, without overshooting, and follows the context and the load. It moves chunk boundaries
only: every request still gets `generate`'s tokens.

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
