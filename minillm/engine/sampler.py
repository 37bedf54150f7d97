"""The engine's sampler: a step's logits -> the tokens each sequence gains, plain or speculative.

Letters: R logits rows this step, K draft tokens of one sequence, V vocab.

Each sampling sequence owns one row, or K + 1 when it drafted K. `Sampler.sample` processes a
request's rows first when it asks for it (logits_process.py), then takes the argmax or one draw
from `logits_to_probs` for a plain row, `greedy_verify` or the exact `rejection_sample` for K + 1
rows, and `tree_accept` (spec/tree_rejection.py) for a token tree. Logprobs follow vLLM's
`logprobs_mode`: the model's own rows by default ("raw_logprobs"), or the law each token was drawn
from ("processed_logprobs"), or the logits of either; prompt logprobs are the model's rows. It
only computes: each row gives a `Sampled` record, and `update_from_output` applies them.
One seed rule (`generator_for`): a seeded request draws its k-th token from a generator seeded
with hash((seed, completion index, k)), so its output does not depend on batching, chunking or
preemption; drafters use k + DRAFT_OFFSET; unseeded requests share the engine's generator.

Left out on purpose: one batched top-k / top-p over rows with different parameters, and batched
logits processors.
"""
from dataclasses import dataclass

import torch

from minillm.engine.logits_process import mode_values, process_logits, token_logprobs
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Logprob, Sequence
from minillm.model.sampling import logits_to_probs, sample
from minillm.spec.rejection import greedy_verify, rejection_sample
from minillm.spec.tree import TreeDraft
from minillm.spec.tree_rejection import tree_accept

DRAFT_OFFSET = 10**6     # the drafter of token k draws from the seed rule at k + DRAFT_OFFSET


def logprobs_k(params: SamplingParams) -> int | None:
    """How many top logprobs a request's tokens need: None (none computed), 0 (the token's own:
    best_of ranks completions by it) or its `logprobs`."""
    if params.logprobs is not None:
        return params.logprobs
    return 0 if (params.best_of or params.n) > params.n else None


