"""Training drafters on the reader's CPU (chapter 10): `prompts` (packaged training prompts and
the held-out evaluation prompts), `distill` (the target's own answers and features),
`objectives` (what Medusa heads and the EAGLE drafter learn), `train` (`train_medusa`,
`train_eagle`, recipes, the cache) and `evaluate` (top-1 / top-5 accuracy per head)."""
