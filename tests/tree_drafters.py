"""A stand-in tree proposer for the engine's tree tests (test_engine_tree.py, test_compiled_steps.py):
it drafts from the target's own greedy continuation, with the right token at each depth placed at
a rank set by the context length (0, 1, or 2: none of a rank-0/1 tree's), so verified paths end
early, late, and through rank-1 siblings. It checks any features it is handed against a dense
forward pass's hidden rows. It also holds the fixtures the engine's speculative tests share: the
tiny float64 target (`model`) and the workload with each prompt's plain greedy continuation
(`work`), the trusted reference those tests compare against."""
import pytest
import torch

from engine_configs import workload
from minillm import generate, tiny_model
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import Proposal
from minillm.spec.tree import TokenTree, TreeDraft


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def work(model):
    """(prompts, max_tokens, references): `minillm.generate` run alone on each prompt."""
    prompts, max_tokens = workload()
    return prompts, max_tokens, [generate(model, p, k) for p, k in zip(prompts, max_tokens)]


class TreeDrafter(Proposer):
    """Proposer stand-in with propose_tree; checks the features it is handed (if it reads them)."""
    feature_window, max_rank = 4, 2

    def __init__(self, model, needs_features: bool = True):
        self.model, self.needs_features, self.trees, self.checked = model, needs_features, 0, 0

    def propose(self, contexts, k, temperature=0.0, top_k=None, top_p=None, generator=None,
                features=None):
        feats = features[0] if features is not None else None
        draft = self.propose_tree(list(contexts[0]), feats, TokenTree.chain(k))
        return Proposal(draft.tokens[None, 1:])

    def propose_tree(self, context_ids, features, tree):
        ctx = list(context_ids)
        if features is not None:
            with torch.no_grad():
                ref = self.model(torch.tensor([ctx]), return_hidden=True)[1][0]     # (S, C)
            w = len(features)
            torch.testing.assert_close(features, ref[len(ctx) - 1 - w:len(ctx) - 1], atol=1e-9,
                                       rtol=0)
            self.checked += 1
        self.trees += tree != TokenTree.chain(tree.depth)
        g = generate(self.model, ctx, tree.depth)
        right = [(len(ctx) + d) % 3 for d in range(1, tree.depth + 1)]   # rank 2: not in the tree
        toks, on = [ctx[-1]], [True]
        for i in range(1, tree.num_nodes):
            d, r, par = tree.depths[i], tree.ranks[i], tree.parents[i]
            hit = on[par] and r == right[d - 1]
            toks.append(g[d - 1] if hit else (g[d - 1] + 1 + r) % self.model.config.vocab_size)
            on.append(hit)
        return TreeDraft(torch.tensor(toks), list(tree.parents))
