"""Choosing K while decoding: seed article 001's windowed rule, as a policy the batch-1 loop uses.

A policy has a current `k` (the number of drafts to ask for next) and `update(num_accepted,
num_proposed)`, called after every verify step that tested at least one draft. The same interface
as `spec_theory.FixedK`, `HeuristicK` and `AdaptiveK`, so any of them can be passed to
`speculative_generate(..., adaptive_k=policy)`.

`WindowedK` is the rule of seed article 001: over the last `window` verify steps, if the fraction
of drafted tokens that were accepted is above `raise_above`, K grows by one; if it is below
`lower_below`, K shrinks by one (never outside [k_min, k_max]). The fraction is accepted/drafted,
the measured `accepted_fraction`, not the per-token estimate alpha.

Left out on purpose: per-request policies in the engine (its K is fixed per engine).
"""
from collections import deque


class WindowedK:
    """K += 1 when accepted/drafted over the last `window` steps > raise_above, K -= 1 when it is
    < lower_below; the window restarts after each change so one change is judged on fresh steps."""

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 16, window: int = 10,
                 raise_above: float = 0.8, lower_below: float = 0.5):
        for name, v in (("k", k), ("k_min", k_min), ("k_max", k_max), ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 1 <= k_min <= k <= k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got k_min={k_min}, k={k}, k_max={k_max}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0 <= lower_below <= raise_above <= 1:
            raise ValueError(f"need 0 <= lower_below <= raise_above <= 1, got {lower_below}, {raise_above}")
        self.k, self.k_min, self.k_max, self.window = k, k_min, k_max, window
        self.raise_above, self.lower_below = raise_above, lower_below
        self._steps: deque[tuple[int, int]] = deque(maxlen=window)     # (accepted, drafted)

    def update(self, num_accepted: int, num_proposed: int) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if num_proposed == 0:
            return                                      # nothing was tested: no evidence
        self._steps.append((num_accepted, num_proposed))
        if len(self._steps) < self.window:
            return
        rate = sum(a for a, _ in self._steps) / sum(d for _, d in self._steps)
        new = self.k + 1 if rate > self.raise_above else self.k - 1 if rate < self.lower_below else self.k
        new = min(self.k_max, max(self.k_min, new))
        if new != self.k:
            self.k = new
            self._steps.clear()
