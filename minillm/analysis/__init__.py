"""Pure functions of configs and hardware numbers, no engine: `roofline` (chapter 1),
`kv_math` (chapter 2), `spec_theory` (chapter 6's expected speedups), `parallel_math`
(chapter 11's collectives, link times and pipeline bubbles), and chapter 11's serving simulator:
`step_fit` (DistServe's step-cost formulas, fitted), `slo` (attainment and goodput), `disagg_sim`
(colocated and disaggregated engines as discrete events) and `disagg_scale` (the roofline's
70B instances, DistServe's max rate, the best prefill:decode split)."""
