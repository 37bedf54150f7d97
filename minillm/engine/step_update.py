"""Where a step's results land: `StepUpdate.update_from_output` (vLLM's name) and its helpers,
the half of `LLMEngine` that applies what the runner and sampler produced (llm_engine.py has the
other half: requests in, schedule, run, sample). A mixin: these methods read the engine's own
state (`requests`, `scheduler`, `block_manager`, `spec`, `tokenizer`, `trace`, `clock`).

In order: computed counts move, kept features grow, prompt logprobs are stored, n > 1 requests
fork on their prompt's last row, rejected drafts roll back, tokens (and logprobs, grammar steps,
text) are appended up to the one that finishes a sequence, finished sequences leave the
scheduler at once, and the step's trace row and the requests' metrics are written.

A token tree's accepted path is moved to consecutive slots here too (`_settle_drafts`): the
block manager's record is rewritten at once, and the K/V copy is handed to the runner in one
call per step, before anything can read those slots.

Left out on purpose: anything that runs tensors (model_runner.py, asked for the K/V moves) or
draws tokens (sampler.py).
"""
from minillm.engine.detokenizer import Detokenizer
from minillm.spec.features import FeatureWindow
from minillm.engine.sampler import Sampled, SampleRow
from minillm.engine.sequence import Request, RequestOutput, Sequence, SequenceStatus
from minillm.engine.trace import prune, trace_row


