"""Speculative decoding inside the engine: draft before scheduling, verify after the forward pass.

Letters: K draft tokens of one sequence (K <= num_speculative_tokens), V vocab.

One engine step with `EngineConfig(num_speculative_tokens=K, speculative_method=...)`:
1. `propose`: every decoding sequence gets up to K draft tokens (`seq.draft_token_ids`) from an
   n-gram lookup over its own tokens ("ngram") or from a draft model ("draft", batch-1 calls);
2. the scheduler books blocks for the last token + the drafts and schedules K + 1 tokens for it;
   the runner asks for logits at all K + 1 positions (one ragged forward pass for the whole batch);
3. `verify`: `greedy_verify` (temperature 0) or `rejection_sample` (the exact rule, with the
   request's own generator) keeps n drafts plus one token; the engine appends them and rolls the
   rejected drafts' slots back with `BlockManager.truncate`.
A sequence whose drafts do not fit the step's token budget simply decodes one token.

Left out on purpose: a batched/paged draft-model cache (the draft model runs batch 1, one
sequence after another, each with its own contiguous cache keyed by seq_id), tree drafts,
per-request K.
"""
import torch

from minillm.engine.model_runner import request_generator_seed
from minillm.spec.proposers import DraftModelProposer, NgramProposer
from minillm.model.sampling import logits_to_probs
from minillm.engine.sequence import Sequence
from minillm.spec.rejection import greedy_verify, rejection_sample


class SpecDecoder:
    def __init__(self, method: str, k: int, draft_model=None, max_seq_len: int | None = None,
                 ngram: tuple[int, int] = (1, 3), max_num_seqs: int = 32):
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative_method must be 'ngram' or 'draft', got {method!r}")
        if method == "draft" and draft_model is None:
            raise ValueError("speculative_method='draft' needs LLMEngine(..., draft_model=...)")
        self.k, self.method, self.max_seq_len = k, method, max_seq_len
        self.proposer = (NgramProposer(min_ngram=ngram[0], max_ngram=ngram[1]) if method == "ngram"
                         else DraftModelProposer(draft_model, max_cached_seqs=2 * max_num_seqs))
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verify_steps = 0

    def _generator(self, seq: Sequence, device, salt: int):
        if seq.params.seed is None:
            return None
        g = torch.Generator(device=device)
        return g.manual_seed(request_generator_seed(seq.params.seed, seq.index,
                                                    len(seq.output_token_ids) + salt))

    def propose(self, seqs: list[Sequence], device, generator=None) -> None:
        """Fill `draft_token_ids` (and `draft_probs` for a sampling draft model) of decoding seqs.
        Unseeded requests draw from `generator` (the engine's), never from the global RNG."""
        for seq in seqs:
            p = seq.params
            room = min(p.max_tokens - len(seq.output_token_ids) - 1,
                       (self.max_seq_len or 10**9) - seq.num_tokens - 1)
            seq.draft_token_ids, seq.draft_probs = [], None
            k = min(self.k, room)
            if k < 1:
                continue
            gen = self._generator(seq, device, 10**6) or generator
            if self.method == "draft":       # each sequence keeps its own draft cache
                prop = self.proposer.propose([seq.token_ids], k, p.temperature, p.top_k, p.top_p,
                                             generator=gen, key=seq.seq_id)
            else:
                prop = self.proposer.propose([seq.token_ids], k, p.temperature, p.top_k, p.top_p,
                                             generator=gen)
            n = k if prop.num_proposed is None else int(prop.num_proposed[0])
            seq.draft_token_ids = prop.token_ids[0, :n].tolist()
            if prop.probs is not None:
                seq.draft_probs = prop.probs[:, :n]                       # (1, K, V)

    def verify(self, seq: Sequence, logits: torch.Tensor, generator=None) -> list[int]:
        """logits (K+1, V) at the last token and the K drafts -> the tokens to append (1..K+1)."""
        drafts = torch.tensor([seq.draft_token_ids], device=logits.device)        # (1, K)
        p = seq.params
        if p.temperature == 0:
            out, acc = greedy_verify(logits[None], drafts)
        else:
            target = logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p)  # (1, K+1, V)
            q = seq.draft_probs.to(target.dtype) if seq.draft_probs is not None else None
            gen = self._generator(seq, logits.device, 0) or generator
            out, acc = rejection_sample(target, q, drafts, generator=gen)
        n = int(acc[0])
        self.num_proposed += len(seq.draft_token_ids)
        self.num_accepted += n
        self.num_verify_steps += 1
        return out[0, :n + 1].tolist()

    def verify_all(self, drafting, logits, generator, block_manager, requests):
        """After the forward pass: verify each (sequence, first logits row) that drafted K tokens
        against its K + 1 rows, count the request's metrics, and roll the rejected drafts' KV
        back. Returns ([(seq, tokens to append)], [seqs whose rows could not be sampled])."""
        new_tokens, failed = [], []
        for seq, r in drafting:
            k = len(seq.draft_token_ids)
            try:
                toks = self.verify(seq, logits[r:r + k + 1], generator)
            except (ValueError, RuntimeError) as e:
                seq.error = f"{type(e).__name__}: {e}"
                failed.append(seq)
                continue
            m = requests[seq.request_id].metrics
            m.num_spec_steps += 1
            m.num_draft_tokens += k
            m.num_accepted_tokens += len(toks) - 1
            seq.num_computed_tokens -= k + 1 - len(toks)   # rejected drafts' KV is void
            block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
            block_manager.mark_computed(seq.seq_id, seq.num_computed_tokens)
            seq.draft_token_ids, seq.draft_probs = [], None
            new_tokens.append((seq, toks))
        return new_tokens, failed

    @property
    def accepted_fraction(self) -> float:
        """Accepted / drafted tokens over the engine's run (0 before any draft)."""
        return self.num_accepted / max(1, self.num_proposed)

    @property
    def acceptance_rate(self) -> float:
        """Alias of `accepted_fraction` (the name of earlier versions)."""
        return self.accepted_fraction
