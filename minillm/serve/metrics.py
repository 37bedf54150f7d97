"""`GET /metrics`: the server's state and latencies in Prometheus' text format, written by hand.

The names follow vLLM's (`vllm:num_requests_running` is `minillm:num_requests_running` here), so
a dashboard built for one reads the other. Gauges are read from the engine when scraped; counters
and histograms are updated by the engine loop as requests advance and finish.

A histogram is cumulative buckets `le="..."` (requests at or under each bound), `+Inf`, `_sum`
and `_count`: Prometheus computes percentiles from these (`histogram_quantile`), which is why the
bounds matter: a p99 can only be resolved to the bucket it falls in.

Left out on purpose: labels beyond the model name, summaries, the client library's registry
(one process may run several servers, in a notebook for example).
"""
import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)        # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, c in zip(self.buckets + (float("inf"),), self.counts):
            running += c
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {running}')
        lines += [f"{self.name}_sum{{{labels}}} {self.sum!r}", f"{self.name}_count{{{labels}}} {self.count}"]
        return lines


class ServerMetrics:
    """Counters and histograms of one server; `render(engine)` adds the gauges read now."""

    COUNTERS = {"prompt_tokens_total": "Prompt tokens of finished and running requests.",
                "generation_tokens_total": "Tokens generated.",
                "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
                "prefix_cache_hits_total": "Prompt tokens found in the prefix cache.",
                "request_success_total": "Requests finished (stop or length).",
                "request_aborted_total": "Requests aborted (client gone, error or queue timeout).",
                "request_rejected_total": "Requests refused because the waiting queue was full."}

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Time to first token.")
        self.tpot = Histogram("minillm:time_per_output_token_seconds", "Time per output token after the first.")
        self.e2e = Histogram("minillm:e2e_request_latency_seconds", "Arrival to last token.")

    def add(self, name: str, value: int = 1) -> None:
        self.counters[name] += value

    def finished(self, out) -> None:
        """A request is done: its latencies and the prefix-cache counts of its prompt."""
        m = out.metrics
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
            if value is not None:
                hist.observe(value)
        self.add("prefix_cache_queries_total", len(out.prompt_token_ids))
        self.add("prefix_cache_hits_total", m.num_cached_tokens)
        ok = all(c.finish_reason in ("stop", "length") for c in out.outputs)
        self.add("request_success_total" if ok else "request_aborted_total")

    def render(self, engine, num_pending: int = 0) -> str:
        s, bm = engine.scheduler, engine.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        gauges = {"num_requests_running": (len(s.running), "Sequences in the running batch."),
                  "num_requests_waiting": (len(s.waiting) + num_pending, "Requests waiting to be admitted."),
                  "num_requests_swapped": (len(s.swapped), "Sequences swapped out to CPU memory."),
                  "kv_cache_blocks_in_use": (used, "KV-cache blocks held by sequences."),
                  "kv_cache_blocks_total": (bm.num_blocks, "KV-cache blocks in the pool."),
                  "kv_cache_usage_perc": (used / bm.num_blocks, "Fraction of the KV-cache blocks in use.")}
        lines = []
        for name, (value, help) in gauges.items():
            lines += [f"# HELP minillm:{name} {help}", f"# TYPE minillm:{name} gauge",
                      f"minillm:{name}{{{self.labels}}} {value}"]
        for name, help in self.COUNTERS.items():
            lines += [f"# HELP minillm:{name} {help}", f"# TYPE minillm:{name} counter",
                      f"minillm:{name}{{{self.labels}}} {self.counters[name]}"]
        for hist in (self.ttft, self.tpot, self.e2e):
            lines += hist.render(self.labels)
        return "\n".join(lines) + "\n"
