"""Speculative decoding (chapter 6): `rejection` (the exact rejection-sampling rule and greedy
verification), `exact_law` (the rule's law by enumeration), `proposer` (the `Proposer` base every
drafter subclasses), `proposers` (n-gram lookup, draft models, self-drafts of the target), `loop`
(the batch-1 speculative loop and its statistics) and `adaptive` (choosing K while decoding).
Chapter 10's token trees: `tree` (the tree shape, a draft, the one-pass tree verify over the
contiguous cache), `tree_rejection` (exact acceptance of a path, Medusa's typical acceptance),
`tree_law` (its law by enumeration), `tree_loop` (the batch-1 tree loop behind
`speculative_generate(..., tree=...)`), `tree_sizing` (tau, speedup, the tree sized for this
machine), and the drafters that need no copy of the model: `heads` (Medusa heads, the EAGLE
drafter), `trained_proposers` (their proposers) and `lookahead` (Jacobi guesses and an n-gram pool
in one token tree). The engine's side: `decoder` (drafts for the engine's sequences), `methods`
(the method names and the proposer each drafts with), `features` (the target's hidden rows kept
per sequence) and `tree_choice` (tree or chain, by measured costs). The formulas it is measured
against are one floor down, in `minillm.analysis.spec_theory`; training the drafters is one floor
up, in `minillm.drafting`."""