def probs_for(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(..., V) processed logits -> the law a token is drawn from (`logits_to_probs`)."""
    if p.min_p:
        return logits_to_probs(logits, p.temperature, p.top_k, p.top_p, min_p=p.min_p)
    return logits_to_probs(logits, p.temperature, p.top_k, p.top_p)


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
    logprobs: list[dict[int, Logprob]] | None = None   # one per token, when the request asks
    path: list[int] | None = None  # a token tree's kept nodes, root (0) first; None: a chain

    @property
    def num_accepted(self) -> int:
        """Drafts kept: every token but the last, which the target drew itself."""
        return len(self.token_ids) - 1 if self.num_drafts and self.token_ids else 0

    @property
    def num_rejected(self) -> int:
        """Drafts whose KV was written but is void: K - num_accepted."""
        return self.num_drafts - self.num_accepted


class Sampler:
    def __init__(self, device, seed: int = 0, logprobs_mode: str = "raw_logprobs"):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)   # unseeded requests
        self.logprobs_mode = logprobs_mode      # LOGPROBS_MODES (logits_process.py)

    def _logprobs(self, k, tokens, raw, processed, p: SamplingParams, law=None):
        """The tokens' logprob entries (None when k is None) from raw (T, V), the model's rows,
        processed (T, V), the rows after the processors, and `law` (T, V), what they were drawn
        from (None: greedy)."""
        if k is None:
            return None
        values = mode_values(self.logprobs_mode, raw, processed, law, p.temperature)  # (T, V)
        return token_logprobs(values, tokens, k, order=raw)

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

    def prompt_logprobs(self, prompt_rows, logits: torch.Tensor | None) -> list[tuple]:
        """The runner's prompt rows (the last rows of logits, `model_runner.prompt_rows`) ->
        one (seq, first prompt token index, [{id: Logprob}] per token) per record."""
        total = sum(r.count for r in prompt_rows)
        if not total:
            return []
        logp = logits[len(logits) - total:].float()                              # (sum count, V)
        if not self.logprobs_mode.endswith("logits"):
            logp = torch.log_softmax(logp, dim=-1)
        out, at = [], 0
        for r in prompt_rows:
            toks = r.seq.prompt_token_ids[r.first:r.first + r.count]
            out.append((r.seq, r.first, token_logprobs(logp[at:at + r.count], toks,
                                                       r.seq.params.prompt_logprobs)))
            at += r.count
        return out

    def _draw(self, rows: list[SampleRow], logits: torch.Tensor) -> list[Sampled]:
        """One token per plain row; greedy rows in one argmax."""
        idx = [r.row for r in rows]
        if idx != list(range(len(logits))):      # forks share a row; drafting rows are not ours
            logits = logits[idx]                                                  # (R', V)
        errors, raw = {}, logits
        processed = [i for i, r in enumerate(rows) if r.seq.needs_processing]
        if processed:
            logits = logits.clone()              # the runner's logits stay as the model gave them
            for i in processed:
                try:
                    logits[i] = process_logits(logits[i:i + 1], rows[i].seq)[0]
                    if not torch.isfinite(logits[i]).any():
                        raise ValueError("the logits processors and the grammar allow no token")
                except (ValueError, RuntimeError) as e:
                    errors[i] = f"{type(e).__name__}: {e}"
        tokens = logits.argmax(dim=-1).tolist()                                   # (R',)
        out = []
        for i, r in enumerate(rows):
            p, k = r.seq.params, logprobs_k(r.seq.params)
            if i in errors:
                out.append(Sampled([], error=errors[i]))
            elif p.temperature == 0:
                lps = None if k is None else self._logprobs(k, tokens[i:i + 1], raw[i:i + 1],
                                                            logits[i:i + 1], p)
                out.append(Sampled([tokens[i]], logprobs=lps))
            else:
                out.append(self._draw_one(r, logits[i:i + 1], k,
                                          None if k is None else raw[i:i + 1]))   # no op unused
        return out

    def _draw_one(self, r: SampleRow, logits: torch.Tensor, k: int | None, raw) -> Sampled:
        """One token from one processed (1, V) row (`raw`: the model's): the argmax at T=0, or a draw."""
        p = r.seq.params
        try:
            if p.temperature == 0:
                toks, law = [int(logits[0].argmax())], None
            else:
                gen = self.generator_for(p, r.index, len(r.seq.output_token_ids))
                law = probs_for(logits.float(), p)                                # (1, V)
                toks = [int(sample(law, generator=gen)[0])]
            return Sampled(toks, logprobs=self._logprobs(k, toks, raw, logits, p, law))
        except (ValueError, RuntimeError) as e:
            return Sampled([], error=f"{type(e).__name__}: {e}")

    def _verify(self, r: SampleRow, logits: torch.Tensor) -> Sampled:
        """logits (K+1, V) at the last token and the K drafts -> the tokens to append (1..K+1)."""
        seq, k, p, lk = r.seq, r.num_drafts, r.seq.params, logprobs_k(r.seq.params)
        if seq.draft_parents is not None:
            return self._verify_tree(r, logits)
        raw = logits                                            # (K+1, V) as the model gave them
        try:
            ids = list(seq.draft_token_ids)
            if seq.needs_processing:
                logits = process_logits(logits, seq, ids)       # row j as after drafts[:j]
                ok = torch.isfinite(logits).any(-1).tolist()    # (K+1,)
                if not ok[0]:
                    raise ValueError("the logits processors and the grammar allow no token")
                if not all(ok):       # verify only the drafts before a row that allows nothing
                    ids = ids[:ok.index(False) - 1]
                    logits = logits[:len(ids) + 1]
                if not ids:           # not even the first draft: one token from row 0
                    s = self._draw_one(r, logits[:1], lk, raw[:1])
                    s.num_drafts = k
                    return s
            drafts = torch.tensor([ids], device=logits.device)                       # (1, K)
            if p.temperature == 0:
                toks, acc = greedy_verify(logits[None], drafts)
                law = None
            else:
                target = probs_for(logits[None], p)                                  # (1, K+1, V)
                q = seq.draft_probs[:, :len(ids)].to(target.dtype) if seq.draft_probs is not None else None
                gen = self.generator_for(p, r.index, len(seq.output_token_ids))
                toks, acc = rejection_sample(target, q, drafts, generator=gen)
                law = target[0]
            n = int(acc[0])
            tokens = toks[0, :n + 1].tolist()
            return Sampled(tokens, k, logprobs=self._logprobs(
                lk, tokens, raw[:n + 1], logits[:n + 1], p, None if law is None else law[:n + 1]))
        except (ValueError, RuntimeError) as e:
            return Sampled([], k, error=f"{type(e).__name__}: {e}")

    def _verify_tree(self, r: SampleRow, logits: torch.Tensor) -> Sampled:
        """logits (N, V), one row per node of the sequence's token tree (its newest token, then
        the drafts in node order) -> the kept path's tokens and one more (1..depth + 1). A tree is
        drafted only for requests without logits processors, grammar or min_p (spec/decoder.py),
        so the rows are the law `tree_accept` reads as they are."""
        seq, p, lk = r.seq, r.seq.params, logprobs_k(r.seq.params)
        k = r.num_drafts
        try:
            draft = TreeDraft(torch.tensor([seq.token_ids[-1]] + seq.draft_token_ids),
                              seq.draft_parents)
            gen = None if p.temperature == 0 else self.generator_for(p, r.index,
                                                                     len(seq.output_token_ids))
            path, nxt = tree_accept(logits, draft, p.temperature, p.top_k, p.top_p, generator=gen)
            tokens = [seq.draft_token_ids[i - 1] for i in path[1:]] + [nxt]
            lps = None
            if lk is not None:
                rows = logits[path].float()                                   # (len(path), V)
                law = None if p.temperature == 0 else probs_for(rows, p)
                lps = self._logprobs(lk, tokens, rows, rows, p, law)
            return Sampled(tokens, k, logprobs=lps, path=path)
        except (ValueError, RuntimeError) as e:
            return Sampled([], k, error=f"{type(e).__name__}: {e}")


def sample_rows(seqs: list[Sequence], requests: dict) -> list[SampleRow]:
    """What the sampler draws, in the order it draws: sequences with K drafts first (K + 1 logits
    rows each), then one row per other sequence. A request with n > 1 (or best_of) whose prompt
    just finished draws all its first tokens from that row (indices 0..n-1)."""
    drafting, plain, r = [], [], 0
    for seq in seqs:
        if seq.draft_token_ids:
            drafting.append(SampleRow(seq, seq.index, r))
        else:
            req = requests[seq.request_id]
            n = req.num_seqs if not req.forked else 1
            plain += [SampleRow(seq, i, r) for i in range(seq.index, seq.index + n)]
        r += 1 + len(seq.draft_token_ids)
    return drafting + plain
