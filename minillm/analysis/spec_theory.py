"""When does speculation pay? Expected tokens per verify step, speedup, best K, adaptive K.

Letters: K draft tokens per step, V vocab. Each draft token is accepted independently with
probability a, so a step yields

    E[tokens per step] = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)
    speedup = E[tokens per step] / (K c + verify_cost)

with c the cost of a draft forward over one target forward and `verify_cost` the cost of the
(K+1)-token target forward over a one-token one (1 when memory bound). `article_*` keep two seed
articles' formulas as printed, so the chapter can test them against a simulation. Pure formulas:
this module imports no other part of minillm; `SpecStats.alpha_estimate` is
`estimate_acceptance`, and the exact law of one step is `minillm.spec.exact_law`.

Left out on purpose: acceptance that depends on the position in the draft, tree drafts, batch
effects on cost (at large batch the target is no longer memory bound and c, verify_cost change).
"""
import torch


def _check_a_k_c(a: float, k: int, c: float = 0.0) -> None:
    if not 0 <= a <= 1:
        raise ValueError(f"a (acceptance rate) must be in [0, 1], got {a!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"K must be an int >= 0, got {k!r}")
    if c < 0:
        raise ValueError(f"c (draft/target cost ratio) must be >= 0, got {c!r}")


def expected_tokens_per_step(a: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a): mean tokens emitted per verify step (K + 1 when a = 1)."""
    _check_a_k_c(a, k)
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit of time relative to plain decoding (1 token per target forward)."""
    _check_a_k_c(a, k, c)
    return expected_tokens_per_step(a, k) / (k * c + verify_cost)


def speedup_with_prefill(num_tokens: int, step_speedup: float, prefill_cost: float,
                         draft_prefill_cost: float = 0.0) -> float:
    """Whole-request speedup when both runs also pay a prefill. Costs in one-token target forwards:
    plain = prefill + num_tokens; speculative = prefill + draft prefill + num_tokens / step_speedup.
    A draft model must read the prompt too, which a short generation does not amortize."""
    if num_tokens < 1 or step_speedup <= 0 or prefill_cost < 0 or draft_prefill_cost < 0:
        raise ValueError(f"need num_tokens >= 1, step_speedup > 0 and prefill costs >= 0, got "
                         f"{num_tokens}, {step_speedup}, {prefill_cost}, {draft_prefill_cost}")
    return (prefill_cost + num_tokens) / (prefill_cost + draft_prefill_cost + num_tokens / step_speedup)


def free_verify_costs(num_tokens: int, num_steps: int, prefill_cost: float = 0.0) -> tuple[float, float]:
    """(plain, speculative) cost in one-token target forwards if every verify cost one decode step
    and drafting were free: plain = prefill + num_tokens - 1 one-token steps (the prefill yields
    the first token), speculative = prefill + num_steps. Their ratio is the ceiling of a schedule."""
    return prefill_cost + num_tokens - 1, prefill_cost + num_steps


def best_k(a: float, c: float, k_max: int = 16, verify_cost: float = 1.0) -> int:
    """The K in 0..k_max with the largest expected speedup (0 means: do not speculate)."""
    return max(range(k_max + 1), key=lambda k: expected_speedup(a, k, c, verify_cost) - 1e-12 * k)


def estimate_acceptance(num_accepted, num_proposed) -> float:
    """Per-token acceptance rate a from per-step counts (maximum likelihood under the model above).

    A step with n accepted out of k proposed tested n + 1 tokens if n < k (the last one failed)
    and k tokens if n == k, so a = sum(n) / sum(n + [n < k]).
    """
    n = torch.as_tensor(num_accepted, dtype=torch.float64)
    k = torch.as_tensor(num_proposed, dtype=torch.float64)
    tested = (n + (n < k).double()).sum()
    return float(n.sum() / tested) if tested > 0 else float("nan")


def accepted_law(a: float, k: int) -> torch.Tensor:
    """The law the formula assumes for n, the drafts accepted in one step of K: truncated
    geometric, P(n) = a^n (1 - a) for n < K and P(K) = a^K. Shape (K + 1,), float64."""
    _check_a_k_c(a, k)
    n = torch.arange(k + 1, dtype=torch.float64)
    law = a ** n * (1 - a)
    law[k] = a ** k
    return law


def simulate_speculation(a: float, k: int, c: float, steps: int = 100_000,
                         generator: torch.Generator | None = None, verify_cost: float = 1.0) -> float:
    """Monte Carlo of the same model: the speedup measured on `steps` simulated verify steps."""
    _check_a_k_c(a, k, c)
    coins = torch.rand(steps, k, generator=generator, dtype=torch.float64) < a       # (steps, K)
    n = coins.long().cumprod(dim=1).sum(dim=1) if k else torch.zeros(steps)
    return float((n + 1).sum()) / (steps * (k * c + verify_cost))


# ---- the two printed claims from the seed articles, kept as printed -------------------------

def article_speedup_printed(a: float, k: int, speed_ratio: float) -> float:
    """Seed article 000: E[speedup] = (1 - a^(K+1)) / (1 - a) * s / (1 + s K), s = draft speed ratio."""
    return expected_tokens_per_step(a, k) * speed_ratio / (1 + speed_ratio * k)


def speedup_from_speed_ratio(a: float, k: int, speed_ratio: float) -> float:
    """The corrected factor s / (s + K): identical to expected_speedup(a, K, c = 1 / s)."""
    return expected_tokens_per_step(a, k) * speed_ratio / (speed_ratio + k)


def article_break_even_printed(a: float, k: int, t_draft: float, t_target: float) -> bool:
    """Seed article 003: speculation pays when a K T_L > K T_S + T_L."""
    return a * k * t_target > k * t_draft + t_target


def break_even(a: float, k: int, t_draft: float, t_target: float) -> bool:
    """Speculation pays when the target time for the same tokens exceeds one step's time:
    E[tokens] T_L > K T_S + T_L (both sides count the bonus token)."""
    return expected_tokens_per_step(a, k) * t_target > k * t_draft + t_target


# ---- choosing K while decoding --------------------------------------------------------------

class FixedK:
    """The same K every step."""

    def __init__(self, k: int):
        self.k = k

    def update(self, num_accepted: int, num_proposed: int) -> None:
        pass


class HeuristicK:
    """transformers' "heuristic" schedule: K += 2 after a fully accepted step, else K -= 1 (>= 1)."""

    def __init__(self, k: int = 5):
        self.k = k

    def update(self, num_accepted: int, num_proposed: int) -> None:
        self.k = self.k + 2 if num_accepted == num_proposed else max(1, self.k - 1)


class AdaptiveK:
    """Pick K = best_k(a_hat, c) from a running (exponentially decayed) estimate of a."""

    def __init__(self, c: float, k_max: int = 16, decay: float = 0.9, a_prior: float = 0.5,
                 verify_cost: float = 1.0):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.c, self.k_max, self.decay, self.verify_cost = c, k_max, decay, verify_cost
        self.accepted, self.tested = a_prior, 1.0        # one pseudo-observation of the prior
        self.k = max(1, best_k(a_prior, c, k_max, verify_cost))

    @property
    def a_hat(self) -> float:
        return self.accepted / self.tested

    def update(self, num_accepted: int, num_proposed: int) -> None:
        tested = num_accepted + (num_accepted < num_proposed)
        self.accepted = self.decay * self.accepted + num_accepted
        self.tested = self.decay * self.tested + tested
        # K >= 1 so a step still measures a (K = 0 would never learn that a went back up)
        self.k = max(1, best_k(min(self.a_hat, 1.0), self.c, self.k_max, self.verify_cost))


def simulate_policy(policy, acceptance: list[float], c: float,
                    generator: torch.Generator | None = None, verify_cost: float = 1.0,
                    history: list | None = None) -> float:
    """Run a K policy over a sequence of per-step acceptance rates; return the speedup.
    The K used at each step is appended to `history` when one is given."""
    tokens = cost = 0.0
    for a in acceptance:
        k = policy.k
        if history is not None:
            history.append(k)
        coins = torch.rand(k, generator=generator, dtype=torch.float64) < a
        n = int(coins.long().cumprod(0).sum())
        tokens, cost = tokens + n + 1, cost + k * c + verify_cost
        policy.update(n, k)
    return tokens / cost
