"""What the engine keeps itself, exported at scrape time: a prometheus_client custom collector.

`ServerMetrics` (metrics.py) writes counters as requests finish; the values here the engine
already counts (speculation's `spec_stats`, the SLO controller's moves, the host tier's `stats`)
or only the engine knows now (per-priority queues, cached blocks, the token budget). Copying them
would be a second place that applies a step, so `EngineCollector.collect` reads them when
`/metrics` is scraped: the slo_* series (budget, queue bounds, moves, P95s and targets),
spec_decode_* (vLLM's drafts, draft and accepted token counts, the switch), cache_config_info
(vLLM's info gauge: block size, blocks, prefix caching), kv_cache_blocks_cached / _free,
kv_offload_* (the host pool and its traffic) and num_requests_{running,waiting}_by_priority. Every
read is None-safe: a feature that is off exports the same names with 0, or no sample where a
value is unknown. Queues are copied with one C-level `tuple(...)` before they are read, since the
engine steps in another thread.

Left out on purpose: vLLM's per-position acceptance counts and LoRA gauges.
"""
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def _num(value, default=0.0) -> float:
    return default if value is None else float(value)


def _queue(q) -> tuple:
    try:
        return tuple(q or ())
    except RuntimeError:                  # mutated while copied (a non-deque queue): skip once
        return ()


