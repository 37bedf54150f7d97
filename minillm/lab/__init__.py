"""The instruments the chapters measure with: what notebooks, exercises and tests import to time,
load and replay things on the reader's own machine.

- `common`: careful timing (`time_fn`, `sync`), a prefilled cache for timing forwards, and
  `load_results`, which reads the committed benchmark records of the checkout;
- `measure`, `forward_cost`: this machine's ceilings, matmul points and decode-step costs (ch. 0, 1, 5);
- `verify_cost`: the verify-cost table, forward(N) / forward(1) beside the roofline and the least
  the kernels allow (ch. 1, 6);
- `cuda_graphs`: launch overhead and graph replay (ch. 1, GPU only);
- `paging`: paged attention timed against the block size (ch. 3);
- `workloads`: synthetic request streams replayed through the engine (ch. 4, 5, 8);
- `prompts`: every prompt list the chapters, the demo and the benchmarks share;
- `spec_costs`, `spec_replay`, `spec_report`: what a speculative step costs, the recorded greedy
  schedule (`spec_schedule.json`, package data) and its ceilings, a spec record as text (ch. 6);
- `priority`: the priority mix and the P95-driven token budget (ch. 8);
- `spec_switch`: speculation off, always on and stepping aside under load, its threshold measured (ch. 8);
- `loadgen`, `serve_client`, `serve_metrics`, `datasets`: the HTTP load generator (ch. 8);
- `dashboard`: the server's live dashboard in headless chromium, a screenshot and the numbers shown (ch. 8);
- `attention_decode`, `long_context`: decode attention and its share of a step at long context (ch. 9);
- `step_costs`, `disagg_runs`: this machine's step costs fitted for the simulator, and colocated
  against disaggregated serving measured beside the simulator's prediction (ch. 11);
- `demo`, `serve_demo`: the serving parts of `python -m minillm demo`.

Left out on purpose: anything that writes benchmark records. The record writers, their command
line (`python -m benchmarks NAME`) and the project's own history tools live in the top-level
`benchmarks/` package of the checkout, beside the records in `benchmarks/results/`; they import
this package, never the other way round.
"""
