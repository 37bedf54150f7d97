"""Pure functions of configs and hardware numbers, no engine: `roofline` (chapter 1),
`kv_math` (chapter 2) and `spec_theory` (chapter 6's expected speedups)."""
