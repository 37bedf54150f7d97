"""The engine's sampler: a step's logits -> the tokens each sequence gains, plain or speculative.

Letters: R logits rows this step, K draft tokens of one sequence, V vocab.

After the forward pass every sampling sequence owns one logits row, or K + 1 rows when it
drafted K tokens (its last token and each draft). `Sampler.sample` reads them, row by row:
- a plain row: the argmax (temperature 0; all such rows in one call) or one draw from
  `logits_to_probs` (temperature, top-k, top-p);
- K + 1 rows: `greedy_verify` (temperature 0) or `rejection_sample` (the exact rule) keep n
  drafts and one more token.
It only computes: each row gives a `Sampled` record, and `LLMEngine.update_from_output` applies
them (appends tokens, rolls rejected drafts back, writes metrics). Nothing here changes a
sequence, a block or a metric.

One seed rule for every draw (`generator_for`): a request with a `seed` draws its k-th output
token from a generator seeded with hash((seed, completion index, k)), so its output does not
depend on the batch, on chunking or on preemption (a resumed sequence draws token k afresh). The
verify step that produces token k uses that same generator; the drafter proposing from token k
uses the rule at k + DRAFT_OFFSET, a stream of its own. Unseeded requests share the engine's
generator (`EngineConfig.seed`), never the global RNG.

Left out on purpose: logprobs, penalties (repetition, presence, frequency), one batched top-k /
top-p over rows with different parameters (rows with temperature > 0 are drawn one at a time).
"""
from dataclasses import dataclass

import torch

from minillm.engine.sequence import SamplingParams, Sequence
from minillm.model.sampling import logits_to_probs, sample
from minillm.spec.rejection import greedy_verify, rejection_sample

DRAFT_OFFSET = 10**6     # the drafter of token k draws from the seed rule at k + DRAFT_OFFSET


def request_generator_seed(seed: int, index: int, k: int) -> int:
    """Seed of the generator that draws token k of completion `index` of a seeded request."""
    return hash((seed, index, k)) & (2**63 - 1)


@dataclass
class SampleRow:
    """One draw this step: for which sequence, from which logits row. A plain record.

    `index` is the completion the token is for. It is `seq.index`, except for a request with
    n > 1 whose prompt just finished: its n first tokens all come from the prompt's last row, and
    rows with index 1..n-1 are for the completions the engine forks when it applies them."""

    seq: Sequence
    index: int
    row: int                       # first logits row (K + 1 rows when seq has K drafts)

    @property
    def num_drafts(self) -> int:
        return len(self.seq.draft_token_ids) if self.index == self.seq.index else 0


@dataclass
class Sampled:
    """What one row gives: the tokens to append, and how many drafts they verified."""

    token_ids: list[int]           # 1 token, or 1..K+1 after verifying K drafts; [] on error
    num_drafts: int = 0            # K (0 for a plain row)
    error: str | None = None       # why no token could be drawn (say, non-finite logits)

    @property
    def num_accepted(self) -> int:
        """Drafts kept: every token but the last, which the target drew itself."""
        return len(self.token_ids) - 1 if self.num_drafts and self.token_ids else 0

    @property
    def num_rejected(self) -> int:
        """Drafts whose KV was written but is void: K - num_accepted."""
        return self.num_drafts - self.num_accepted


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)   # unseeded requests

    def generator_for(self, params: SamplingParams, index: int, k: int) -> torch.Generator:
        """The seed rule: the generator that draws token k of completion `index`."""
        if params.seed is None:
            return self.generator
        g = torch.Generator(device=self.device)
        return g.manual_seed(request_generator_seed(params.seed, index, k))

    def draft_generator(self, seq: Sequence) -> torch.Generator:
        """The generator a drafter uses to propose after `seq`'s tokens."""
        return self.generator_for(seq.params, seq.index, len(seq.output_token_ids) + DRAFT_OFFSET)

    @torch.inference_mode()
    def sample(self, rows: list[SampleRow], logits: torch.Tensor | None) -> list[Sampled]:
        """logits (R, V) -> one `Sampled` per row, in order. Rows with drafts are verified first,
        in order, then the plain rows are drawn, in order (the order in which unseeded rows use
        the shared generator). A row that cannot be drawn gives an `error` instead of raising,
        so one broken request never stops the others."""
        out: list[Sampled | None] = [None] * len(rows)
        plain = []
        for i, r in enumerate(rows):
            if r.num_drafts:
                out[i] = self._verify(r, logits[r.row:r.row + r.num_drafts + 1])      # (K+1, V)
            else:
                plain.append(i)
        if plain:
            for i, s in zip(plain, self._draw([rows[i] for i in plain], logits)):
                out[i] = s
        return out

    def _draw(self, rows: list[SampleRow], logits: torch.Tensor) -> list[Sampled]:
        """One token per plain row; greedy rows in one argmax."""
        idx = [r.row for r in rows]
        if idx != list(range(len(logits))):      # forks share a row; drafting rows are not ours
            logits = logits[idx]                                                  # (R', V)
        tokens = logits.argmax(dim=-1).tolist()                                   # (R',)
        out = []
        for i, r in enumerate(rows):
            p = r.seq.params
            if p.temperature == 0:
                out.append(Sampled([tokens[i]]))
                continue
            gen = self.generator_for(p, r.index, len(r.seq.output_token_ids))
            try:
                probs = logits_to_probs(logits[i:i + 1].float(), temperature=p.temperature,
                                        top_k=p.top_k, top_p=p.top_p)            # (1, V)
                out.append(Sampled([int(sample(probs, generator=gen)[0])]))
            except (ValueError, RuntimeError) as e:
                out.append(Sampled([], error=f"{type(e).__name__}: {e}"))
        return out

    def _verify(self, r: SampleRow, logits: torch.Tensor) -> Sampled:
        """logits (K+1, V) at the last token and the K drafts -> the tokens to append (1..K+1)."""
        seq, k, p = r.seq, r.num_drafts, r.seq.params
        try:
            drafts = torch.tensor([seq.draft_token_ids], device=logits.device)      # (1, K)
            if p.temperature == 0:
                toks, acc = greedy_verify(logits[None], drafts)
            else:
                target = logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p)  # (1, K+1, V)
                q = seq.draft_probs.to(target.dtype) if seq.draft_probs is not None else None
                gen = self.generator_for(p, r.index, len(seq.output_token_ids))
                toks, acc = rejection_sample(target, q, drafts, generator=gen)
            n = int(acc[0])
            return Sampled(toks[0, :n + 1].tolist(), k)
        except (ValueError, RuntimeError) as e:
            return Sampled([], k, error=f"{type(e).__name__}: {e}")
