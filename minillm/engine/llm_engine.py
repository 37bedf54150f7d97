"""The serving engine: `LLMEngine.step()` = schedule -> run -> update, over a paged KV cache.

    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=32))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))      # list[RequestOutput]
    rid = engine.add_request(prompt_ids, params); engine.step(); engine.abort_request(rid)

Pieces: `Sequence` state (sequence.py), `BlockManager` (paging/block_manager.py, no tensors),
`Scheduler` (decides), `ModelRunner` (runs tensors), `Sampler` (logits -> tokens), and the
`OutputProcessor` (output.py: tokens, logprobs, text, finish reasons -> `RequestOutput`). The
engine owns them and checks requests before anything else sees them; `update_from_output` is the
one place a step's results land. Each feature an engine field switches on is its own module:
speculation (spec/decoder.py), policies (policies/: priorities, the SLO controller, the prefill
pacer), structured output (structured.py) and the host KV tier (paging/host_tier.py). Tensor
parallelism is another `runner` (distributed/tp_runner.py), which `LLM` (llm.py) passes in.

Left out on purpose: async serving and HTTP streaming (serve/), pipeline parallelism.
"""
import json
import time
from collections import OrderedDict
from dataclasses import asdict

from minillm.paging.block_manager import BlockManager
from minillm.paging.host_tier import HostTier
from minillm.paging.sizing import offload_num_blocks, pool_num_blocks
from minillm.engine.config import EngineConfig, apply_speculative_config
from minillm.engine.requests import (batch_requests, check_prompt, check_request_priority,
                                     request_state)
