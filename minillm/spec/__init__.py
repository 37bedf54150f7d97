"""Speculative decoding (chapter 6): `rejection` (the exact rejection-sampling rule and greedy
verification), `exact_law` (the rule's law by enumeration), `proposers` (n-gram lookup, draft
models, self-drafts of the target), `loop` (the batch-1 speculative loop and its statistics) and
`adaptive` (choosing K while decoding); chapter 10: `lookahead` (lookahead decoding's proposer:
Jacobi guesses and an n-gram pool in one token tree). The formulas it is measured against are
one floor down, in `minillm.analysis.spec_theory`."""
