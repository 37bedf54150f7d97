"""The P95 budget, offline and online: the rule the SLO controller and chapter 8's search share,
and the controller, a closed loop that moves the engine's token budget towards P95 targets.

    engine = LLMEngine(model, EngineConfig(slo_tpot_p95_ms=120, slo_ttft_p95_ms=2000))
    engine.controller.budget           # the scheduler's max_num_batched_tokens right now

The rule: `p95` of a list of latencies (linear between order statistics), `over_target` when it
exceeds its target; offline, `choose_budget` keeps the largest budget not over (lab/priority.py);
lab/slo_step.py reads runs with `rolling_p95`. Online, `observe` samples TTFT when a request's
first token lands and TPOT when it finishes; `tick(now)` decides every `interval_s` from the P95 of
a window of recent samples, none older than the last move. TPOT over its target lowers the budget
(x `down`), calm TPOT for `up_after` decisions raises it (x `up`), a band between `margin` x T and
T holds it; TTFT over target raises it as soon as TPOT allows and shortens the priority classes'
queue bounds (to a quarter at most). The budget stays within [one decode step, the configured
max_num_batched_tokens]; `timeline` keeps one row per decision (chapter 8's figure).
Left out on purpose: a model of the step cost (the loop only measures and moves), P99 or
end-to-end targets, per-class targets, and moving `max_num_seqs`.
"""
import math
from collections import deque
from dataclasses import replace

from minillm.analysis.slo import percentile

MAX_TIMELINE = 10_000     # decisions kept (a day at 2 s is 43k: the oldest go first)


def p95(values) -> float | None:
    """The 95th percentile of latencies (analysis/slo.py's, numpy's linear rule); None for none."""
    values = list(values)
    return percentile(values, 95) if values else None


def rolling_p95(points, t: float, window_s: float) -> float | None:
    """P95 of the (time, value) points measured in (t - window_s, t]; None without any."""
    return p95(v for at, v in points if t - window_s < at <= t)


def over_target(p95_s: float | None, target_s: float | None) -> bool:
    """Whether a P95 misses its target (False when either is unknown): the one test both the
    offline choice and the online loop apply."""
    return p95_s is not None and target_s is not None and p95_s > target_s


def choose_budget(p95_by_budget: dict, target_s: float) -> int | None:
    """Offline: the largest budget whose measured P95 is not over `target_s` (None if none)."""
    ok = [b for b, v in p95_by_budget.items() if not over_target(v, target_s)]
    return max(ok) if ok else None


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
            self.p95[metric] = p95(vals)
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
        target, value = self.targets[metric], self.p95[metric]
        if target is None or n < self.min_samples:
            state = "unknown"
        else:
            state = ("over" if over_target(value, target) else
                     "calm" if value < self.margin * target else "band")
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
