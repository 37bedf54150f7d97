"""Chapter 11: what one engine step costs, as DistServe's simulator models it, fitted by least squares.

Letters: L prompt (or chunk) tokens, S tokens already cached, B sequences in a decode step.

    prefill step of prompts L_1..L_n:  a_p + b_p * sum(L_i) + c_p * sum(L_i * (S_i + L_i))
    decode step of B sequences:        a_d + b_d * sum(context_i) + c_d * B

a: the fixed cost of any step; b_p: per prompt token; c_p: attention's quadratic term (a chunk
after S cached tokens pays L * (S + L); S = 0 is DistServe's L ** 2); b_d: per context token
read; c_d: per sequence.
`fit_step_costs` fits the six numbers (`torch.linalg.lstsq` in float64; a negative coefficient is
dropped and the rest refitted) and `StepCosts` predicts; a mixed step costs both parts plus one
fixed cost, the larger of a_p and a_d (`step_seconds`).

Left out on purpose: DistServe's separate fits for small and large decode batches, and anything
that depends on which tokens (not how many) a step holds.
"""
from dataclasses import dataclass

import torch

from minillm._validate import check_int, check_real


def _ints(name: str, values, low: int) -> list[int]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v, low) for i, v in enumerate(values)]


@dataclass(frozen=True)
class StepCosts:
    """Seconds of an engine step (see the module docstring for the terms)."""

    prefill_a: float        # s per prefill step
    prefill_b: float        # s per prompt token
    prefill_c: float        # s per token * key (L * (S + L))
    decode_a: float         # s per decode step
    decode_b: float         # s per context token read
    decode_c: float         # s per sequence

    def __post_init__(self):
        for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
            check_real(f"StepCosts.{name}", getattr(self, name), 0)

    def prefill_seconds(self, lengths, cached=None) -> float:
        """One step prefilling chunks of `lengths` tokens (after `cached` tokens each; default 0)."""
        lengths = _ints("lengths", lengths, 1)
        cached = [0] * len(lengths) if cached is None else _ints("cached", cached, 0)
        if not lengths or len(cached) != len(lengths):
            raise ValueError(f"lengths must be non-empty and cached as long ({len(lengths)}), "
                             f"got {len(cached)}")
        return self.prefill_a + self._prefill_terms(lengths, cached)

    def decode_seconds(self, contexts) -> float:
        """One decode step of len(contexts) sequences holding `contexts` tokens each."""
        contexts = _ints("contexts", contexts, 0)
        if not contexts:
            raise ValueError("contexts must name at least one sequence")
        return self.decode_a + self._decode_terms(contexts)

    def step_seconds(self, chunks=(), contexts=()) -> float:
        """A step of prefill `chunks` [(L, S), ...] and decodes at `contexts`: both parts plus one
        fixed cost, max(prefill_a, decode_a); 0 for an empty step."""
        chunks, contexts = list(chunks), _ints("contexts", contexts, 0)
        lengths = _ints("chunk lengths", [c[0] for c in chunks], 1)
        cached = _ints("chunk cached", [c[1] for c in chunks], 0)
        return self.mixed_seconds(sum(lengths), sum(n * (s + n) for n, s in zip(lengths, cached)),
                                  len(contexts), sum(contexts))

    def mixed_seconds(self, prefill_tokens: int, prefill_keys: int, num_decodes: int,
                      context_sum: int) -> float:
        """`step_seconds` from sums alone: prefill tokens, sum of L * (S + L) over the chunks,
        decoding sequences and their contexts' sum (the simulator keeps these as running sums)."""
        if not prefill_tokens and not num_decodes:
            return 0.0
        a = max(self.prefill_a if prefill_tokens else 0.0, self.decode_a if num_decodes else 0.0)
        return (a + self.prefill_b * prefill_tokens + self.prefill_c * prefill_keys
                + self.decode_b * context_sum + self.decode_c * num_decodes)

    def _prefill_terms(self, lengths, cached) -> float:
        return self.prefill_b * sum(lengths) + self.prefill_c * sum(
            n * (s + n) for n, s in zip(lengths, cached))

    def _decode_terms(self, contexts) -> float:
        return self.decode_b * sum(contexts) + self.decode_c * len(contexts)

    def scaled(self, factor: float) -> "StepCosts":
        """Every term times `factor` (e.g. a slower machine)."""
        check_real("factor", factor, 0, low_open=True)
        return StepCosts(*(factor * v for v in (self.prefill_a, self.prefill_b, self.prefill_c,
                                                 self.decode_a, self.decode_b, self.decode_c)))


def nonneg_lstsq(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Least squares x @ w ~ y with w >= 0: fit, drop the columns whose weight came out negative,
    refit the rest (an active set, enough for three columns). x: (n, k), y: (n,) -> k floats."""
    x, y = x.double(), y.double()
    scale = x.abs().amax(dim=0).clamp(min=1e-300)        # columns of ~1 for a well-posed solve
    keep = list(range(x.shape[1]))
    while keep:
        w = torch.linalg.lstsq(x[:, keep] / scale[keep], y.unsqueeze(1)).solution.squeeze(1)
        w = w / scale[keep]
        if (w >= 0).all():
            out = [0.0] * x.shape[1]
            for i, v in zip(keep, w.tolist()):
                out[i] = v
            return out
        keep = [i for i, v in zip(keep, w.tolist()) if v >= 0]
    return [0.0] * x.shape[1]


def _samples(name: str, samples, low: int) -> list[tuple[list[int], float]]:
    out = []
    for i, item in enumerate(samples):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{name}[{i}] must be a pair (token counts, seconds), got {item!r}")
        counts = _ints(f"{name}[{i}][0]", item[0], low)
        if not counts:
            raise ValueError(f"{name}[{i}][0] must name at least one sequence")
        out.append((counts, check_real(f"{name}[{i}][1]", item[1], 0)))
    if len(out) < 3:
        raise ValueError(f"{name} needs at least 3 samples (three unknowns), got {len(out)}")
    return out


def fit_step_costs(prefill_samples, decode_samples) -> StepCosts:
    """StepCosts from timed steps: prefill_samples [(prompt lengths of the step, seconds), ...],
    decode_samples [(contexts of the step's sequences, seconds), ...]; at least 3 of each, and
    varied enough to tell the terms apart (else the fit is not unique and lstsq picks one)."""
    pre = _samples("prefill_samples", prefill_samples, 1)
    dec = _samples("decode_samples", decode_samples, 0)
    # rows (1, sum L, sum L^2) and (1, sum context, B)
    xp = torch.tensor([[1.0, sum(ls), sum(n * n for n in ls)] for ls, _ in pre], dtype=torch.float64)
    xd = torch.tensor([[1.0, sum(cs), len(cs)] for cs, _ in dec], dtype=torch.float64)
    wp = nonneg_lstsq(xp, torch.tensor([s for _, s in pre], dtype=torch.float64))
    wd = nonneg_lstsq(xd, torch.tensor([s for _, s in dec], dtype=torch.float64))
    return StepCosts(*wp, *wd)


def fit_error(costs: StepCosts, prefill_samples=(), decode_samples=()) -> dict:
    """How far the fit is from the samples: {"prefill", "decode"} -> mean and max |relative
    error| (None where no samples were given)."""
    def stats(errors):
        return None if not errors else {"mean": sum(errors) / len(errors), "max": max(errors)}
    pe = [abs(costs.prefill_seconds(ls) - s) / s for ls, s in prefill_samples if s > 0]
    de = [abs(costs.decode_seconds(cs) - s) / s for cs, s in decode_samples if s > 0]
    return {"prefill": stats(pe), "decode": stats(de)}