from minillm.spec.decoder import SpecDecoder, SpecDecodingStats
from minillm.spec.features import FeatureWindow
from minillm.engine.model_runner import ModelRunner, prompt_rows
from minillm.engine.output import OutputProcessor
from minillm.engine.sampler import Sampled, Sampler, SampleRow
from minillm.engine.policies.prefill_pacer import PrefillPacer
from minillm.engine.policies.priority import PriorityScheduler, apply_queue_timeouts
from minillm.engine.scheduler import Scheduler
from minillm.engine.policies.slo_controller import SLOController
from minillm.engine.policies.static_scheduler import StaticScheduler
from minillm.engine.trace import progress_bar, prune, trace_row
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Request, RequestMetrics, RequestOutput, Sequence, SequenceStatus


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, draft_model=None, tokenizer=None,
                 speculative_config: dict | None = None, runner=ModelRunner):
        """`runner`: what makes and runs the pool, called as `runner(model, config, num_blocks,
        block_manager, num_host_blocks)`; `ModelRunner` runs in this process."""
        config = config or EngineConfig()
        drafter = None                                # a trained method's proposer, or None
        if speculative_config is not None:            # vLLM's dict -> the flat fields
            config, draft_model, drafter = apply_speculative_config(config, speculative_config,
                                                                    draft_model)
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.draft_model = draft_model
        mc, cfg = model.config, self.config
        num_blocks = pool_num_blocks(model, cfg, draft_model)
        # one block beyond the manager's: padding rows (static batching, compiled sizes) write here
        scratch = cfg.scheduling == "static" or cfg.compilation_config is not None
        num_host = offload_num_blocks(model, cfg)   # the host KV tier's slots (0: no tier)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          HostTier(num_host) if num_host else None)
        # the paged pool and what runs on it (tensor_parallel_size > 1: a runner with workers)
        self.runner = runner(model, cfg, num_blocks + scratch, self.block_manager, num_host)
        self.cache = self.runner.cache
        self.spec = None
        if cfg.num_speculative_tokens > 0:
            self.spec = SpecDecoder(cfg.speculative_method or "ngram", cfg.num_speculative_tokens,
                                    draft_model, mc.max_seq_len,
                                    ngram=(cfg.prompt_lookup_min, cfg.prompt_lookup_max),
                                    max_num_seqs=cfg.max_num_seqs, drafter=drafter,
                                    tree=cfg.speculative_token_tree, target=model,
                                    disable_by_batch_size=cfg.speculative_disable_by_batch_size,
                                    min_seq_len=cfg.speculative_min_seq_len,
                                    max_num_batched_tokens=cfg.max_num_batched_tokens)
        self.needs_features = self.spec is not None and self.spec.needs_features
        param = next(model.parameters())
        scheduler = (StaticScheduler if cfg.scheduling == "static" else
                     PriorityScheduler if cfg.scheduling_policy == "priority" else Scheduler)
        self.scheduler = scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, cfg.preemption_mode,
                                   prefill_first=cfg.prefill_first,
                                   max_num_partial_prefills=cfg.max_num_partial_prefills,
                                   max_long_partial_prefills=cfg.max_long_partial_prefills,
                                   long_prefill_token_threshold=cfg.long_prefill_token_threshold)
        self.sampler = Sampler(param.device, cfg.seed, cfg.logprobs_mode)
        # None, or the loop that moves the scheduler's budget towards the P95 targets
        self.controller = (SLOController(cfg, self.scheduler)
                           if cfg.slo_ttft_p95_ms is not None or cfg.slo_tpot_p95_ms is not None else None)
        # None, or what sizes prompt chunks in time from the steps' own durations (policies/)
        self.pacer = (PrefillPacer(self.scheduler, cfg.prefill_step_target_ms, cfg.block_size)
                      if cfg.prefill_step_target_ms else None)
        self.spec_stats = SpecDecodingStats()      # all zero without speculative decoding
        self.spec_active = False       # whether the last step with decodes speculated (the switch)
        self._spec_step = None         # this step's switch: None (no decodes), True, False
        self.requests: dict[str, Request] = {}
        # tokens -> outputs (output.py); it reads and writes these requests, the engine frees
        self.output_processor = OutputProcessor(self.requests, tokenizer,
                                                getattr(tokenizer, "eos_token_id", None), mc.max_seq_len)
        self.trace: list[dict] = []
        self.clock = time.perf_counter
        self.step_count = 0
        self._next_seq_id = 0
        self._next_request_id = 0
        self._pinned: set[str] = set()           # requests a generate() call will return
        self._forgotten: OrderedDict[str, None] = OrderedDict()   # ids of pruned finished requests

    # ---- public API ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a sequence unless ignore_eos (the tokenizer's; the processor's)."""
        return self.output_processor.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.output_processor.eos_token_id = value

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue a request (token ids, or a str with a tokenizer); returns its request id.
        `priority`: lower is served first; non-zero needs scheduling_policy="priority" (policies/)."""
        check_request_priority(priority, self.config.scheduling_policy, self.config.priority_classes)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        num_seqs = params.best_of or params.n
        if num_seqs > self.config.max_num_seqs:
            name = "best_of" if params.best_of else "n"
            raise ValueError(f"{name}={num_seqs} completions can never run together with "
                             f"max_num_seqs={self.config.max_num_seqs}; use {name} <= max_num_seqs")
        ids = self._check_prompt(prompt, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs LLMEngine(..., tokenizer=...) to see text; "
                             "use stop_token_ids with token ids")
        procs, grammar = request_state(params, self.tokenizer, self.model.config.vocab_size,
                                       self.eos_token_id, self.config.enable_prefix_caching)
        rid = str(self._next_request_id) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._next_request_id += 1
        now = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(self._new_seq_id(), rid, ids, params, now, priority=priority,
                       procs=procs, grammar=grammar)
        metrics = RequestMetrics(now, arrival_step=self.step_count, priority=priority)
        self.requests[rid] = Request(rid, ids, params, [seq], metrics,
                                     prompt=prompt if isinstance(prompt, str) else None,
                                     prompt_logprobs=None if params.prompt_logprobs is None
                                     else [None] * len(ids))
        self.scheduler.add(seq)
        return rid

    def abort_request(self, request_id: str) -> None:
        """Stop a request; a finished one is left as it is (a client may leave as it completes)."""
        req = self.requests.get(str(request_id))
        if req is None and str(request_id) in self._forgotten:
            return                               # finished long ago and no longer kept
        if req is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        if req.finished:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        req.metrics.finish_time, req.metrics.finish_step = self.clock(), self.step_count

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run -> sample -> update. Returns the requests it advanced."""
        t0 = self.clock()
        timed_out = self._operate(t0)  # controller, queue bounds, host KV tier; no-ops when off
        self._draft()                  # speculative decoding only; a no-op otherwise
        out = self.scheduler.schedule()
        try:
            if self.needs_features:    # a trained drafter reads the target's hidden rows
                seqs, logits, hidden = self.runner.execute_with_hidden(out)
            else:
                (seqs, logits), hidden = self.runner.execute(out), None
            rows = self._sample_rows(seqs)
            sampled = self.sampler.sample(rows, logits)     # tokens; drafts verified
            if self.spec is not None:
                self.spec.observe(rows, logits)             # lookahead learns from the verify pass
            prompt_lps = self.sampler.prompt_logprobs(prompt_rows(out), logits)
        except Exception:
            self.scheduler.undo(out)   # nothing was committed: recompute these next time
            raise
        outputs = self.update_from_output(out, rows, sampled, t0, prompt_lps, hidden)
        if self.pacer is not None:         # the next chunk from this step's speed
            row = self.trace[-1]
            self.pacer.observe(row["num_prefill_tokens"], row["t_end"] - row["t_start"])
        if self.controller is not None:    # this step's first tokens and finished requests
            self.controller.observe(outputs, self.step_count - 1, len(timed_out), out.num_tokens)
        return [self._output(r) for r in timed_out] + outputs

    def generate(self, prompts, params=None, use_tqdm: bool = False, *,
                 sampling_params=None, priority=None) -> list[RequestOutput]:
        """Serve a list of prompts to completion; one RequestOutput per prompt, in input order.
        `params` or (vLLM's name) `sampling_params`: one SamplingParams or one per prompt;
        `priority`: None (0), an int, or a list with one int per prompt."""
        rids = []
        try:
            for p, sp, pr in batch_requests(prompts, params, sampling_params, priority):
                rids.append(self.add_request(p, sp, priority=pr))
        except (TypeError, ValueError):
            for r in rids:                       # all or nothing: no half-queued batch
                self.abort_request(r)
            raise
        self._pinned.update(rids)
        bar = progress_bar(len(rids)) if use_tqdm else None
        while any(not self.requests[r].finished for r in rids):
            done = sum(o.finished for o in self.step() if o.request_id in rids)
            if bar is not None:
                bar.update(done)
        if bar is not None:
            bar.close()
        self._pinned.difference_update(rids)
        return [self._output(self.requests[r]) for r in rids]

    def shutdown(self) -> None:
        """Stop the runner's worker processes (tensor_parallel_size > 1; else nothing). Idempotent."""
        self.runner.shutdown()

    def export_trace(self, path=None) -> dict:
        """Per-step trace and per-request metrics as a JSON-ready dict (written to `path` if given)."""
        data = {"config": asdict(self.config), "num_blocks": self.num_blocks, "steps": self.trace,
                "requests": {rid: r.metrics.as_dict() for rid, r in self.requests.items()}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
        return data

    # ---- where a step lands ------------------------------------------------------------------
    def update_from_output(self, out, rows: list[SampleRow], sampled: list[Sampled],
                           t0: float, prompt_logprobs=(), hidden=None) -> list[RequestOutput]:
        """The one place a step's results land (vLLM's `Scheduler.update_from_output`). Here the
        KV bookkeeping: computed counts move, the target's features are kept (hidden (M, C), one
        row per scheduled token, when a trained drafter reads them), n > 1 requests fork, rejected
        drafts roll back (their feature rows too), finished sequences are freed at once, the trace
        row is written. The output processor (output.py) appends tokens, logprobs and text and
        says who finished. A row that could not be sampled (say, NaN logits) aborts its own
        request and nobody else's."""
        self._keep_features(out, hidden, rows, sampled)
        self._kv_moves = []               # token trees' accepted paths: (src, dst) slots
        num_decode, prefill_ids = self._advance(out, t0)
        self.output_processor.add_prompt_logprobs(prompt_logprobs)
        now = self.clock()
        advanced = {}
        for seq, s in zip(self._fork_rows(rows), sampled):
            if s.error is not None:
                self.output_processor.fail(seq, s.error, now, self.step_count)
                self.scheduler.remove(seq)         # its blocks go back at once
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

    def _append(self, seq: Sequence, toks: list[int], now: float, logprobs=None) -> None:
        """The tokens land (output.py); a sequence they finish leaves the scheduler, blocks freed."""
        if self.output_processor.append(seq, toks, now, self.step_count, logprobs):
            self.scheduler.remove(seq)

    def _output(self, req: Request) -> RequestOutput:
        return self.output_processor.output(req)

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

    def _fork(self, req: Request, parent: Sequence) -> None:
        for i in range(1, req.num_seqs):
            child = Sequence(self._new_seq_id(), req.request_id, parent.prompt_token_ids,
                             req.params, parent.arrival_time, index=i,
                             num_computed_tokens=parent.num_computed_tokens, priority=parent.priority,
                             procs=parent.procs,
                             grammar=parent.grammar.fork() if parent.grammar is not None else None,
                             features=parent.features.copy() if parent.features is not None else None)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            req.seqs.append(child)
        req.forked = True

    # ---- speculative decoding's part of a step ------------------------------------------------
    def _keep_features(self, out, hidden, rows: list[SampleRow], sampled: list[Sampled]) -> None:
        """Each scheduled chunk's hidden rows join its sequence's window (features.py), but for
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

    def _count_spec_step(self) -> None:
        """The speculation switch's decision for this step (`_draft`), if it had decodes:
        counted in `spec_stats`, kept as `spec_active` and in the trace row ("spec")."""
        decision = self._spec_step
        self.trace[-1]["spec"] = decision
        if decision is not None:
            self.spec_active = decision
            if decision:
                self.spec_stats.num_steps_speculated += 1
            else:
                self.spec_stats.num_steps_skipped += 1

    # ---- internals --------------------------------------------------------------------------
    def _operate(self, now: float) -> list:
        """What runs before a step is scheduled (chapter 8's appendix): the SLO controller's
        decision when one is due, the priority classes' queue-wait bounds (as the controller set
        them), idle prefix-cache blocks copied to the host tier. Returns the requests a bound
        rejected."""
        ctl = self.controller
        if ctl is not None:
            ctl.tick(now)              # a decision every slo_interval_s; nothing in between
        classes = self.config.priority_classes if ctl is None else ctl.priority_classes
        timed_out = (apply_queue_timeouts(self.scheduler, self.requests, classes, now,
                                          self.step_count) if classes else [])
        if self.block_manager.host_tier is not None:   # idle cached blocks -> host (offload.py)
            self.block_manager.offload_idle(now, self.config.offload_idle_s)
        return timed_out

    def _draft(self) -> None:
        """Propose drafts for the decoding sequences the switch lets draft this step
        (`SpecDecoder.select`), before the scheduler books their blocks; the others decode
        plainly (no drafts left from a step that did not run them)."""
        self._spec_step = None
        if self.spec is None:
            return
        decoding = [s for s in self.scheduler.running if s.num_uncomputed == 1 and s.output_token_ids]
        seqs = self.spec.select(decoding, self.scheduler.running)
        for seq in decoding:
            seq.clear_drafts()
        drafts = self.spec.propose(seqs, self.sampler.draft_generator)
        for seq, (ids, probs, parents) in zip(seqs, drafts):
            seq.draft_token_ids, seq.draft_probs, seq.draft_parents = ids, probs, parents
        if decoding:
            self._spec_step = bool(seqs)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _check_prompt(self, prompt, params: SamplingParams) -> list[int]:
        return check_prompt(prompt, params, self.tokenizer, self.model.config,
                            self.num_blocks, self.config.block_size)
