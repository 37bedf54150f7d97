"""The serving engine: `LLMEngine.step()` = schedule -> run -> update, over a paged KV cache.

    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=32))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))      # list[RequestOutput]
    rid = engine.add_request(prompt_ids, params); engine.step(); engine.abort_request(rid)

The engine owns `BlockManager` (paging/, no tensors), `Scheduler` (decides), `ModelRunner` (runs
tensors), `Sampler` (logits -> tokens) and `OutputProcessor` (output.py: tokens, logprobs, text,
finish reasons -> `RequestOutput`); it checks requests before any of them sees one, and
`update_from_output` is the one place a step's results land. Each feature a config field switches
on is its own module: speculation (spec/decoder.py), policies/ (priorities, the SLO controller,
the prefill pacer), structured output, the host KV tier; tensor parallelism is another `runner`.

Left out on purpose: async serving and HTTP streaming (serve/), pipeline parallelism.
"""
import time
from collections import OrderedDict

from minillm.paging.block_manager import BlockManager
from minillm.paging.host_tier import HostTier
from minillm.paging.sizing import offload_num_blocks, pool_num_blocks
from minillm.engine.config import EngineConfig, apply_speculative_config
from minillm.engine.requests import (batch_requests, check_prompt, check_request,
                                     check_request_priority, request_state)
from minillm.spec.decoder import SpecDecoder, SpecDecodingStats
from minillm.engine.model_runner import ModelRunner, prompt_rows
from minillm.engine.output import OutputProcessor
from minillm.engine.sampler import Sampled, Sampler, SampleRow, sample_rows
from minillm.engine.policies.prefill_pacer import PrefillPacer
from minillm.engine.policies.priority import PriorityScheduler, apply_queue_timeouts
from minillm.engine.scheduler import Scheduler
from minillm.engine.policies.slo_controller import SLOController
from minillm.engine.policies.static_scheduler import StaticScheduler
from minillm.engine.trace import export_trace, progress_bar, prune, trace_row
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
        cfg = self.config
        num_blocks = pool_num_blocks(model, cfg, draft_model)
        # one block beyond the manager's: padding rows (static batching, compiled sizes) write here
        scratch = cfg.scheduling == "static" or cfg.compilation_config is not None
        num_host = offload_num_blocks(model, cfg)   # the host KV tier's slots (0: no tier)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          HostTier(num_host) if num_host else None)
        # the paged pool and what runs on it (tensor_parallel_size > 1: a runner with workers)
        self.runner = runner(model, cfg, num_blocks + scratch, self.block_manager, num_host)
        self.cache = self.runner.cache
        self.spec = (SpecDecoder.from_config(cfg, model, draft_model, drafter)   # None: no drafts
                     if cfg.num_speculative_tokens > 0 else None)
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
                                                getattr(tokenizer, "eos_token_id", None),
                                                model.config.max_seq_len)
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
        check_request(params, self.config.max_num_seqs, self.tokenizer)
        ids = self._check_prompt(prompt, params)
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
        return export_trace(self.config, self.num_blocks, self.trace, self.requests, path)

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
        if hidden is not None:            # a trained drafter's window (spec/decoder.py)
            self.spec.keep_features(out.scheduled, hidden, rows, sampled)
        moves = []                        # token trees' accepted paths: (src, dst) slots
        num_decode, prefill_ids = self._advance(out, t0)
        self.output_processor.add_prompt_logprobs(prompt_logprobs)
        now = self.clock()
        advanced = {}
        for seq, s in zip(self._fork_rows(rows), sampled):
            if s.error is not None:
                self.output_processor.fail(seq, s.error, now, self.step_count)
                self.scheduler.remove(seq)         # its blocks go back at once
            else:
                if s.num_drafts:              # rejected drafts roll back (spec/decoder.py)
                    moves += self.spec.settle(seq, s, self.block_manager,
                                              (self.requests[seq.request_id].metrics, self.spec_stats))
                self._append(seq, s.token_ids, now, s.logprobs)
            advanced[seq.request_id] = self.requests[seq.request_id]
        if moves:                         # before any later step reads, swaps or offloads them
            self.runner.move_slots(*zip(*moves))
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
        return sample_rows(seqs, self.requests)     # what the sampler draws, in order (sampler.py)

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
            child = parent.child(self._new_seq_id(), i)     # shares the prompt's blocks
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            req.seqs.append(child)
        req.forked = True

    def _draft(self) -> None:
        """Drafts before the scheduler books their blocks, and the step's switch (spec/decoder.py)."""
        if self.spec is not None:
            self._spec_step = self.spec.draft(self.scheduler.running, self.sampler.draft_generator)

    def _count_spec_step(self) -> None:
        """The switch's decision this step (None: no decodes, or no speculation): in the trace
        row ("spec"), kept as `spec_active`, counted in `spec_stats`."""
        decision = self.trace[-1]["spec"] = self._spec_step
        self._spec_step = None
        if decision is not None:
            self.spec_active = decision
            self.spec_stats.num_steps_speculated += decision
            self.spec_stats.num_steps_skipped += not decision

    # ---- internals --------------------------------------------------------------------------
    def _operate(self, now: float) -> list:
        """Before a step is scheduled (chapter 8's appendix): the SLO controller's decision when due,
        the classes' queue-wait bounds, idle cached blocks to the host tier. Returns who timed out."""
        ctl = self.controller
        if ctl is not None:
            ctl.tick(now)              # a decision every slo_interval_s; nothing in between
        classes = self.config.priority_classes if ctl is None else ctl.priority_classes
        timed_out = (apply_queue_timeouts(self.scheduler, self.requests, classes, now,
                                          self.step_count) if classes else [])
        if self.block_manager.host_tier is not None:   # idle cached blocks -> host (offload.py)
            self.block_manager.offload_idle(now, self.config.offload_idle_s)
        return timed_out

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _check_prompt(self, prompt, params: SamplingParams) -> list[int]:
        return check_prompt(prompt, params, self.tokenizer, self.model.config,
                            self.num_blocks, self.config.block_size)
