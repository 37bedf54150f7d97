"""The SLO controller (seed 001's "when P95 latency exceeds the SLA, lower the max batch
tokens or shorten the queue timeouts"): a closed loop over the engine's own latencies.

    engine = LLMEngine(model, EngineConfig(slo_tpot_p95_ms=120, slo_ttft_p95_ms=2000))
    engine.controller.budget           # the scheduler's max_num_batched_tokens right now

What it reads. The engine hands every step's outputs to `observe`: a request's TTFT is a sample
at the step its first token lands, its TPOT one at the step it finishes (requests rejected by a
queue timeout are counted, `num_queue_timeouts`, never sampled: they have no first token, and
reading them as a slow TTFT would make the controller shorten the timeouts further, a loop that
feeds itself). Samples are stamped with the engine's clock (`engine.clock`, so a test drives a
fake one).

When it moves. `tick(now)` runs at the start of every `LLMEngine.step` and does nothing until
`interval_s` (EngineConfig.slo_interval_s) has passed since the last decision. Then it takes the
P95 of each metric over its window: the samples of the last `window_intervals` (3) intervals,
or, when those are fewer than `min_samples` (8), the newest `min_samples` of the last
`max_window_intervals` (10): a CPU server finishing under a request a second would otherwise
never gather enough to decide. No sample older than the last move counts (after a move the
next decision reads only what was measured under the new setting, so one slow burst is not
answered twice). A metric with fewer than `min_samples` samples moves nothing.

How it moves (T = the target; "calm" = P95 < `margin` x T, the hysteresis band is [margin x T, T]):
- the token budget (`scheduler.max_num_batched_tokens`, read by `Scheduler.schedule` every step)
  answers TPOT. Decode-first scheduling gives the running decodes their tokens first and the
  rest of the budget to prompt chunks, so a step's time, and every running request's gap
  between tokens, grows with the budget. TPOT P95 > T: budget x `down` (0.75), counted from
  the largest step since the last decision when that is smaller (lowering a budget no step
  reached changes nothing: with short prompts a 512 budget binds only once it is near 64, and
  steps of 0.75 from 512 would spend most of a load step getting there). TPOT calm for
  `up_after` (2) decisions in a row: budget x `up` (1.25). In the band: hold, so a P95 sitting
  between margin x T and T never flaps. Bounds: never below one decode step,
  max(max_num_seqs, 1 + num_speculative_tokens) (the floor EngineConfig enforces: below it
  running decodes are skipped and newer requests starve), never above the configured
  max_num_batched_tokens.
- TTFT wants the opposite budget: a larger one prefills the queue faster. The rule: with both
  over, TPOT wins (down); with TTFT P95 > T and TPOT within its target (calm or in the band, or
  no TPOT target) the budget goes up at once, without waiting for the calm streak. So without
  priority classes TTFT control means "give the budget back as soon as TPOT allows"; a
  TTFT-only controller keeps the budget at its maximum, the TTFT-friendliest setting. (A first
  version raised for TTFT only when TPOT was calm: measured on a 2-core CPU, TPOT then sat in the
  band at a budget of 28 while the queue, prefilled 28 tokens a step, grew to a 15 s TTFT. When
  both targets cannot hold, the budget now hovers at the edge between them instead.)
- with priority classes that bound their queue wait (`PriorityClass.max_queue_wait`), TTFT also
  moves those bounds: TTFT P95 > T: every bound x `down`; TTFT calm for `up_after` decisions:
  x `up`; within [configured / 4, configured]. Shorter bounds promote (or reject) a waiting
  request sooner, so the worst-waiting requests are served (or turned away) before their wait
  becomes the tail. The floor, a quarter of the configured bound: the operator's bound says how
  long the class may wait; the controller may tighten it, but not to the point where nearly
  every request of the class times out on arrival.

What it shows: `budget`, `min_budget`, `max_budget`, `queue_timeouts` ({priority: seconds}),
`num_adjustments` ({"down": n, "up": n}), `p95` and `targets` ({"ttft": s, "tpot": s}, None
when unknown / unset), and `timeline`, one dict per decision (t, budget, p95s, sample counts,
timeouts, action) for chapter 8's figure; the server exports them as minillm:slo_* metrics.

Left out on purpose: a model of the step cost (the loop is blind: it measures and moves, as
seed 001 describes), P99 or end-to-end targets, per-class targets, and moving `max_num_seqs`.
"""
import math
from collections import deque
from dataclasses import replace

