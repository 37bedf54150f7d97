"""Speculative decoding (chapter 6): `rejection` (the exact rejection-sampling rule and greedy
verification), `proposers` (n-gram lookup, draft models, self-drafts of the target) and `loop`
(the batch-1 speculative loop and its statistics)."""
