"""The instruments the chapters measure with: what notebooks, exercises and tests import to time,
load and replay things on the reader's own machine.

- `common`, `measure`, `forward_cost`, `verify_cost`, `cuda_graphs`: timing, this machine's
  ceilings and step costs, the verify-cost table, launch overhead (ch. 0, 1, 5, 6);
- `paging`, `workloads`, `prompts`: paged attention timed, request streams, shared prompts (3-5);
- `spec_costs`, `spec_replay`, `spec_report`, `spec_switch`: speculation's costs, the recorded
  schedule, its report, and stepping aside under load (ch. 6, 8);
- `priority`, `loadgen`, `serve_client`, `serve_metrics`, `datasets`, `dashboard`: the priority
  mix and the HTTP load generator and its readings (ch. 8);
- `attention_decode`, `long_context`: decode attention at long context (ch. 9);
- `step_costs`, `disagg_runs`: step costs for the simulator, disaggregated serving measured (11);
- `demo`, `serve_demo`: the serving parts of `python -m minillm demo`.

Left out on purpose: anything that writes benchmark records. The record writers, their command
line (`python -m benchmarks NAME`) and the project's own history tools live in the top-level
`benchmarks/` package of the checkout, beside the records in `benchmarks/results/`; they import
this package, never the other way round.
"""
