"""`GET /metrics`: the server's state and latencies in Prometheus' text format.

Written with `prometheus_client` into a registry of this server's own, so several servers in one
process never count into each other. The names are vLLM's with `minillm:` for `vllm:` (a dashboard
built for one reads the other): gauges of requests and KV usage; counters of tokens (prompt tokens
also by source, computed or cached), outcomes and prefix-cache hits; histograms of latencies (TTFT,
inter-token, TPOT, end-to-end, queue, prefill, decode), request sizes and parameters (n,
max_tokens, the longest completion, prompt tokens computed) and tokens per engine step (vLLM's
`iteration_tokens_total`: prompts whose prefill ended in the step plus the tokens it sampled).
Gauges are read at scrape time (`EngineCollector`, engine_metrics.py: the SLO controller,
speculation, the KV tier, priorities; a feature that is off exports zeros); counters and
histograms are written as requests advance. `GET /dashboard` (dashboard.py) draws them.

Left out on purpose: labels beyond the model name, finish reason, priority, direction and source;
LoRA metrics; prompt tokens from an external KV transfer; multiprocess mode.
"""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from minillm.serve.engine_metrics import EngineCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                   640.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's
N_BUCKETS = (1, 2, 5, 10, 20)                                                      # vLLM's


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's bounds for per-request token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """One server's metrics; the engine loop calls the update methods, `/metrics` calls render."""

    def __init__(self, model_name: str, engine, loop=None):
        self.engine, self.loop, self.model_name = engine, loop, model_name
        self.registry = reg = CollectorRegistry(auto_describe=True)
        m = ["model_name"]

        def gauge(name, help):
            return Gauge(f"minillm:{name}", help, m, registry=reg).labels(model_name)

        def counter(name, help, labels=()):
            c = Counter(f"minillm:{name}", help, m + list(labels), registry=reg)
            return c if labels else c.labels(model_name)

        def hist(name, help, buckets=LATENCY_BUCKETS):
            return Histogram(f"minillm:{name}", help, m, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be admitted (not running).")
        self.swapped = gauge("num_requests_swapped", "Sequences swapped out to CPU memory.")
        self.usage = gauge("kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0 to 1).")
        self.blocks_used = gauge("kv_cache_blocks_in_use", "KV-cache blocks held by sequences.")
        self.blocks_total = gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.prompt = counter("prompt_tokens", "Prompt tokens of requests admitted.")
        self.generation = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Requests finished, by finish reason.",
                               ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Preemptions of finished requests.")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.aborted_ = counter("request_aborted", "Requests aborted (client gone, error or queue timeout).")
        self.rejected_ = counter("request_rejected", "Requests refused because the queue was full.")
        self.queue_timeouts = counter("request_queue_timeouts", "Requests a priority class gave up "
                                      "on after its queue-wait bound (also in request_aborted).")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between two consecutive tokens.")
        self.tpot = hist("time_per_output_token_seconds", "Per request: time per output token after the first.")
        self.req_tpot = hist("request_time_per_output_token_seconds", "Per request: time per output token after the first.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = hist("request_queue_time_seconds", "Arrival to the first step that ran it.")
        self.inference = hist("request_inference_time_seconds", "First step that ran it to last token.")
        self.prefill = hist("request_prefill_time_seconds", "First step that ran it to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to last token.")
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        context = buckets_1_2_5(engine.model.config.max_seq_len)
        self.step_tokens = hist("iteration_tokens_total", "Tokens per engine step: the prompts whose "
                                "prefill ended in it and the tokens it generated.", STEP_BUCKETS)
        self.params_n = hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.",
                                      context)
        self.max_gen = hist("request_max_num_generation_tokens", "Per request: the generated tokens of "
                            "its longest completion.", context)
        self.kv_computed = hist("request_prefill_kv_computed_tokens", "Per request: prompt tokens "
                                "computed (not found in the prefix cache).", context)
        self.by_source = counter("prompt_tokens_by_source", "Prompt tokens by where their KV came "
                                 "from, counted as their prefill ends.", ["source"])
        self.cached = counter("prompt_tokens_cached", "Prompt tokens found in the prefix cache, "
                              "counted as their prefill ends.")
        for source in ("local_compute", "local_cache_hit"):
            self.by_source.labels(model_name, source)
        reg.register(EngineCollector(engine, model_name))

    # ---- written by the engine loop -----------------------------------------------------------
    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def generation_tokens(self, n: int) -> None:
        if n > 0:
            self.generation.inc(n)

    def step(self, prefills: list[tuple[int, int]], generated: int) -> None:
        """An engine step's outputs are in: `prefills` holds (prompt tokens, of them cached) for
        each request whose prefill ended in it, `generated` the tokens it sampled."""
        self.step_tokens.observe(sum(n for n, _ in prefills) + generated)
        cached = sum(c for _, c in prefills)
        self.by_source.labels(self.model_name, "local_compute").inc(sum(n for n, _ in prefills) - cached)
        self.by_source.labels(self.model_name, "local_cache_hit").inc(cached)
        self.cached.inc(cached)

    def aborted(self) -> None:
        self.aborted_.inc()

    def rejected(self) -> None:
        self.rejected_.inc()

    def finished(self, out, params=None) -> None:
        """A request is done: its latencies, outcome, sizes, parameters (its SamplingParams when
        given) and prefix-cache counts."""
        m = out.metrics
        reasons = [c.finish_reason for c in out.outputs]
        if all(r in ("stop", "length") for r in reasons):
            self.success.labels(self.model_name, reasons[0]).inc()
        else:
            self.aborted_.inc()
            if (getattr(out, "error", None) or "").startswith("queue timeout"):
                self.queue_timeouts.inc()
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.req_tpot, m.tpot),
                            (self.e2e, m.e2e), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        first, start, end = m.first_token_time, m.first_scheduled_time, m.finish_time
        for hist, a, b in ((self.inference, start, end), (self.prefill, start, first),
                           (self.decode, first, end)):
            if a is not None and b is not None:
                hist.observe(max(0.0, b - a))
        for a, b in zip(m.token_times, m.token_times[1:]):
            self.itl.observe(max(0.0, b - a))
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.output_len.observe(sum(len(c.token_ids) for c in out.outputs))
        self.max_gen.observe(max((len(c.token_ids) for c in out.outputs), default=0))
        if getattr(out, "error", None) is None:                       # its prompt was computed
            self.kv_computed.observe(len(out.prompt_token_ids) - m.num_cached_tokens)
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens:                                      # 0: a prompt scored only
                self.params_max_tokens.observe(params.max_tokens)
        self.cache_queries.inc(len(out.prompt_token_ids))
        self.cache_hits.inc(m.num_cached_tokens)
        self.preemptions.inc(m.num_preemptions)

    # ---- read -----------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(the text, its content type), the gauges read from the engine now."""
        s, bm = self.engine.scheduler, self.engine.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        queued = self.loop.num_queued if self.loop is not None else 0
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting) + queued)
        self.swapped.set(len(s.swapped))
        self.blocks_used.set(used)
        self.blocks_total.set(bm.num_blocks)
        self.usage.set(used / bm.num_blocks)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, **labels) -> float:
        """One sample's value, e.g. value("request_aborted_total") (0.0 when never written)."""
        v = self.registry.get_sample_value(f"minillm:{name}", {"model_name": self.model_name, **labels})
        return 0.0 if v is None else v
