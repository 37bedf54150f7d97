"""The EAGLE drafter's key/value cache (eagle_runs.py), on a tiny float64 model with seeded random
drafters. References: a plain causal run of the drafter over every row (`EagleDrafter.forward`),
and the proposer that reruns the window at every depth (`kv_cache=False`, `WindowRun`)."""
import pytest
import torch

import minillm
from minillm.spec.eagle_runs import CachedRun, Draft, WindowRun
from minillm.spec.heads import DraftKV, EagleDrafter
from minillm.spec.trained_proposers import EagleProposer, context_features
from minillm.spec.tree import TokenTree

TREE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
DEEP = TokenTree([(0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 1, 0), (0, 0, 0, 0)])


@pytest.fixture(scope="module")
def model(one_thread):
    return minillm.tiny_model(seed=0, dtype=torch.float64)


def _drafter(model, seed, norm=False):
    d = EagleDrafter(model.config, seed=seed, norm_inputs=norm).double()
    if norm:                                      # scales that are not all ones
        with torch.no_grad():
            d.feature_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
            d.token_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + 1))
    return d


@pytest.mark.parametrize("norm", [False, True])
def test_keys_values_then_extend_is_a_plain_causal_run(model, norm):
    """Rows split in two: the first reduced to keys/values, the rest run with `extend` under a
    causal mask, give what one causal forward over all rows gives."""
    d = _drafter(model, 4, norm)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1, 11, 64, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, 256, (1, 11), generator=g)
    pos = torch.arange(5, 16)
    with torch.inference_mode():
        ref = d(f, t, model.embed, pos)[0]                                  # (11, C)
        kv = DraftKV()
        kv.append(*d.keys_values(f[:, :7], t[:, :7], model.embed, pos[:7]))
        got = [d.extend(f[:, 7:9], t[:, 7:9], model.embed, pos[7:9], kv,
                        torch.ones(2, 9, dtype=torch.bool).tril(7))[0]]
        for i in (9, 10):                                                   # one row at a time
            got.append(d.extend(f[:, i:i + 1], t[:, i:i + 1], model.embed, pos[i:i + 1], kv,
                                torch.ones(1, i + 1, dtype=torch.bool))[0])
    torch.testing.assert_close(torch.cat(got), ref[7:], rtol=1e-10, atol=1e-10)
    assert kv.rows == 11
    with pytest.raises(ValueError, match="mask"):
        d.extend(f[:, :1], t[:, :1], model.embed, pos[:1], kv, torch.ones(1, 11, dtype=torch.bool))


def _outputs(run, tree, width_tokens):
    """Drive a runner through `tree` level by level with fixed tokens; the expanded nodes'
    outputs, in expansion order."""
    draft, outs = Draft([width_tokens[0]]), []
    for d in range(1, max(tree.depths) + 1):
        level = [i for i in range(1, tree.num_nodes) if tree.depths[i] == d]
        par = sorted({tree.parents[i] for i in level})
        rows = run(draft, par)
        outs.append(rows)
        for i in level:
            draft.add(width_tokens[i], tree.parents[i], rows[par.index(tree.parents[i])])
    return torch.cat(outs)


