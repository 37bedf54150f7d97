"""Scheduling policies the engine switches on by a config field, beside the core they tune:
`static_scheduler` (static batching, chapter 4's baseline), `priority` (classes and queue-wait
bounds, `scheduling_policy="priority"`), `slo_controller` (the P95 budget rule, shared with
chapter 8's offline search, and the loop that moves the token budget towards P95 targets,
`slo_*_p95_ms`) and `prefill_pacer` (prompt chunks sized in time, `prefill_step_target_ms`)."""