class StepUpdate:
    """`LLMEngine`'s methods that apply a step's results (a mixin; see the module docstring)."""

    def _decoded(self, entries: list[dict]) -> list[dict]:
        """Fill each Logprob's decoded_token (with a tokenizer), in place; returns entries."""
        if self.tokenizer is not None:
            for entry in entries:
                for tok, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([tok])
        return entries

    def update_from_output(self, out, rows: list[SampleRow], sampled: list[Sampled],
                           t0: float, prompt_logprobs=(), hidden=None) -> list[RequestOutput]:
        """The one place a step's results land (vLLM's `Scheduler.update_from_output`): computed
        counts move, the target's features are kept (hidden (M, C), one row per scheduled token,
        when a trained drafter reads them), prompt logprobs are stored, n > 1 requests fork,
        rejected drafts roll back (their feature rows too), tokens (and their logprobs) are
        appended, finished sequences stop, and metrics and the trace are written. A row that
        could not be sampled (say, NaN logits) aborts its own request and nobody else's."""
        self._keep_features(out, hidden, rows, sampled)
        self._kv_moves = []               # token trees' accepted paths: (src, dst) slots
        num_decode, prefill_ids = self._advance(out, t0)
        for seq, first, entries in prompt_logprobs:     # a recomputed chunk writes the same again
            self.requests[seq.request_id].prompt_logprobs[first:first + len(entries)] = \
                self._decoded(entries)
        now = self.clock()
        advanced = {}
        for seq, s in zip(self._fork_rows(rows), sampled):
            if s.error is not None:
                seq.error = s.error
                self._fail(seq, now)
            else:
                if s.num_drafts:
                    self._settle_drafts(seq, s)
                self._append(seq, s.token_ids, now, s.logprobs)
            advanced[seq.request_id] = self.requests[seq.request_id]
        if self._kv_moves:                # before any later step reads, swaps or offloads them
            self.runner.move_slots(*zip(*self._kv_moves))
        for seq in out.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
            if seq.features is not None and seq.num_computed_tokens == 0:
                seq.features.clear()       # recomputed from scratch; a swapped KV keeps them
        self.trace.append(trace_row(self.step_count, out, t0, now, num_decode, prefill_ids,
                                    self.scheduler, self.block_manager))
        self._count_spec_step()
        self.step_count += 1
        outputs = [self._output(r) for r in advanced.values()]
        prune(self.trace, self.requests, self._forgotten, self._pinned, self.config,
              self.scheduler.num_unfinished)            # bounded memory (trace.py)
        return outputs

    def _count_spec_step(self) -> None:
        """The speculation switch's decision for this step (`LLMEngine._draft`), if it had
        decodes: counted in `spec_stats`, kept as `spec_active` and in the trace row ("spec")."""
        decision = self._spec_step
        self.trace[-1]["spec"] = decision
        if decision is None:
            return
        self.spec_active = decision
        if decision:
            self.spec_stats.num_steps_speculated += 1
        else:
            self.spec_stats.num_steps_skipped += 1

    def _advance(self, out, t0: float) -> tuple[int, list[str]]:
        """The scheduled tokens' KV is written: advance each sequence and register full blocks
        in the prefix cache (a sequence with drafts waits for `_settle_drafts`: some of that KV
        is void). Returns the step's decode token count and prefilling request ids."""
        num_decode, prefill_ids = 0, []
        for seq, n in out.scheduled:
            if seq.num_computed_tokens >= len(seq.prompt_token_ids) and (n == 1 or seq.draft_token_ids):
                num_decode += n
            else:
                prefill_ids.append(seq.request_id)
            m = self.requests[seq.request_id].metrics
            if m.first_scheduled_time is None:     # the end of its queue wait (vLLM's name)
                m.first_scheduled_time = t0
            if seq.index == 0 and m.first_token_time is None:
                m.num_cached_tokens = seq.num_cached_tokens
            seq.num_computed_tokens += n
            if not seq.draft_token_ids:
                self.block_manager.mark_computed(seq.seq_id, seq.num_computed_tokens)
        return num_decode, prefill_ids

    def _keep_features(self, out, hidden, rows: list[SampleRow], sampled: list[Sampled]) -> None:
        """Each scheduled chunk's hidden rows join its sequence's window (spec/features.py), but for
        the rows of rejected drafts. Runs before the counts move (and before any fork)."""
        if hidden is None:
            return
        # rows kept per verifying sequence: a chain's first n - rejected, a tree's path
        kept = {r.seq.seq_id: s.path if s.path is not None else s.num_drafts - s.num_rejected + 1
                for r, s in zip(rows, sampled) if r.num_drafts}
        at = 0
        for seq, n in out.scheduled:
            if seq.features is None:
                seq.features = FeatureWindow(self.spec.feature_window)
            keep = kept.get(seq.seq_id, n)
            rows_ = hidden[at:at + keep] if isinstance(keep, int) else hidden[[at + i for i in keep]]
            seq.features.extend(seq.num_computed_tokens, rows_)                    # (kept, C)
            at += n

    def _settle_drafts(self, seq: Sequence, s: Sampled) -> None:
        """K drafts were verified: the rejected ones' KV is void (num_computed_tokens -= rejected,
        their slots go back), the rest is registered, and the counts go to the request's metrics
        and the engine's. A token tree's kept path first takes the places its nodes were booked
        in: its tokens in the block table's record, its K/V moved to the slots plain decoding
        would have written (booked in `_kv_moves`, made once the step's results are in)."""
        if s.path is not None and s.path != list(range(len(s.path))):
            root = seq.num_computed_tokens - 1 - s.num_drafts       # the newest token's position
            slots = self.block_manager.slot_mapping(seq.seq_id, root, root + 1 + s.num_drafts)
            moves = [(slots[node], slots[j]) for j, node in enumerate(s.path) if node != j]
            self._kv_moves += moves
            self.block_manager.replace_tokens(seq.seq_id, root + 1, s.token_ids[:-1])
        if s.path is not None and self.spec.switch is not None:    # the tree's probe counts
            self.spec.switch.record(seq.draft_parents, s.path)
        seq.num_computed_tokens -= s.num_rejected
        self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
        self.block_manager.mark_computed(seq.seq_id, seq.num_computed_tokens)
        seq.clear_drafts()
        for counts in (self.requests[seq.request_id].metrics, self.spec_stats):
            counts.num_spec_steps += 1
            counts.num_draft_tokens += s.num_drafts
            counts.num_accepted_tokens += s.num_accepted

    def _sample_rows(self, seqs: list[Sequence]) -> list[SampleRow]:
        """What the sampler draws, in the order it draws: sequences with K drafts first (K + 1
        logits rows each), then one row per other sequence. A request with n > 1 (or best_of)
        whose prompt just finished draws all its first tokens from that row (indices 0..n-1)."""
        drafting, plain, r = [], [], 0
        for seq in seqs:
            if seq.draft_token_ids:
                drafting.append(SampleRow(seq, seq.index, r))
            else:
                req = self.requests[seq.request_id]
                n = req.num_seqs if not req.forked else 1
                plain += [SampleRow(seq, i, r) for i in range(seq.index, seq.index + n)]
            r += 1 + len(seq.draft_token_ids)
        return drafting + plain

    def _fork_rows(self, rows: list[SampleRow]) -> list[Sequence]:
        """The sequence each row's tokens go to. A request's n completions fork on its prompt's
        last row, before any token lands (the children share the prompt's blocks)."""
        for row in rows:
            req = self.requests[row.seq.request_id]
            if row.index != row.seq.index and not req.forked:
                self._fork(req, row.seq)
        return [self.requests[row.seq.request_id].seqs[row.index] for row in rows]

    def _fail(self, seq: Sequence, now: float) -> None:
        """A sequence whose token could not be drawn ends with finish_reason "abort"; its blocks
        go back to the pool at once. `seq.error` says why."""
        req = self.requests[seq.request_id]
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if req.finished:
            req.metrics.finish_time, req.metrics.finish_step = now, self.step_count

    def _append(self, seq: Sequence, toks: list[int], now: float, logprobs=None) -> None:
        """Append sampled tokens (their logprobs, their grammar steps) up to the first that
        finishes the sequence."""
        req = self.requests[seq.request_id]
        m = req.metrics
        for i, tok in enumerate(toks):
            seq.output_token_ids.append(tok)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[i][tok].logprob
                if seq.params.logprobs is not None:
                    seq.logprobs.append(self._decoded([logprobs[i]])[0])
            if seq.grammar is not None:
                seq.grammar.accept([tok])
            if self.tokenizer is not None:          # the text, and whether it reached a stop string
                if seq.detok is None:               # stop strings wait for min_tokens (vLLM)
                    seq.detok = Detokenizer(self.tokenizer, seq.prompt_token_ids,
                                            None if seq.params.min_tokens else seq.params.stop)
                seq.detok.append(tok)
                if len(seq.output_token_ids) == seq.params.min_tokens and seq.params.stop:
                    seq.detok.stop = list(seq.params.stop)
            if m.first_token_time is None:
                m.first_token_time, m.first_token_step = now, self.step_count
            m.num_generated = max(m.num_generated, len(seq.output_token_ids))
            if seq.index == 0:
                m.token_times.append(now)
            reason = seq.finish_reason_after(tok, self.eos_token_id, self.model.config.max_seq_len)
            if reason is not None:
                seq.finish_reason = reason
                if seq.detok is not None:
                    seq.detok.flush()
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                if req.finished:
                    m.finish_time, m.finish_step = now, self.step_count
                return

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        children = []
        for i in range(1, req.num_seqs):
            child = Sequence(self._new_seq_id(), req.request_id, parent.prompt_token_ids,
                             req.params, parent.arrival_time, index=i,
                             num_computed_tokens=parent.num_computed_tokens, priority=parent.priority,
                             procs=parent.procs,
                             grammar=parent.grammar.fork() if parent.grammar is not None else None,
                             features=parent.features.copy() if parent.features is not None else None)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            children.append(child)
        req.seqs += children
        req.forked = True
        return children

    def _output(self, req: Request) -> RequestOutput:
        return req.output(with_text=self.tokenizer is not None)
