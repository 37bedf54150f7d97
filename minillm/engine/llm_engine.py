"""The serving engine: `LLMEngine.step()` = schedule -> run -> update, over a paged KV cache.

    engine = LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=32))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))      # list[RequestOutput]
    rid = engine.add_request(prompt_ids, params); engine.step(); engine.abort_request(rid)

Pieces: `Sequence` state (sequence.py), `BlockManager` (paging/block_manager.py, no tensors),
`Scheduler` (decides), `ModelRunner` (runs tensors), `Sampler` (logits -> tokens). The engine owns
them and checks requests before anything else sees them; `update_from_output` (step_update.py)
is the one place a step's results land. The features each engine field switches on live in their
own modules: speculation (spec_decoder.py), priorities (priority.py), the SLO controller
(slo_controller.py), the prefill pacer (prefill_pacer.py), structured output (structured.py) and
the host KV tier (paging/host_tier.py). Tensor parallelism is another `runner`
(distributed/tp_runner.py), which `LLM` (llm.py, the front door over the engine) passes in.

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
from minillm.engine.requests import batch_requests, check_prompt, request_state
from minillm.engine.spec_decoder import SpecDecoder, SpecDecodingStats
from minillm.engine.model_runner import ModelRunner, prompt_rows
from minillm.engine.sampler import Sampler
from minillm.engine.policies.prefill_pacer import PrefillPacer
from minillm.engine.policies.priority import PriorityScheduler, apply_queue_timeouts, check_request_priority
from minillm.engine.scheduler import Scheduler
from minillm.engine.policies.slo_controller import SLOController
from minillm.engine.policies.static_scheduler import StaticScheduler
from minillm.engine.step_update import StepUpdate
from minillm.engine.trace import progress_bar
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Request, RequestMetrics, RequestOutput, Sequence, SequenceStatus


class LLMEngine(StepUpdate):
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
        self.sampler = Sampler(param.device, cfg.seed)
        # None, or the loop that moves the scheduler's budget towards the P95 targets
        self.controller = (SLOController(cfg, self.scheduler)
                           if cfg.slo_ttft_p95_ms is not None or cfg.slo_tpot_p95_ms is not None else None)
        # None, or what sizes prompt chunks in time from the steps' own durations (prefill_pacer.py)
        self.pacer = (PrefillPacer(self.scheduler, cfg.prefill_step_target_ms, cfg.block_size)
                      if cfg.prefill_step_target_ms else None)
        self.spec_stats = SpecDecodingStats()      # all zero without speculative decoding
        self.spec_active = False       # whether the last step with decodes speculated (the switch)
        self._spec_step = None         # this step's switch: None (no decodes), True, False
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue a request (token ids, or a str with a tokenizer); returns its request id.
        `priority`: lower is served first; non-zero needs scheduling_policy="priority" (priority.py)."""
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
