"""Pure functions of configs and hardware numbers, no engine: `roofline` (chapter 1),
`kv_math` (chapter 2), `spec_theory` (chapter 6's expected speedups) and `parallel_math`
(chapter 11's collectives, link times and pipeline bubbles)."""