@pytest.mark.parametrize("norm", [False, True])
def test_cached_run_gives_the_references_features_and_probabilities(model, norm):
    d = _drafter(model, 7, norm)
    ctx = list(range(30, 52))
    prop = EagleProposer(model, d, window=8)
    feats = context_features(model, ctx)
    tokens = [ctx[-1]] + [(11 * i) % 256 for i in range(1, DEEP.num_nodes)]
    with torch.inference_mode():
        ref_win = EagleProposer(model, d, window=8, kv_cache=False)._runner(ctx, feats)
        win = prop._runner(ctx, feats)
        assert isinstance(win, CachedRun) and isinstance(ref_win, WindowRun)
        ref, got = _outputs(ref_win, DEEP, tokens), _outputs(win, DEEP, tokens)
        lp_ref = d.vocab_logits(ref, model.lm_head).log_softmax(-1)
        lp_got = d.vocab_logits(got, model.lm_head).log_softmax(-1)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lp_got, lp_ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="already run"):
        win(Draft([ctx[-1]]), [0])


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("window", [1, 5, 32])
def test_cached_proposer_drafts_what_the_reference_drafts(model, norm, window):
    """Chains K = 1..4, two static trees and EAGLE-2's dynamic tree, over several contexts."""
    d = _drafter(model, 3, norm)
    g = torch.Generator().manual_seed(1)
    ctxs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 9, 40)]
    for dynamic in (False, True):
        fast = EagleProposer(model, d, window=window, dynamic=dynamic, dynamic_width=3)
        ref = EagleProposer(model, d, window=window, dynamic=dynamic, dynamic_width=3,
                            kv_cache=False)
        for ctx in ctxs:
            for tree in (TREE, DEEP):
                a, b = fast.propose_tree(ctx, None, tree), ref.propose_tree(ctx, None, tree)
                assert a.parents == b.parents and torch.equal(a.tokens, b.tokens)
    for k in (1, 2, 3, 4):
        fast = EagleProposer(model, d, window=window)
        ref = EagleProposer(model, d, window=window, kv_cache=False)
        assert torch.equal(fast.propose(ctxs, k).token_ids, ref.propose(ctxs, k).token_ids)
    with pytest.raises(TypeError, match="kv_cache"):
        EagleProposer(model, d, kv_cache=1)


def test_drafting_costs_times_every_case(model):
    """Shape of the record only (timing never decides a test)."""
    from minillm.lab.drafting_runs import drafting_costs
    r = drafting_costs(model, _drafter(model, 0), ks=(1, 2), context=12, rounds=1, window=4)
    assert r["plain_ms"] > 0 and set(r["cached"]) == set(r["no cache"]) == {1, 2}
    assert r["cached per_token"][2] == pytest.approx(r["cached"][2] / 2 / r["plain_ms"])


@pytest.mark.parametrize("norm", [False, True])
def test_stable_window_keys_values_equal_a_fresh_window(model, norm):
    """Contexts of one sequence growing by 2, 1, 0 and 4 tokens, and another sequence between
    them: the kept-and-extended keys and values equal `keys_values` of the whole window computed
    afresh, and only the rows accepted since the last proposal are computed."""
    from minillm.spec.eagle_runs import StableWindow
    d, W = _drafter(model, 5, norm), 5
    g = torch.Generator().manual_seed(4)
    seq, other = torch.randint(0, 256, (40,), generator=g).tolist(), torch.randint(0, 256, (30,),
                                                                                 generator=g).tolist()
    stable = StableWindow(slots=2)
    computed = []
    for ctx in (seq[:10], other[:9], seq[:12], seq[:13], seq[:13], other[:11], seq[:17]):
        S = len(ctx)
        f = context_features(model, ctx)[-W:]                             # (W, C)
        win = f, torch.tensor(ctx[S - W:]), torch.arange(S - W, S)
        before = stable.rows_computed
        kv = stable.keys_values(d, model.embed, ctx, win)
        k, v = d.keys_values(f[None, :-1], win[1][None, :-1], model.embed, win[2][:-1])
        torch.testing.assert_close(kv.k, k)
        torch.testing.assert_close(kv.v, v)
        computed.append(stable.rows_computed - before)
    assert computed == [4, 4, 2, 1, 0, 2, 4]          # seq[:17] starts past what seq[:13] kept
    with pytest.raises(ValueError, match="slots"):
        StableWindow(slots=0)


@pytest.mark.parametrize("window", [1, 5, 32])
def test_proposals_along_a_sequence_draft_what_the_reference_drafts(model, window):
    """The proposer with its stable window, called as decoding calls it (each context the last
    plus what was accepted), against the reference that reruns the window every time."""
    d = _drafter(model, 6, norm=True)
    seq = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    for dynamic in (False, True):
        fast = EagleProposer(model, d, window=window, dynamic=dynamic, dynamic_width=3)
        ref = EagleProposer(model, d, window=window, dynamic=dynamic, dynamic_width=3,
                            kv_cache=False)
        S = 3
        for grow in (1, 3, 2, 1, 4, 1, 2, 5, 1, 3):
            S += grow
            a, b = fast.propose_tree(seq[:S], None, DEEP), ref.propose_tree(seq[:S], None, DEEP)
            assert a.parents == b.parents and torch.equal(a.tokens, b.tokens)
        assert fast.stable.rows_reused > 0 or window == 1
        fast.reset()
        assert not fast.stable.kept
