"""Medusa heads, the EAGLE drafter, their proposers and their training (chapter 10), on tiny
models. References: the target's own logits (identity heads), a plain causal run of the drafter
(the chain a tree's mask must reproduce), plain greedy decoding (the distilled answers)."""
import re

import pytest
import torch

import minillm
from minillm.drafting.distill import Sample, draft_vocab, generate_answers, record_features
from minillm.drafting.evaluate import sample_accuracy
from minillm.drafting.objectives import unroll
from minillm.drafting.prompts import (CHAT_TRAIN_PROMPTS, EVAL_CHAT_PROMPTS, humaneval_prompts,
                                      stdlib_prompts)
from minillm.drafting.train import Recipe, train_eagle, train_medusa
from minillm.model.generate import generate
from minillm.spec.heads import EagleDrafter, MedusaHeads, weights_fingerprint
from minillm.spec.trained_proposers import EagleProposer, MedusaProposer, context_features
from minillm.spec.tree import TokenTree

TREE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


@pytest.fixture(scope="module")
def model(one_thread):
    return minillm.tiny_model(seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def samples(model):
    g, out = torch.Generator().manual_seed(0), []
    with torch.inference_mode():
        for _ in range(4):
            p = torch.randint(0, 256, (6,), generator=g).tolist()
            ids = p + generate(model, p, 30)
            _, h = model(torch.tensor([ids]), return_hidden=True)
            out.append(Sample(torch.tensor(ids), h[0], len(p)))
    return out


def _siblings_distinct(draft):
    kids = {}
    for i, p in enumerate(draft.parents[1:], start=1):
        kids.setdefault(p, []).append(int(draft.tokens[i]))
    return all(len(set(v)) == len(v) for v in kids.values())


def test_medusa_heads_start_as_the_targets_lm_head(model):
    heads = MedusaHeads(model.config, 3, seed=5).double()
    x = torch.randn(4, model.config.d_model, dtype=torch.float64)
    ref = model.lm_head(x)                                               # (4, V)
    got = heads.logits(x, model.lm_head)                                 # (4, 3, V)
    for k in range(3):
        torch.testing.assert_close(got[:, k], ref)


def test_draft_vocab_logits_are_those_rows_of_the_full_logits(model):
    vocab = torch.tensor([3, 7, 50, 200])
    heads = MedusaHeads(model.config, 2, draft_vocab=vocab).double()
    x = torch.randn(5, model.config.d_model, dtype=torch.float64)
    full = MedusaHeads(model.config, 2).double().logits(x, model.lm_head)   # (5, 2, V)
    small = heads.logits(x, model.lm_head)                               # (5, 2, 4)
    torch.testing.assert_close(small, full[..., vocab])
    assert torch.equal(heads.token_ids(small.argmax(-1)), vocab[full[..., vocab].argmax(-1)])
    with pytest.raises(ValueError, match="draft_vocab"):
        MedusaHeads(model.config, 2, draft_vocab=[1, 1])
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(model.config, 0)


def test_save_load_round_trip_and_mismatches(model, tmp_path):
    heads = MedusaHeads(model.config, 2)
    torch.nn.init.normal_(heads.blocks[0].weight)
    with pytest.raises(ValueError, match="save"):
        heads.save(tmp_path / "h.pt")                                    # no target known
    heads.save(tmp_path / "h.pt", model)
    back = MedusaHeads.load(tmp_path / "h.pt", model)
    assert back.blocks[0].weight.dtype == model.dtype
    for a, b in zip(heads.state_dict().values(), back.state_dict().values()):
        torch.testing.assert_close(a.double(), b.double())
    other = minillm.tiny_model(seed=1, dtype=torch.float64)
    with pytest.raises(ValueError, match="fingerprint.*retrain=True"):
        MedusaHeads.load(tmp_path / "h.pt", other)
    wider = minillm.tiny_model(seed=0, d_model=32, n_head=2, n_kv_head=1)
    with pytest.raises(ValueError, match="hidden_size"):
        MedusaHeads.load(tmp_path / "h.pt", wider)
    with pytest.raises(ValueError, match="'medusa'"):
        EagleDrafter.load(tmp_path / "h.pt", model)
    data = (tmp_path / "h.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        MedusaHeads.load(tmp_path / "cut.pt", model)
    (tmp_path / "junk.pt").write_bytes(b"not a drafter")
    with pytest.raises(ValueError, match="retrain"):
        MedusaHeads.load(tmp_path / "junk.pt", model)


def test_fingerprint_follows_weights_not_dtype(model):
    fp = weights_fingerprint(model)
    assert fp == weights_fingerprint(minillm.tiny_model(seed=0, dtype=torch.float32))
    assert fp != weights_fingerprint(minillm.tiny_model(seed=1, dtype=torch.float64))


def test_eagle_save_load_round_trip(model, tmp_path):
    d = EagleDrafter(model.config, seed=3, draft_vocab=torch.arange(10, 60))
    d.save(tmp_path / "e.pt", model)
    back = EagleDrafter.load(tmp_path / "e.pt", model)
    assert torch.equal(back.draft_vocab, d.draft_vocab)
    torch.testing.assert_close(back.fc.weight, d.fc.weight.double())
    same = EagleDrafter(model.config, seed=3)
    assert torch.equal(same.fc.weight, d.fc.weight)                     # seeded init


def _words(text):
    return re.findall(r"[a-z0-9']+", text.lower())


def test_training_and_evaluation_prompts_share_no_run_of_eight_words():
    def grams(texts):
        out = set()
        for t in texts:
            w = _words(t)
            out |= {tuple(w[i:i + 8]) for i in range(len(w) - 7)}
        return out
    train = CHAT_TRAIN_PROMPTS + humaneval_prompts() + stdlib_prompts()
    assert len(stdlib_prompts()) >= 40 and len(CHAT_TRAIN_PROMPTS) >= 60
    assert not grams(train) & grams(EVAL_CHAT_PROMPTS)
    assert not set(train) & set(EVAL_CHAT_PROMPTS)


def test_medusa_tree_from_identity_heads_is_the_targets_top_k(model):
    ctx = list(range(5, 20))
    prop = MedusaProposer(model, MedusaHeads(model.config, 3))
    draft = prop.propose_tree(ctx, None, TREE)
    # identity heads read the last feature row: the target's distribution after ctx[:-1]
    ref = model(torch.tensor([ctx[:-1]]))[0, -1].topk(3).indices       # (3,)
    assert draft.parents == TREE.parents and int(draft.tokens[0]) == ctx[-1]
    for i in range(1, TREE.num_nodes):
        assert int(draft.tokens[i]) == int(ref[TREE.ranks[i]])
    assert _siblings_distinct(draft)
    with pytest.raises(ValueError, match="speculative_token_tree"):
        prop.propose_tree(ctx, None, TokenTree.chain(4))
    chain = prop.propose([ctx, ctx[:7]], 2)
    assert chain.probs is None and chain.token_ids.shape == (2, 2)
    assert chain.token_ids[0].tolist() == [int(ref[0])] * 2


def test_eagle_tree_matches_a_plain_causal_run_of_the_drafter(model):
    drafter = EagleDrafter(model.config, seed=1).double()
    ctx = list(range(30, 52))
    prop = EagleProposer(model, drafter, window=8)
    feats = context_features(model, ctx)
    draft = prop.propose_tree(ctx, feats, TREE)
    assert draft.parents == TREE.parents and _siblings_distinct(draft)
    assert torch.equal(draft.tokens, prop.propose_tree(ctx, None, TREE).tokens)
    # reference: along the top-1 path a tree's mask is plain causal attention over window + path
    S, lo = len(ctx), len(ctx) - 1 - 8
    f, toks, pos = feats[lo:], ctx[lo + 1:], list(range(lo + 1, S))
    path = []
    with torch.inference_mode():
        for _ in range(3):
            out = drafter(f[None], torch.tensor([toks]), model.embed, torch.tensor(pos))[0]
            nxt = int(model.lm_head(out[-1]).argmax())
            path.append(nxt)
            f, toks, pos = torch.cat([f, out[-1:]]), toks + [nxt], pos + [pos[-1] + 1]
    top1 = [int(draft.tokens[i]) for i in (1, 4, 7)]                    # (0,), (0, 0), (0, 0, 0)
    assert top1 == path
    assert prop.propose([ctx], 3).token_ids[0].tolist() == path
    # and the training layout (unroll) gives the same depth-1 and depth-2 guesses
    with torch.inference_mode():
        lvl = unroll(drafter, feats[lo:], torch.tensor(ctx[lo + 1:] + path[:1]), lo, 2, model.embed)
        assert int(model.lm_head(lvl[0][-1]).argmax()) == path[0]
        assert int(model.lm_head(lvl[1][-1]).argmax()) == path[1]


def test_eagle_dynamic_tree_is_a_tree_within_the_budget(model):
    prop = EagleProposer(model, EagleDrafter(model.config, seed=2).double(), window=6,
                         dynamic=True, dynamic_width=3)
    draft = prop.propose_tree(list(range(40, 60)), None, TREE)
    n = len(draft.parents)
    assert n == draft.tokens.numel() <= TREE.num_nodes and draft.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(draft.parents) if i)
    assert _siblings_distinct(draft)


def test_training_lowers_the_loss_and_is_deterministic(model, samples):
    r = Recipe(steps=50, batch_rows=32, lr=3e-3, eagle_lr=3e-3, eagle_chunk=16)

    def lowered(d):
        losses = d.meta["losses"]                                      # every step (< 50 steps)
        return sum(losses[-8:]) < sum(losses[:8])
    h1 = train_medusa(model, None, 2, recipe=r, samples=samples, progress=False)
    h2 = train_medusa(model, None, 2, recipe=r, samples=samples, progress=False)
    assert lowered(h1)
    assert all(torch.equal(a, b) for a, b in zip(h1.state_dict().values(), h2.state_dict().values()))
    before = sample_accuracy(model, MedusaHeads(model.config, 2).double(), samples)
    assert sum(sample_accuracy(model, h1, samples)["top1"]) > sum(before["top1"])
    e1 = train_eagle(model, None, recipe=r, samples=samples, progress=False, draft_vocab_size=40)
    e2 = train_eagle(model, None, recipe=r, samples=samples, progress=False, draft_vocab_size=40)
    assert lowered(e1) and e1.draft_vocab.numel() == 40
    assert all(torch.equal(a, b) for a, b in zip(e1.state_dict().values(), e2.state_dict().values()))


def test_draft_vocab_is_the_most_frequent_answer_tokens():
    s = [Sample(torch.tensor([9, 9, 1, 1, 1, 2, 2, 3]), torch.zeros(8, 4), 2)]
    assert draft_vocab(s, 10, 2).tolist() == [1, 2]                     # the prompt's 9s don't count


def test_distilled_answers_are_plain_greedy_decoding(tok, one_thread):
    m = minillm.tiny_model(vocab_size=len(tok), seed=0)
    seqs = generate_answers(m, tok, ["Hello there", "Name a colour."], max_tokens=6, progress=False)
    for ids, start in seqs:
        assert ids[start:] == generate(m, ids[:start], 6, stop_token_ids=[tok.eos_token_id])
    (s, _) = record_features(m, seqs, progress=False)
    with torch.inference_mode():
        _, h = m(s.ids[None], return_hidden=True)
    torch.testing.assert_close(s.hidden, h[0].float())


def test_shared_word_runs_counts_what_the_inline_check_finds():
    """The chapter's count against this file's own n-gram check, on sets that do share runs."""
    from minillm.drafting.prompts import shared_word_runs
    a = ["one two three four five six seven eight nine", "Alpha beta"]
    b = ["x ONE two three four five six seven eight, nine!", "nothing shared here at all"]
    assert shared_word_runs(a, b) == 2 and shared_word_runs(a, b, n=9) == 1
    assert shared_word_runs(CHAT_TRAIN_PROMPTS, EVAL_CHAT_PROMPTS) == 0


def test_cached_drafter_finds_what_training_cached_and_never_trains(tok, tmp_path, monkeypatch,
                                                                     one_thread):
    """`cached_drafter` against `train_medusa` / `train_eagle` themselves: None before, the very
    weights they cached after, None for other arguments, and no file written by looking."""
    from minillm.drafting.train import cached_drafter
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    m = minillm.tiny_model(vocab_size=len(tok), seed=0)
    r = Recipe(n_chat=2, n_humaneval=0, n_stdlib=0, max_tokens=6, steps=4, batch_rows=8,
               eagle_chunk=4)
    assert cached_drafter(m, "medusa", r, num_heads=2) is None
    assert cached_drafter(m, "eagle", r) is None
    assert not (tmp_path / "drafters").exists()                        # looking trained nothing
    heads = train_medusa(m, tok, 2, recipe=r, progress=False)
    drafter = train_eagle(m, tok, recipe=r, progress=False)
    files = sorted(p.name for p in (tmp_path / "drafters").iterdir())
    found_h = cached_drafter(m, "medusa", r, num_heads=2)
    found_e = cached_drafter(m, "eagle", r)
    for a, b in ((heads, found_h), (drafter, found_e)):
        assert type(a) is type(b)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert cached_drafter(m, "medusa", r, num_heads=3) is None           # other heads, seed, recipe
    assert cached_drafter(m, "eagle", r, seed=1) is None
    assert cached_drafter(m, "eagle", "small") is None
    assert sorted(p.name for p in (tmp_path / "drafters").iterdir()) == files
    with pytest.raises(ValueError, match="kind"):
        cached_drafter(m, "ngram", r)


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_normalized_inputs_are_rms_norms_before_the_fc(model):
    """Reference: the plain drafter (same seeded fc and layer) fed inputs normalized by hand."""
    d = EagleDrafter(model.config, seed=3, norm_inputs=True).double()
    with torch.no_grad():
        d.feature_norm.weight.uniform_(0.5, 1.5)
        d.token_norm.weight.uniform_(0.5, 1.5)
    plain = EagleDrafter(model.config, seed=3).double()
    eps = model.config.norm_eps
    f = torch.randn(1, 6, 64, dtype=torch.float64) * 3
    t, pos = torch.randint(0, 256, (1, 6)), torch.arange(2, 8)
    with torch.inference_mode():
        got = d(f, t, model.embed, pos)
        ref = plain(_rms(f, d.feature_norm.weight, eps), t,
                    lambda ids: _rms(model.embed(ids), d.token_norm.weight, eps), pos)
        torch.testing.assert_close(got, ref)
        torch.testing.assert_close(d(f * 10, t, model.embed, pos), got, atol=1e-5, rtol=0)  # eps only
        assert not torch.allclose(plain(f * 10, t, model.embed, pos), plain(f, t, model.embed, pos))
    with pytest.raises(TypeError, match="norm_inputs"):
        EagleDrafter(model.config, norm_inputs="yes")


def test_normalized_drafter_files_and_older_files(model, tmp_path):
    """A normalized drafter round-trips as format v2; a file as the older code wrote it (v1, no
    settings) loads without input norms and gives the old outputs; unknown settings and a v2
    file missing its norms are refused in one line."""
    f = torch.randn(1, 5, 64, dtype=torch.float64)
    t, pos = torch.randint(0, 256, (1, 5)), torch.arange(5)
    d = EagleDrafter(model.config, seed=3, norm_inputs=True)
    with torch.no_grad():
        d.token_norm.weight.fill_(0.7)
    d.save(tmp_path / "n.pt", model)
    blob = torch.load(tmp_path / "n.pt", weights_only=True)
    assert blob["format"] == "minillm-drafter-v2" and blob["config"] == {"norm_inputs": True}
    back = EagleDrafter.load(tmp_path / "n.pt", model)
    assert back.norm_inputs and float(back.token_norm.weight[0].detach()) == pytest.approx(0.7)
    old = EagleDrafter(model.config, seed=4)
    state = {k: v.detach().clone() for k, v in old.state_dict().items()}
    torch.save({"format": "minillm-drafter-v1", "kind": "eagle", "hidden_size": 64,
                "vocab_size": 256, "weights_sha256": weights_fingerprint(model), "config": {},
                "meta": {}, "state": state}, tmp_path / "old.pt")
    loaded = EagleDrafter.load(tmp_path / "old.pt", model)
    assert not loaded.norm_inputs and not hasattr(loaded, "feature_norm")
    with torch.inference_mode():
        torch.testing.assert_close(loaded(f, t, model.embed, pos),
                                   old.double()(f, t, model.embed, pos))
    old.save(tmp_path / "plain.pt", model)                              # unnormalized: still v1
    assert torch.load(tmp_path / "plain.pt", weights_only=True)["format"] == "minillm-drafter-v1"
    for name, change in (("unknown settings", {"config": {"norm_inputs": True, "width": 3}}),
                         ("do not fit", {"state": state, "format": "minillm-drafter-v2",
                                         "config": {"norm_inputs": True}})):
        torch.save({**blob, **change}, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=name) as err:
            EagleDrafter.load(tmp_path / "bad.pt", model)
        assert "retrain=True" in str(err.value)
