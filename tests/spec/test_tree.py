"""Token trees: the tree pass against the plain model, commit_path, and the batch-1 tree loop.

References: every node's logits from `tree_forward` equal the logits of the plain model (no
cache, `DenseCausalAttention`) run on prefix + that node's root-to-node path; the tree loop's
greedy output equals plain greedy `generate` token for token; its sampled output passes the
chi-square test against the target's enumerated law (test_spec_stats.py's helpers); the features
a proposer is handed equal the target's own hidden states over the context.
"""
import pytest
import torch

from minillm import KVCache, generate, tiny_model
from minillm.kernels.flat_forward import flatten, unflatten
from minillm.spec.adaptive import WindowedK
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import NgramProposer
from minillm.spec.tree import TokenTree, TreeDraft, commit_path, tree_forward
from test_spec_stats import SMALL, chi_square_pvalue, exact_target_law

F64 = torch.float64
WIDE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


# ---- TokenTree / TreeDraft ------------------------------------------------------------------

def test_token_tree_layout():
    t = TokenTree([(1,), (0, 0), (0,)])
    assert t.paths == [(0,), (1,), (0, 0)] and t.num_nodes == 4
    assert t.parents == [-1, 0, 0, 1] and t.depths == [0, 1, 1, 2] and t.ranks == [-1, 0, 1, 0]
    assert t.children(0) == [1, 2] and t.children(1) == [3] and t.children(3) == []
    m = t.ancestor_mask()
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert TokenTree.chain(3).paths == [(0,), (0, 0), (0, 0, 0)]


@pytest.mark.parametrize("paths,kw,match", [
    ([(0,), (0, 1, 0)], {}, "prefix-closed"), ([], {}, "non-empty"), ([()], {}, "non-empty tuple"),
    ([0, 1], {}, "tuple"), ([(0,), (-1,)], {}, "ranks"), ([(0,), (0,)], {}, "twice"),
    ([(0,), (0, 0)], {"max_depth": 1}, "deeper"), ([(0,), (3,)], {"max_rank": 3}, "rank"),
    ("0,1", {}, "list of paths")])
def test_token_tree_bad_input(paths, kw, match):
    with pytest.raises(ValueError, match="speculative_token_tree") as e:
        TokenTree(paths, **kw)
    assert e.match(match)


def test_tree_draft_checks():
    with pytest.raises(ValueError, match="distinct"):
        TreeDraft(torch.tensor([1, 2, 2]), [-1, 0, 0])
    with pytest.raises(ValueError, match="parents"):
        TreeDraft(torch.tensor([1, 2, 3]), [-1, 2, 0])
    with pytest.raises(TypeError, match="LongTensor"):
        TreeDraft(torch.tensor([1.0, 2.0]), [-1, 0])
    d = TreeDraft.from_tree(WIDE, torch.arange(WIDE.num_nodes))
    p = d.prune(1)
    assert p.tokens.tolist() == [0, 1, 2, 3] and p.parents == [-1, 0, 0, 0]
    assert p.ranks == [-1, 0, 1, 2] and d.first(5).parents == [-1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="ranks"):
        TreeDraft(torch.tensor([1, 2]), [-1, 0], ranks=[0])
    assert d.path_to(9) == [0, 1, 4, 7, 9]


# ---- tree_forward and commit_path -----------------------------------------------------------

def _reference_node_logits(model, prefix, draft):
    rows = []
    for i in range(draft.num_nodes):
        ids = prefix[:-1] + draft.tokens[draft.path_to(i)].tolist()
        rows.append(model(torch.tensor([ids]))[0, -1])                 # no cache: dense attention
    return torch.stack(rows)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@torch.inference_mode()
def test_tree_forward_equals_the_plain_model_on_each_path(flat, dtype):
    model = tiny_model(vocab_size=64, seed=0, dtype=dtype)
    if flat:
        flatten(model)
    prefix = [3, 9, 27, 17, 51, 25]
    gen = torch.Generator().manual_seed(0)
    draft = TreeDraft.from_tree(WIDE, [prefix[-1]] + torch.randint(64, (WIDE.num_nodes - 1,),
                                                                   generator=gen).tolist())
    cache = KVCache(model.config, 1, 32, dtype=dtype)
    model(torch.tensor([prefix[:-1]]), torch.arange(len(prefix) - 1), cache)
    logits, hidden = tree_forward(model, cache, draft, len(prefix) - 1, return_hidden=True)
    assert logits.shape == (WIDE.num_nodes, 64) and hidden.shape == (WIDE.num_nodes, 64)
    ref = _reference_node_logits(model, prefix, draft)
    tol = 1e-10 if dtype == F64 else 1e-4
    assert (logits - ref).abs().max() < tol
    assert torch.equal(tree_forward(model, cache, draft, len(prefix) - 1), logits)
    unflatten(model)