class EngineCollector:
    """Reads `engine` (an LLMEngine, or anything with some of its parts) at each scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):
        return list(self._families(live=False))

    def collect(self):
        return list(self._families(live=True))

    # ---- one helper per kind of family ----------------------------------------------------------
    def _gauge(self, name, help, value):
        """One gauge; no sample when the value is unknown (None)."""
        g = GaugeMetricFamily(f"minillm:{name}", help, labels=["model_name"])
        if value is not None:
            g.add_metric([self.model_name], float(value))
        return g

    def _labelled(self, kind, name, help, label, values: dict):
        fam = kind(f"minillm:{name}", help, labels=["model_name", label])
        for key, value in values.items():
            fam.add_metric([self.model_name, str(key)], float(value))
        return fam

    def _counter(self, name, help, value):
        c = CounterMetricFamily(f"minillm:{name}", help, labels=["model_name"])
        c.add_metric([self.model_name], float(value))
        return c

    def _families(self, live: bool):
        e = self.engine if live else None
        yield from self._slo(getattr(e, "controller", None), getattr(e, "scheduler", None),
                             getattr(e, "config", None))
        yield from self._spec(e)
        yield from self._config(e)
        yield from self._kv(getattr(e, "block_manager", None))
        yield from self._priorities(e)

    # ---- the features ---------------------------------------------------------------------------
    def _slo(self, ctl, scheduler, config):
        budget = getattr(ctl, "budget", None)
        if budget is None:
            budget = getattr(scheduler, "max_num_batched_tokens", None)
        yield self._gauge("slo_max_num_batched_tokens", "The scheduler's token budget per step now "
                          "(the SLO controller moves it; fixed without one).", budget)
        if ctl is not None:
            bounds = dict(getattr(ctl, "queue_timeouts", None) or {})
        else:
            bounds = {c.priority: c.max_queue_wait for c in getattr(config, "priority_classes", ())
                      if c.max_queue_wait is not None}
        yield self._labelled(GaugeMetricFamily, "slo_queue_timeout_seconds",
                             "Each priority class's queue-wait bound now.", "priority", bounds)
        moves = dict(getattr(ctl, "num_adjustments", None) or {})
        yield self._labelled(CounterMetricFamily, "slo_adjustments", "The SLO controller's budget "
                             "moves.", "direction", {d: moves.get(d, 0) for d in ("down", "up")})
        p95, targets = dict(getattr(ctl, "p95", None) or {}), dict(getattr(ctl, "targets", None) or {})
        for key in ("ttft", "tpot"):
            yield self._gauge(f"slo_{key}_p95_seconds", f"The {key.upper()} P95 the SLO controller "
                              "measured in its last window.", p95.get(key))
            yield self._gauge(f"slo_{key}_p95_target_seconds", f"The SLO controller's {key.upper()} "
                              "P95 target.", targets.get(key))

    def _spec(self, e):
        stats = getattr(e, "spec_stats", None)
        yield self._counter("spec_decode_num_drafts", "Drafts verified: one per sequence and step "
                            "that verified drafts.", _num(getattr(stats, "num_spec_steps", 0)))
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                            _num(getattr(stats, "num_draft_tokens", 0)))
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            _num(getattr(stats, "num_accepted_tokens", 0)))
        active = getattr(e, "spec_active", None)
        if active is None:                               # no switch: on whenever it is configured
            active = getattr(e, "spec", None) is not None
        yield self._gauge("spec_decode_enabled", "1 when the last engine step speculated.", int(active))
        yield self._counter("spec_decode_steps_speculated", "Engine steps with decodes that "
                            "speculated.", _num(getattr(stats, "num_steps_speculated", 0)))
        yield self._counter("spec_decode_steps_skipped", "Engine steps with decodes where "
                            "speculation stepped aside.", _num(getattr(stats, "num_steps_skipped", 0)))

    def _config(self, e):
        info = GaugeMetricFamily("minillm:cache_config_info", "The KV cache's configuration (the "
                                 "labels; the value is 1).", labels=["model_name", "block_size",
                                 "num_gpu_blocks", "enable_prefix_caching"])
        config, bm = getattr(e, "config", None), getattr(e, "block_manager", None)
        if config is not None and bm is not None:
            info.add_metric([self.model_name, str(config.block_size), str(bm.num_blocks),
                             str(bool(config.enable_prefix_caching))], 1.0)
        yield info

    def _kv(self, bm):
        cached = _num(getattr(bm, "num_evictable_blocks", 0))
        total = _num(getattr(bm, "num_blocks", 0))
        free = _num(getattr(bm, "num_free_blocks", 0))
        yield self._gauge("kv_cache_blocks_cached", "Unreferenced blocks whose KV is still cached "
                          "(evictable).", cached)
        yield self._gauge("kv_cache_blocks_free", "Blocks that hold nothing.", max(0.0, free - cached))
        tier = getattr(bm, "host_tier", None)
        yield self._gauge("kv_offload_blocks_in_use", "Host-tier blocks holding KV.",
                          _num(getattr(tier, "num_used", 0)))
        yield self._gauge("kv_offload_blocks_total", "Host-tier blocks.",
                          _num(getattr(tier, "num_blocks", 0)))
        stats = dict(getattr(tier, "stats", None) or {})
        for key, help in (("stored", "Blocks copied to the host tier."),
                          ("restored", "Blocks copied back from the host tier on a prefix hit."),
                          ("evicted", "Host-tier blocks dropped (LRU)."),
                          ("idle_offloaded", "Cached blocks moved to the host tier after idling.")):
            yield self._counter(f"kv_offload_{key}_blocks", help, _num(stats.get(f"{key}_blocks", 0)))

    def _priorities(self, e):
        config, s = getattr(e, "config", None), getattr(e, "scheduler", None)
        if getattr(config, "scheduling_policy", None) != "priority" and e is not None:
            return
        counts = {kind: {c.priority: 0 for c in getattr(config, "priority_classes", ())}
                  for kind in ("running", "waiting")}
        for kind in counts:
            for seq in _queue(getattr(s, kind, None)):
                p = getattr(seq, "priority", 0)
                counts[kind][p] = counts[kind].get(p, 0) + 1
        for kind, what in (("running", "in the running batch"), ("waiting", "waiting (the "
                           "scheduler's queue; not yet handed to the engine: in the total only)")):
            yield self._labelled(GaugeMetricFamily, f"num_requests_{kind}_by_priority",
                                 f"Sequences {what}, by priority.", "priority", counts[kind])
