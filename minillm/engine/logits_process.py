"""Logits processors and logprobs: what a request's `SamplingParams` do to its logits rows before
a token is drawn, and what comes back about the distribution it was drawn from.

Letters: K draft tokens of one sequence, R = K + 1 logits rows, V vocab.

`process_logits(logits, seq, drafts)` is the one place they run, in vLLM's order: the grammar mask,
`bad_words`, `min_tokens`, `logit_bias`, `repetition_penalty` (over prompt + output), then
`frequency_penalty` and `presence_penalty` (OpenAI's formula, over the output). Temperature,
top-k, min-p and top-p follow in `logits_to_probs` (model/sampling.py). Row j of a verify is
processed as if drafts[:j] were appended, so speculation keeps a penalized or constrained
request's law. `token_logprobs` builds vLLM's logprobs entry (the token and the top k, ranked)
from the values `mode_values` picks (vLLM's `logprobs_mode`).

Left out on purpose: vLLM's allowed_token_ids and custom processors; batching the processors
over sequences; incremental token counts.
"""
from dataclasses import dataclass

import torch

from minillm._validate import ArgumentTypeError
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Logprob

NEG_INF = float("-inf")
# what logprobs show (vLLM's names): the model's rows, or the rows a token was drawn from
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass(frozen=True)
class LogitsProcessors:
    """One request's processors, checked and prepared once when it is added (`build`)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()                 # banned while fewer than min_tokens are out
    bad_words: tuple[tuple[int, ...], ...] = ()    # token sequences whose last token is banned

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int, tokenizer=None,
              eos_token_id: int | None = None) -> "LogitsProcessors | None":
        """The request's processors, or None when it asks for none (its logits stay as they are).
        ValueError naming `logit_bias` for a token id outside [0, vocab_size); `bad_words`
        without a tokenizer raises an ArgumentTypeError (a TypeError and a ValueError)."""
        bias = tuple(sorted((params.logit_bias or {}).items()))
        bad = [t for t, _ in bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}) (vocab_size), "
                             f"got {bad[:5]}")
        stop_ids = ()
        if params.min_tokens > 0:
            ids = list(params.stop_token_ids or ())
            if eos_token_id is not None and not params.ignore_eos:
                ids.append(eos_token_id)
            stop_ids = tuple(sorted({t for t in ids if 0 <= t < vocab_size}))
        words = ()
        if params.bad_words:
            if tokenizer is None:
                raise ArgumentTypeError("bad_words needs LLMEngine(..., tokenizer=...) to turn "
                                        "words into token ids")
            words = bad_words_token_ids(params.bad_words, tokenizer, vocab_size)
        procs = cls(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                    bias, params.min_tokens if stop_ids else 0, stop_ids, words)
        return None if procs == cls() else procs

    @property
    def uses_counts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each word as token ids, as it would appear at the start of a text and, where the tokenizer
    gives a different first token of the same length, after a space (vLLM's rule)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced if spaced and plain and spaced[0] != plain[0]
                    and len(spaced) == len(plain) else None):
            if ids and all(0 <= t < vocab_size for t in ids) and tuple(ids) not in out:
                out.append(tuple(ids))
    return tuple(out)


def process_logits(logits: torch.Tensor, seq, drafts=()) -> torch.Tensor:
    """logits (R, V) of one sequence, R = len(drafts) + 1 -> a processed copy (R, V): row j as if
    drafts[:j] were already appended (module docstring). The input is left untouched."""
    R, V = logits.shape
    drafts = list(drafts)
    if len(drafts) != R - 1:
        raise ValueError(f"logits must have len(drafts) + 1 = {len(drafts) + 1} rows, got {R}")
    out = logits.clone()
    if seq.grammar is not None:
        allowed = torch.as_tensor(seq.grammar.allowed(drafts), dtype=torch.bool, device=out.device)
        if tuple(allowed.shape) != (R, V):
            raise ValueError(f"grammar.allowed(drafts) must be (R, V) = {(R, V)}, got "
                             f"{tuple(allowed.shape)}")
        out.masked_fill_(~allowed, NEG_INF)
    procs = seq.procs
    if procs is None:
        return out
    output = seq.output_token_ids
    for j in range(R):                                    # row j sees output + drafts[:j]
        if procs.bad_words:
            past = output + drafts[:j]
            for word in procs.bad_words:
                head = list(word[:-1])
                if not head or past[len(past) - len(head):] == head:
                    out[j, word[-1]] = NEG_INF
        if procs.stop_ids and len(output) + j < procs.min_tokens:
            out[j, list(procs.stop_ids)] = NEG_INF
    if procs.logit_bias:
        ids, bias = zip(*procs.logit_bias)
        out[:, list(ids)] += torch.tensor(bias, dtype=out.dtype, device=out.device)
    if procs.uses_counts:
        counts = token_counts(output, drafts, V, out.device)                    # (R, V)
        if procs.repetition_penalty != 1:
            seen = counts > 0
            seen[:, torch.tensor(seq.prompt_token_ids, device=out.device)] = True
            r = procs.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        counts = counts.to(out.dtype)
        out -= procs.frequency_penalty * counts + procs.presence_penalty * (counts > 0).to(out.dtype)
    return out


def token_counts(output: list[int], drafts: list[int], V: int, device) -> torch.Tensor:
    """(R, V) counts: row j counts each token in output + drafts[:j], R = len(drafts) + 1."""
    base = torch.bincount(torch.tensor(output, dtype=torch.long, device=device), minlength=V)
    counts = base[None].repeat(len(drafts) + 1, 1)                               # (R, V)
    if drafts:
        d = torch.zeros(len(drafts), V, dtype=counts.dtype, device=device)
        d[torch.arange(len(drafts)), torch.tensor(drafts, device=device)] = 1   # (K, V)
        counts[1:] += d.cumsum(0)
    return counts


def mode_values(mode: str, raw: torch.Tensor, processed: torch.Tensor,
                law: torch.Tensor | None = None, temperature: float = 0.0) -> torch.Tensor:
    """(T, V) values logprobs show under `mode` (LOGPROBS_MODES): "raw_*" from the model's rows
    `raw`, before any processor or grammar; "processed_*" from the rows after them and after
    temperature, top-k, min-p and top-p: the log of the `law` a token was drawn from, or those
    rows / T with the tokens outside the law at -inf (`law` None: greedy, the processed rows)."""
    if mode.startswith("raw"):
        return raw.float() if mode == "raw_logits" else torch.log_softmax(raw.float(), -1)
    if law is None:
        return processed.float() if mode == "processed_logits" else torch.log_softmax(
            processed.float(), -1)
    if mode == "processed_logprobs":
        return law.log()
    return (processed.float() / temperature).masked_fill(law == 0, NEG_INF)


def _top(values: torch.Tensor, k: int, order: torch.Tensor | None):
    """The k best ids of each row of values (T, V), best first; ties at -inf (tokens a mask or a
    top-p cut removed) go by `order` (the model's own logits) instead of by index."""
    top_v, top_i = values.topk(k, dim=-1)                                           # (T, k)
    if order is None or torch.isfinite(top_v).all():
        return top_v, top_i
    top_v, top_i = top_v.clone(), top_i.clone()
    for t in range(values.shape[0]):
        finite = torch.isfinite(values[t])
        kept = min(k, int(finite.sum()))
        rest = order[t].float().masked_fill(finite, NEG_INF).topk(k - kept).indices
        top_i[t, kept:] = rest
        top_v[t, kept:] = values[t, rest]
    return top_v, top_i


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], k: int,
                   order: torch.Tensor | None = None) -> list[dict[int, Logprob]]:
    """logprobs (T, V), the values shown for tokens[0..T-1] (`mode_values`) -> one dict per token:
    {token: Logprob, and each of the k most likely ids: Logprob}, rank 1 = most likely (ties
    share the best rank; ties at -inf listed by `order`, (T, V)). decoded_token is left None
    (the engine has the tokenizer)."""
    logprobs = logprobs.float()
    tok = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)[:, None]   # (T, 1)
    chosen = logprobs.gather(1, tok)                                                # (T, 1)
    ranks = (logprobs > chosen).sum(1) + 1                                          # (T,)
    top_v, top_i = (_top(logprobs, k, order) if k else (logprobs[:, :0], tok[:, :0]))  # (T, k)
    out = []
    for t, lp, rank, vs, ids in zip(tokens, chosen[:, 0].tolist(), ranks.tolist(),
                                    top_v.tolist(), top_i.tolist()):
        entry = {t: Logprob(lp, rank)}
        for r, (v, i) in enumerate(zip(vs, ids), start=1):
            entry.setdefault(i, Logprob(v, r))
        out.append(entry)
    return out