@torch.inference_mode()
def test_commit_path_then_decoding_continues_as_plain():
    model = tiny_model(vocab_size=64, seed=1, dtype=F64)
    prefix = [5, 6, 7, 8]
    draft = TreeDraft.from_tree(WIDE, [prefix[-1], 10, 11, 12, 13, 14, 15, 16, 17, 18])
    cache = KVCache(model.config, 1, 32, dtype=F64)
    model(torch.tensor([prefix[:-1]]), torch.arange(3), cache)
    tree_forward(model, cache, draft, 3)
    path = draft.path_to(8)                                   # [0, 1, 4, 7, 8]: a deep branch
    commit_path(cache, 3, path)
    seq = prefix[:-1] + draft.tokens[path].tolist()
    nxt = [40, 41, 42]
    got = model(torch.tensor([nxt]), torch.arange(len(seq), len(seq) + 3), cache)[0]
    ref = model(torch.tensor([seq + nxt]))[0, -3:]
    assert (got - ref).abs().max() < 1e-10
    with pytest.raises(ValueError, match="root"):
        commit_path(cache, 3, [1, 2])


@pytest.mark.slow
@torch.inference_mode()
def test_tree_forward_on_smollm2(smollm2):
    model, _ = smollm2                            # accelerated: the flat forward, tuned routes
    prefix = [1, 504, 3458, 314, 260, 1345]
    tree = TokenTree([(0,), (1,), (0, 0), (1, 0)])
    draft = TreeDraft.from_tree(tree, [prefix[-1], 253, 282, 1070, 2593])
    cache = KVCache(model.config, 1, 16)
    model(torch.tensor([prefix[:-1]]), torch.arange(len(prefix) - 1), cache)
    logits = tree_forward(model, cache, draft, len(prefix) - 1)
    assert (logits - _reference_node_logits(model, prefix, draft)).abs().max() < 1e-3
    ref = generate(model, prefix, 12)
    assert speculative_generate(model, RandomTreeProposer(model.config.vocab_size), prefix, 12,
                                tree=WIDE) == ref


# ---- stand-in tree proposers ----------------------------------------------------------------

class TopKTreeProposer(Proposer):
    """Fills the tree with the top-ranked tokens of a second model (a stand-in for Medusa), run
    without a cache on context + path for each parent node. Checks the features it is handed."""

    def __init__(self, draft_model, target=None):
        self.model, self.target, self.needs_features = draft_model, target, target is not None
        self.checked = 0

    def propose_tree(self, context, features, tree):
        if self.needs_features:                   # the reference: the target's own hidden states
            _, hid = self.target(torch.tensor([context]), return_hidden=True)
            assert features.shape == (len(context) - 1, hid.shape[-1])
            assert (features - hid[0, :-1]).abs().max() < 1e-9
            self.checked += 1
        toks = [context[-1]]
        for i in range(1, tree.num_nodes):
            path, j = [], tree.parents[i]
            while j > 0:
                path, j = [toks[j]] + path, tree.parents[j]
            ids = context + path
            order = self.model(torch.tensor([ids]))[0, -1].argsort(descending=True)
            toks.append(int(order[tree.ranks[i]]))
        return TreeDraft.from_tree(tree, toks)


class RandomTreeProposer(Proposer):
    """Random distinct siblings, a shape of its own (a dynamic drafter), seeded."""

    def __init__(self, vocab, seed=0):
        self.vocab, self.gen, self.observed = vocab, torch.Generator().manual_seed(seed), 0

    def propose_tree(self, context, features, tree):
        kids = torch.randperm(self.vocab, generator=self.gen)[:3].tolist()
        grand = torch.randperm(self.vocab, generator=self.gen)[:2].tolist()
        return TreeDraft(torch.tensor([context[-1]] + kids + grand), [-1, 0, 0, 0, 1, 1])

    def observe(self, draft, logits, accepted):
        assert logits.shape[0] == draft.num_nodes and accepted[0] == 0
        self.observed += 1


