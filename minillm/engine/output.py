"""Where sampled tokens become outputs: the `OutputProcessor` (vLLM's name for this seam), which
`LLMEngine` owns as `engine.output_processor`.

For each sequence a step advanced it appends the sampled tokens up to the one that finishes the
sequence, with their logprobs (decoded to text when there is a tokenizer), their grammar steps and
the detokenized text (which stops at a stop string; a stop token's or EOS's text is left out
unless `include_stop_str_in_output`, as vLLM; max_tokens 0 appends nothing); it decides the finish
reason, writes the request's latency metrics (first token, token times, finish) and builds each
`RequestOutput`. It also stores the prompt logprobs a step computed.

It only reports: `append` says whether the sequence finished, and the engine frees it at once
(`LLMEngine.update_from_output` keeps the KV bookkeeping: counts, forks, drafts, freeing, trace).

Left out on purpose: blocks, queues and the trace (the engine's), and drawing tokens (sampler.py).
"""
from minillm.engine.detokenizer import Detokenizer
from minillm.engine.sequence import Request, RequestOutput, Sequence, SequenceStatus


class OutputProcessor:
    """Sampled tokens -> sequence state, metrics and `RequestOutput`s (see the module docstring).
    `requests` is the engine's own dict of requests, shared, not copied."""

    def __init__(self, requests: dict[str, Request], tokenizer=None, eos_token_id: int | None = None,
                 max_seq_len: int | None = None):
        self.requests = requests
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id      # finishes a sequence unless ignore_eos
        self.max_seq_len = max_seq_len        # the model's context: a sequence stops at it

    def decoded(self, entries: list[dict]) -> list[dict]:
        """Fill each Logprob's decoded_token (with a tokenizer), in place; returns entries."""
        if self.tokenizer is not None:
            for entry in entries:
                for tok, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([tok])
        return entries

    def add_prompt_logprobs(self, prompt_logprobs) -> None:
        """Store a step's prompt logprobs, (seq, first position, entries) per prefill chunk; a
        recomputed chunk writes the same entries again."""
        for seq, first, entries in prompt_logprobs:
            self.requests[seq.request_id].prompt_logprobs[first:first + len(entries)] = \
                self.decoded(entries)

    def append(self, seq: Sequence, toks: list[int], now: float, step: int, logprobs=None) -> bool:
        """Append sampled tokens (their logprobs, their grammar steps, their text) up to the first
        that finishes the sequence. Returns True if one did: the engine then frees its blocks."""
        req = self.requests[seq.request_id]
        m = req.metrics
        p = seq.params
        if p.max_tokens == 0:             # score the prompt: the token drawn after it is dropped
            seq.finish_reason = "length"
            self._finish(seq, now, step)
            return True
        for i, tok in enumerate(toks):
            seq.output_token_ids.append(tok)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[i][tok].logprob
                if seq.params.logprobs is not None:
                    seq.logprobs.append(self.decoded([logprobs[i]])[0])
            if seq.grammar is not None:
                seq.grammar.accept([tok])
            stop_token = tok in (p.stop_token_ids or ()) or (
                not p.ignore_eos and tok == self.eos_token_id)
            if self.tokenizer is not None and (not stop_token or p.include_stop_str_in_output):
                self._detokenize(seq, tok)        # a stop token's text is not shown (vLLM)
            if m.first_token_time is None:
                m.first_token_time, m.first_token_step = now, step
            m.num_generated = max(m.num_generated, len(seq.output_token_ids))
            if seq.index == 0:
                m.token_times.append(now)
            reason = seq.finish_reason_after(tok, self.eos_token_id, self.max_seq_len)
            if reason is not None:
                seq.finish_reason = reason
                if seq.detok is not None:
                    seq.detok.flush()
                self._finish(seq, now, step)
                return True
        return False

    def _detokenize(self, seq: Sequence, tok: int) -> None:
        """The text grows by `tok`; stop strings are watched only from min_tokens on (vLLM)."""
        if seq.detok is None:
            seq.detok = Detokenizer(self.tokenizer, seq.prompt_token_ids,
                                    None if seq.params.min_tokens else seq.params.stop,
                                    seq.params.include_stop_str_in_output)
        seq.detok.append(tok)
        if len(seq.output_token_ids) == seq.params.min_tokens and seq.params.stop:
            seq.detok.stop = list(seq.params.stop)

    def fail(self, seq: Sequence, error: str, now: float, step: int) -> None:
        """A sequence whose token could not be drawn ends with finish_reason "abort" and `error`
        saying why (the engine frees it at once)."""
        seq.error, seq.finish_reason = error, "abort"
        self._finish(seq, now, step)

    def _finish(self, seq: Sequence, now: float, step: int) -> None:
        seq.status = SequenceStatus.FINISHED
        req = self.requests[seq.request_id]
        if req.finished:
            req.metrics.finish_time, req.metrics.finish_step = now, step

    def output(self, req: Request) -> RequestOutput:
        """The request as it stands: its completions so far (with text when there is a tokenizer)."""
        return req.output(with_text=self.tokenizer is not None)