from minillm.analysis.slo import percentile

MAX_TIMELINE = 10_000     # decisions kept (a day at 2 s is 43k: the oldest go first)


class SLOController:
    """Moves `scheduler.max_num_batched_tokens` (and the classes' queue bounds) towards the P95
    targets; see the module docstring for the rule."""

    def __init__(self, config, scheduler, *, window_intervals: int = 3, max_window_intervals: int = 10,
                 min_samples: int = 8, down: float = 0.75, up: float = 1.25, margin: float = 0.8,
                 up_after: int = 2):
        if config.scheduling == "static":
            raise ValueError("the SLO controller needs scheduling='continuous': a static batch "
                             "admits no one until it drains, so no budget changes its latency")
        if not (0 < down < 1 < up and 0 < margin < 1 and up_after >= 1 and min_samples >= 1
                and 1 <= window_intervals <= max_window_intervals):
            raise ValueError(f"need 0 < down < 1 < up, 0 < margin < 1, up_after >= 1, "
                             f"min_samples >= 1, 1 <= window_intervals <= max_window_intervals; got "
                             f"{down}, {up}, {margin}, {up_after}, {min_samples}, {window_intervals}, "
                             f"{max_window_intervals}")
        self.scheduler = scheduler
        self.down, self.up, self.margin, self.up_after = down, up, margin, up_after
        self.min_samples, self.interval_s = min_samples, config.slo_interval_s
        self.window_s = window_intervals * config.slo_interval_s
        self.max_window_s = max_window_intervals * config.slo_interval_s
        ms = lambda v: None if v is None else v / 1e3    # noqa: E731
        self.targets = {"ttft": ms(config.slo_ttft_p95_ms), "tpot": ms(config.slo_tpot_p95_ms)}
        self.max_budget = config.max_num_batched_tokens
        self.min_budget = max(config.max_num_seqs, 1 + config.num_speculative_tokens)
        self.budget = self.max_budget                       # the scheduler's, from now on
        self.classes = config.priority_classes              # as configured
        self.configured_timeouts = {c.priority: c.max_queue_wait for c in self.classes
                                    if c.max_queue_wait is not None}
        self.queue_timeouts = dict(self.configured_timeouts)
        self.num_adjustments = {"down": 0, "up": 0}
        self.num_queue_timeouts = 0
        self.p95 = {"ttft": None, "tpot": None}
        self.num_samples = {"ttft": 0, "tpot": 0}
        self.samples = {"ttft": deque(), "tpot": deque()}   # (time, seconds), oldest first
        self.timeline: deque[dict] = deque(maxlen=MAX_TIMELINE)
        self._calm = {"ttft": 0, "tpot": 0}                 # calm decisions in a row
        self._due: float | None = None                      # next decision (set by the first tick)
        self._since = -math.inf                             # time of the last move
        self._peak = 0                                      # largest step since the last decision

    @property
    def budget(self) -> int:
        """The token budget in force: the scheduler's `max_num_batched_tokens`, read each step."""
        return self.scheduler.max_num_batched_tokens

    @budget.setter
    def budget(self, value: int) -> None:
        self.scheduler.max_num_batched_tokens = value

    # ---- what the engine tells it ------------------------------------------------------------
    def observe(self, outputs, step: int, num_timed_out: int = 0, num_tokens: int = 0) -> None:
        """A step's RequestOutputs: TTFT of those whose first token came in `step`, TPOT of
        those that finished (not aborted); `num_timed_out` requests were rejected by a bound;
        the step ran `num_tokens` tokens."""
        self.num_queue_timeouts += num_timed_out
        self._peak = max(self._peak, num_tokens)
        for o in outputs:
            m = o.metrics
            if m.first_token_step == step and m.ttft is not None:
                self.record("ttft", m.first_token_time, m.ttft)
            if o.finished and o.finish_reason != "abort" and m.tpot is not None:
                self.record("tpot", m.finish_time, m.tpot)

    def record(self, metric: str, t: float, seconds: float) -> None:
        """One latency sample (seconds) measured at time t."""
        self.samples[metric].append((t, seconds))

    @property
    def priority_classes(self) -> tuple:
        """The configured classes with the bounds as they stand now (the engine applies these)."""
        return tuple(replace(c, max_queue_wait=self.queue_timeouts[c.priority])
                     if c.priority in self.queue_timeouts else c for c in self.classes)

    # ---- the loop ----------------------------------------------------------------------------
    def tick(self, now: float) -> dict | None:
        """Decide if a decision is due at `now` (cheap otherwise); returns its timeline row."""
        if self._due is None:
            self._due = now + self.interval_s
        if now < self._due:
            return None
        self._due = now + self.interval_s
        state = {}
        for metric, samples in self.samples.items():
            while samples and samples[0][0] <= now - self.max_window_s:
                samples.popleft()        # older than the longest window: gone for good
            fresh = [(t, v) for t, v in samples if t > self._since]
            vals = [v for t, v in fresh if t > now - self.window_s]
            if len(vals) < self.min_samples:        # too few: reach back for the newest ones
                vals = [v for _, v in fresh[-self.min_samples:]]
            self.num_samples[metric] = len(vals)
            self.p95[metric] = percentile(vals, 95) if vals else None
            state[metric] = self._state(metric, len(vals))
        action = self._move(state, now)
        row = {"t": now, "budget": self.budget, "p95_ttft": self.p95["ttft"],
               "p95_tpot": self.p95["tpot"], "n_ttft": self.num_samples["ttft"],
               "n_tpot": self.num_samples["tpot"], "queue_timeouts": dict(self.queue_timeouts),
               "action": action}
        self.timeline.append(row)
        return row

    def _state(self, metric: str, n: int) -> str:
        """"over", "calm", "band" (between margin x target and target), or "unknown" (no target
        or too few samples); counts calm decisions in a row."""
        target, p95 = self.targets[metric], self.p95[metric]
        if target is None or n < self.min_samples:
            state = "unknown"
        else:
            state = "over" if p95 > target else "calm" if p95 < self.margin * target else "band"
        self._calm[metric] = self._calm[metric] + 1 if state == "calm" else 0
        return state

    def _move(self, state: dict, now: float) -> str:
        """Apply the rule of the module docstring; returns what moved, e.g. "budget down"."""
        moved = []
        tpot_ok = state["tpot"] in ("calm", "band") or self.targets["tpot"] is None
        peak, self._peak = self._peak, 0
        if state["tpot"] == "over":
            used = min(self.budget, peak) if peak else self.budget
            new = max(self.min_budget, math.floor(used * self.down))
        elif (tpot_ok and state["ttft"] == "over") or self._calm["tpot"] >= self.up_after:
            new = min(self.max_budget, max(self.budget + 1, math.ceil(self.budget * self.up)))
        else:
            new = self.budget
        if new != self.budget:
            moved.append(("budget", "down" if new < self.budget else "up"))
            self.budget = new
        if self.configured_timeouts and state["ttft"] == "over":
            moved += self._scale_timeouts(self.down, "down")
        elif self.configured_timeouts and self._calm["ttft"] >= self.up_after:
            moved += self._scale_timeouts(self.up, "up")
        for _, direction in moved:
            self.num_adjustments[direction] += 1
        if moved:
            self._since = now
            self._calm = {"ttft": 0, "tpot": 0}   # the next streak starts under the new setting
        return ", ".join(f"{what} {d}" for what, d in moved) or "hold"

    def _scale_timeouts(self, factor: float, direction: str) -> list:
        """Every bounded class's wait x factor, within [configured / 4, configured]."""
        old = dict(self.queue_timeouts)
        for prio, top in self.configured_timeouts.items():
            self.queue_timeouts[prio] = min(top, max(top / 4, old[prio] * factor))
        return [("timeouts", direction)] if self.queue_timeouts != old else []