@pytest.fixture(scope="module")
def pair():
    return tiny_model(vocab_size=64, seed=0, dtype=F64), tiny_model(vocab_size=64, seed=1, dtype=F64)


@pytest.mark.parametrize("tree", [None, WIDE, [(0,), (1,)]])
@pytest.mark.parametrize("flat", [False, True])
def test_tree_loop_greedy_equals_plain_greedy(pair, tree, flat):
    target, draft = pair
    if flat:
        flatten(target)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = generate(target, prompt, 40)
    for prop in (TopKTreeProposer(draft), TopKTreeProposer(target), RandomTreeProposer(64)):
        st = SpecStats()
        out = speculative_generate(target, prop, prompt, 40, num_speculative_tokens=3, tree=tree,
                                   stats=st)
        assert out == ref, type(prop).__name__
        assert sum(st.num_accepted) + st.num_steps == 40
    unflatten(target)


def test_tree_loop_features_and_self_draft_counts(pair):
    target, _ = pair
    prop, st = TopKTreeProposer(target, target=target), SpecStats()
    out = speculative_generate(target, prop, [1, 2, 3, 4], 17, tree=WIDE, stats=st)
    assert out == generate(target, [1, 2, 3, 4], 17) and prop.checked == st.num_steps == 4
    acc = st.acceptance_by_position()
    assert all(acc[(d, 0)] == 1.0 for d in range(1, 5)) and acc[(1, 1)] == 0.0   # top-1 always
    assert st.num_proposed[0] == WIDE.num_nodes - 1


def test_statistics_use_the_tree_ranks(pair):
    target, _ = pair
    st = SpecStats()
    speculative_generate(target, TopKTreeProposer(target), [1, 2, 3], 9, tree=[(0,), (2,)], stats=st)
    assert set(st.acceptance_by_position()) == {(1, 0), (1, 2)}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 11])
def test_tree_loop_stops_at_max_new_tokens_and_stop_tokens(pair, n):
    target, _ = pair
    prop = TopKTreeProposer(target)                           # accepts every path: cuts needed
    assert speculative_generate(target, prop, [3, 4, 5], n, tree=WIDE) == generate(target, [3, 4, 5], n)
    ref = generate(target, [3, 4, 5], 30)
    stop = ref[7]
    got = speculative_generate(target, prop, [3, 4, 5], 30, tree=WIDE, stop_token_ids=[stop])
    assert got == generate(target, [3, 4, 5], 30, stop_token_ids=[stop])


def test_tree_loop_runs_up_to_the_context_limit():
    target = tiny_model(vocab_size=64, seed=0, dtype=F64, max_seq_len=24)
    prompt = [1, 2, 3, 4]
    out = speculative_generate(target, TopKTreeProposer(target), prompt, 20, tree=WIDE)
    assert out == generate(target, prompt, 20)


def test_tree_loop_observe_and_bad_input(pair):
    target, _ = pair
    prop = RandomTreeProposer(64)
    speculative_generate(target, prop, [1, 2], 10, tree=WIDE)
    assert prop.observed > 0
    with pytest.raises(ValueError, match="tree"):
        speculative_generate(target, NgramProposer(), [1, 2], 5, tree=WIDE)
    with pytest.raises(ValueError, match="speculative_token_tree"):
        speculative_generate(target, prop, [1, 2], 5, tree=[(0, 0)])
    with pytest.raises(ValueError, match="adaptive_k"):
        speculative_generate(target, prop, [1, 2], 5, tree=WIDE, adaptive_k=WindowedK())


def test_tree_loop_sampling_matches_target_law():
    """The real loop (tree pass, KV commit, exact acceptance) sampled 600 times, 3-token vocab."""
    target = tiny_model(vocab_size=3, seed=0, dtype=F64, **SMALL)
    draft = tiny_model(vocab_size=3, seed=1, dtype=F64, **SMALL)
    tree = TokenTree([(0,), (1,), (0, 0), (1, 0)])
    params, gen = (1.0, None, None), torch.Generator().manual_seed(4)
    prop = TopKTreeProposer(draft)
    s = torch.tensor([speculative_generate(target, prop, [1, 2, 0], 3, temperature=1.0, generator=gen,
                                           tree=tree) for _ in range(600)])
    pvalue = chi_square_pvalue(s, exact_target_law(target, [1, 2, 0], params, vocab=3))
    print(f"tree loop: p = {pvalue:.4f}")
    assert pvalue > 1e-3
