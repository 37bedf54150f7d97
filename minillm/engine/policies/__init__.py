"""Scheduling policies the engine switches on by a config field, each beside the core it tunes:
`static_scheduler` (static batching, the chapter 4 baseline), `priority` (classes and queue-wait
bounds, `scheduling_policy="priority"`), `slo_controller` (moves the token budget towards P95
targets, `slo_*_p95_ms`), `slo` (the P95 and budget rule it shares with chapter 8's offline
search) and `prefill_pacer` (prompt chunks sized in time, `prefill_step_target_ms`)."""
