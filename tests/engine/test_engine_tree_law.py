"""The paged engine verifying token trees at temperature > 0 keeps the target's exact law.

As tests/engine/test_engine_laws.py does for chains: N requests of one prompt on a 5-token float64 tiny
model, the first 3 generated tokens of each one sample of the joint law, compared with the law
enumerated through the target (`exact_target_law`, test_spec_stats.py) by a Pearson chi-square
test. The drafter fills a 5-node tree of depth 2 with a second model's top-ranked tokens at each
node's own context, so candidates are accepted at both ranks, rejected, and the residual is drawn
from; max_tokens = 4 lets the verify after the prefill's token use the whole depth (tokens 2
and 3 come from one tree step). The switch is held in its probe, so every verify is a tree.

Threshold as there: a correct sampler gives p > 1e-3 (fixed seeds: deterministic); the control
breaks `tree_rejection.sibling_rule` inside the engine (after a rejected candidate, draw from the
target's law instead of the residual) and must give p < 1e-6.
"""
import pytest
import torch

from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.spec import tree_rejection
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import Proposal
from minillm.spec.tree import TokenTree, TreeDraft
from test_spec_stats import LENGTH, PROMPT, SMALL, V, chi_square_pvalue, exact_target_law

F64 = torch.float64
ALPHA, POWER = 1e-3, 1e-6
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
PARAMS = [(1.0, None, None), (0.8, 3, 0.9)]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab_size=V, seed=0, dtype=F64, **SMALL)


@pytest.fixture(scope="module")
def ranker():
    return tiny_model(vocab_size=V, seed=1, dtype=F64, **SMALL)


class RankedTreeDrafter(Proposer):
    """Each node's children are the ranker model's top tokens after that node's own context."""
    needs_features, max_rank = False, 2

    def __init__(self, ranker):
        self.ranker, self.memo, self.trees = ranker, {}, 0

    def _top(self, ctx: tuple) -> list[int]:
        if ctx not in self.memo:
            with torch.no_grad():
                logits = self.ranker(torch.tensor([ctx]))[0, -1]                      # (V,)
                self.memo[ctx] = logits.argsort(descending=True).tolist()
        return self.memo[ctx]

    def propose(self, contexts, k, temperature=0.0, top_k=None, top_p=None, generator=None):
        return Proposal(self.propose_tree(contexts[0], None, TokenTree.chain(k)).tokens[None, 1:])

    def propose_tree(self, context_ids, features, tree):
        self.trees += 1
        ctxs, toks = [tuple(context_ids)], [context_ids[-1]]
        for i in range(1, tree.num_nodes):
            parent = ctxs[tree.parents[i]]
            toks.append(self._top(parent)[tree.ranks[i]])
            ctxs.append(parent + (toks[-1],))
        return TreeDraft(torch.tensor(toks), list(tree.parents))


def tree_samples(target, ranker, params, n, seed, seeded):
    temperature, top_k, top_p = params
    drafter = RankedTreeDrafter(ranker)
    cfg = EngineConfig(block_size=16, num_blocks=n, max_num_seqs=n, max_num_batched_tokens=8 * n,
                       seed=seed)
    engine = LLMEngine(target, cfg, speculative_config={
        "method": "medusa", "num_speculative_tokens": 2, "model": drafter,
        "speculative_token_tree": TREE})
    engine.spec.switch.probe_steps = 10**9                  # every verify is a tree
    sps = [SamplingParams(temperature=temperature, top_k=-1 if top_k is None else top_k,
                          top_p=1.0 if top_p is None else top_p, max_tokens=LENGTH + 1,
                          seed=seed * 10**6 + i if seeded else None) for i in range(n)]
    outs = engine.generate([PROMPT] * n, sps)
    assert engine.num_free_blocks == engine.num_blocks and drafter.trees > 0
    return torch.tensor([o.token_ids[:LENGTH] for o in outs]), engine


@pytest.mark.parametrize("params,seeded", [(PARAMS[0], True), (PARAMS[1], False)])
def test_tree_verify_keeps_the_target_law(target, ranker, params, seeded):
    samples, engine = tree_samples(target, ranker, params, 1200, seed=50 + seeded, seeded=seeded)
    sw, s = engine.spec.switch, engine.spec_stats
    assert sw.kept.get((1, 1), 0) > 0 and sw.kept.get((2, 0), 0) > 0   # both ranks, both depths
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    p = chi_square_pvalue(samples, exact_target_law(target, PROMPT, params))
    print(f"tree {params} seeded={seeded}: p = {p:.4f}, accepted {s.accepted_fraction:.2f}")
    assert p > ALPHA


def test_the_law_test_rejects_a_broken_residual(target, ranker, monkeypatch):
    real = tree_rejection.sibling_rule

    def residual_is_target(p, child_tokens):           # accept as before, fall back to p itself
        return real(p, child_tokens)[0], p
    monkeypatch.setattr(tree_rejection, "sibling_rule", residual_is_target)
    samples, _ = tree_samples(target, ranker, PARAMS[0], 1200, seed=60, seeded=True)
    p = chi_square_pvalue(samples, exact_target_law(target, PROMPT, PARAMS[0]))
    print(f"residual_is_target: p = {p:.3g}")
    assert p < POWER
