"""Speculative decoding: exactness by enumeration, greedy equivalence, batching, rollback, bad input,
and the speedup theory against a simulation. The statistical tests are in test_spec_stats.py."""
import itertools

import pytest
import torch

from minillm import generate, generate_naive, tiny_model
from minillm.analysis import spec_theory as th
from minillm.spec import exact_law
from minillm.spec.exact_law import exact_step_law
from minillm.spec.proposers import (DraftModelProposer, NgramProposer, early_exit_model,
                               layer_skip_model)
from minillm.spec.loop import SpecStats, replay_greedy, speculative_generate
from minillm.spec.rejection import greedy_verify, rejection_sample

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


def random_table(V, seed, zero_frac):
    """A context-dependent next-token law: prefix tuple -> (V,) float64 probs with some zeros."""
    gen, table = torch.Generator().manual_seed(seed), {}

    def law(prefix):
        if prefix not in table:
            x = torch.rand(V, generator=gen, dtype=F64)
            x[torch.rand(V, generator=gen) < zero_frac] = 0
            x[torch.randint(V, (1,), generator=gen)] += 0.05 if x.sum() == 0 else 0
            table[prefix] = x / x.sum()
        return table[prefix]
    return law


def target_law(p, length, V):
    """The trusted reference: sample from p one token at a time, law of the first `length`."""
    law = torch.zeros((V,) * length, dtype=F64)
    for y in itertools.product(range(V), repeat=length):
        law[y] = torch.tensor([float(p(y[:i])[y[i]]) for i in range(length)], dtype=F64).prod()
    return law


@pytest.mark.parametrize("V,K", [(2, 1), (3, 2), (4, 3), (6, 2), (6, 3)])
@pytest.mark.parametrize("zero_frac", [0.0, 0.4])
def test_enumeration_one_step_equals_target_law(V, K, zero_frac):
    p, q = random_table(V, 10 * V + K, zero_frac), random_table(V, 99 + K, zero_frac)
    law = exact_step_law(p, q, K, V)
    assert (law - target_law(p, K + 1, V)).abs().max() < 1e-12


def test_enumeration_deterministic_drafter():
    V, K = 5, 3
    p = random_table(V, 3, 0.3)
    guess = random_table(V, 4, 0.0)
    one_hot = lambda prefix: torch.nn.functional.one_hot(guess(prefix).argmax(), V).to(F64)
    assert (exact_step_law(p, one_hot, K, V) - target_law(p, K + 1, V)).abs().max() < 1e-12


def test_enumeration_has_power(monkeypatch):
    """The same enumeration sees a broken residual (resample from p): the check can fail."""
    V, K = 4, 2
    p, q = random_table(V, 1, 0.3), random_table(V, 2, 0.3)
    monkeypatch.setattr(exact_law, "residual_probs", lambda tp, dp, ids: tp)
    assert (exact_step_law(p, q, K, V) - target_law(p, K + 1, V)).abs().max() > 1e-3


def _random_case(B, K, V, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(B, K + 1, V, generator=g, dtype=dtype).pow(3)
    q = torch.rand(B, K, V, generator=g, dtype=dtype).pow(3)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    return p, q, ids


def test_output_format_and_padding():
    p, q, ids = _random_case(64, 4, 7, 0)
    out, n = rejection_sample(p, q, ids, torch.Generator().manual_seed(1))
    assert out.shape == (64, 5) and n.shape == (64,) and 0 <= n.min() and n.max() <= 4
    for b in range(64):
        k = int(n[b])
        assert out[b, :k].tolist() == ids[b, :k].tolist()
        assert 0 <= out[b, k] < 7 and (out[b, k + 1:] == -1).all()


@pytest.mark.parametrize("with_q", [True, False])
def test_batched_equals_per_row_with_same_generators(with_q):
    B, K, V = 6, 3, 9
    p, q, ids = _random_case(B, K, V, 5)
    q = q if with_q else None
    gens = lambda: [torch.Generator().manual_seed(100 + b) for b in range(B)]
    out, n = rejection_sample(p, q, ids, gens())
    for b, g in enumerate(gens()):
        row_out, row_n = rejection_sample(p[b:b + 1], None if q is None else q[b:b + 1],
                                          ids[b:b + 1], [g])
        assert row_out[0].tolist() == out[b].tolist() and int(row_n) == int(n[b])


def test_greedy_is_accept_while_argmax_agrees():
    B, K, V = 32, 3, 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g, dtype=F64)
    best = logits.argmax(-1)
    ids = torch.where(torch.rand(B, K, generator=g) < 0.7, best[:, :K], torch.randint(V, (B, K)))
    out, n = greedy_verify(logits, ids)
    for b in range(B):     # reference: a plain Python loop
        k = 0
        while k < K and ids[b, k] == best[b, k]:
            k += 1
        assert int(n[b]) == k and out[b, :k + 1].tolist() == ids[b, :k].tolist() + [int(best[b, k])]
    one_hot = torch.nn.functional.one_hot(best, V).to(F64)
    out2, n2 = rejection_sample(one_hot, None, ids, torch.Generator().manual_seed(0))
    assert torch.equal(out, out2) and torch.equal(n, n2)


def test_bad_input():
    p, q, ids = _random_case(2, 3, 5, 0)
    with pytest.raises(ValueError, match="K"):
        rejection_sample(p[:, :1], q[:, :0], ids[:, :0])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p, q, ids[:, :2])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, q[:1], ids)
    with pytest.raises(ValueError, match="vocab mismatch"):
        rejection_sample(p, torch.full((2, 3, 4), 0.25, dtype=F64), ids.clamp(max=3))
    with pytest.raises(ValueError, match="target_probs must be finite and >= 0"):
        rejection_sample(p - 0.01, q, ids)
    with pytest.raises(ValueError, match="draft_probs must sum to 1"):
        rejection_sample(p, q * 0.5, ids)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        rejection_sample(p, q, ids + 5)
    with pytest.raises(TypeError, match="LongTensor"):
        rejection_sample(p, q, ids.int())
    with pytest.raises(ValueError, match="list of B = 2"):
        rejection_sample(p, q, ids, [torch.Generator()])
    target, other = tiny_model(vocab_size=16), tiny_model(vocab_size=17, seed=1)
    with pytest.raises(ValueError, match="vocab mismatch"):
        speculative_generate(target, DraftModelProposer(other), [1, 2], 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_generate(target, NgramProposer(), [1, 2], 4, num_speculative_tokens=0)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model(vocab_size=24, seed=0, dtype=F64), tiny_model(vocab_size=24, seed=1, dtype=F64)


def _proposers(target, draft):
    return {"draft": DraftModelProposer(draft), "ngram": NgramProposer(),
            "early_exit": DraftModelProposer(early_exit_model(target, 1)),
            "layer_skip": DraftModelProposer(layer_skip_model(target, [0]))}


@pytest.mark.parametrize("name", ["draft", "ngram", "early_exit", "layer_skip"])
@pytest.mark.parametrize("K", [1, 4])
def test_greedy_spec_equals_plain_greedy_tiny(tiny_pair, name, K):
    target, draft = tiny_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    reference = generate_naive(target, prompt, 30)
    stats = SpecStats()
    out = speculative_generate(target, _proposers(target, draft)[name], prompt, 30,
                               num_speculative_tokens=K, stats=stats)
    assert out == reference
    assert sum(stats.num_accepted) + stats.num_steps == 30


@pytest.mark.parametrize("name", ["draft", "ngram"])
def test_replay_greedy_counts_match_the_real_loop(tiny_pair, name):
    target, draft = tiny_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    stats = SpecStats()
    out = speculative_generate(target, _proposers(target, draft)[name], prompt, 25, 3, stats=stats)
    replay = replay_greedy(_proposers(target, draft)[name], prompt, out, 3)
    assert (replay.num_proposed, replay.num_accepted) == (stats.num_proposed, stats.num_accepted)


def test_timing_replay_runs_the_real_schedule(tiny_pair):
    """spec_replay with the weights that produced the output: the logits accept exactly what the
    schedule says at every step (check=True), and the steps are those of the real loop. With
    another model's output the check fails: the replay is not free to invent its schedule."""
    from minillm.lab.spec_replay import ceiling, replay, schedule
    target, draft = tiny_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]
    out = generate(target, prompt, 30)
    stats = SpecStats()
    assert speculative_generate(target, NgramProposer(min_ngram=2), prompt, 30, 4, stats=stats) == out
    r = replay(target, prompt, out, 4, NgramProposer(min_ngram=2), check=True)
    assert (r["num_proposed"], r["num_accepted"]) == (stats.num_proposed, stats.num_accepted)
    assert sum(stats.num_accepted) > 0 and r["tokens"] == 30
    s = schedule(prompt, out, 4, NgramProposer(min_ngram=2))        # the same without a model
    assert (s["num_proposed"], s["num_accepted"]) == (stats.num_proposed, stats.num_accepted)
    c = ceiling({"prompts": {"p": {"prompt": prompt, "output": out}}}, 4, NgramProposer(min_ngram=2))
    assert c["p"] == c["all"] == pytest.approx(29 / stats.num_steps)
    other = generate(draft, prompt, 30)
    with pytest.raises(AssertionError, match="accepted"):
        replay(target, prompt, other, 4, NgramProposer(min_ngram=2), check=True)


def test_stop_tokens_and_length(tiny_pair):
    target, draft = tiny_pair
    prompt = [3, 1, 4, 1, 5]
    reference = generate(target, prompt, 25)
    stop = reference[7]
    out = speculative_generate(target, NgramProposer(), prompt, 25, 4, stop_token_ids=[stop])
    assert out == reference[:reference.index(stop) + 1]
    for n in (1, 2, 6):
        assert speculative_generate(target, DraftModelProposer(draft), prompt, n, 4) == reference[:n]


def test_draft_cache_rollback_matches_recompute(tiny_pair):
    """The batch-1 cache path (rolled back by position) reports the same q as recomputing without cache."""
    target, draft = tiny_pair
    cached, fresh = DraftModelProposer(draft), DraftModelProposer(draft, use_cache=False)
    contexts = [[1, 2, 3], [1, 2, 3, 7, 7], [1, 2, 9], [1, 2, 9, 4, 4, 4, 4], [5]]
    for i, ctx in enumerate(contexts):
        a = cached.propose([ctx], 3, 0.9, None, None, torch.Generator().manual_seed(i))
        b = fresh.propose([ctx], 3, 0.9, None, None, torch.Generator().manual_seed(i))
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.allclose(a.probs, b.probs, atol=1e-12, rtol=0)
        assert len(cached._slots[-1][1]) == len(ctx) + 2  # context and K-1 drafts fed


def test_draft_proposer_interleaved_sequences(tiny_pair):
    """Engine-style use: one proposer called for several sequences in turn keeps one cache each
    and gives the same q as recomputing from scratch."""
    _, draft = tiny_pair
    shared, fresh = DraftModelProposer(draft, max_cached_seqs=2), DraftModelProposer(draft, use_cache=False)
    seqs = {0: [1, 2, 3], 1: [9, 8, 7, 6], 2: [4, 4]}
    for step in range(4):
        for i, ctx in seqs.items():
            a = shared.propose([ctx], 2, 1.0, None, None, torch.Generator().manual_seed(step))
            b = fresh.propose([ctx], 2, 1.0, None, None, torch.Generator().manual_seed(step))
            assert torch.equal(a.token_ids, b.token_ids)
            assert torch.allclose(a.probs, b.probs, atol=1e-12, rtol=0)
            ctx.append(int(a.token_ids[0, 0]))                   # as if one draft was accepted
    assert len(shared._slots) == 2


def test_ngram_lookup():
    prop = NgramProposer(max_ngram=3)
    assert prop.lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]     # 2-gram (2, 3)
    assert prop.lookup([7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]     # most recent match wins
    assert prop.lookup([1, 2, 3], 4) == []
    out = prop.propose([[1, 2, 3, 1], [5, 6]], 3)
    assert out.token_ids.tolist() == [[2, 3, 1], [6, 6, 6]] and out.num_proposed.tolist() == [3, 0]


@pytest.mark.slow
def test_greedy_spec_equals_plain_greedy_real_model(smollm2):
    from minillm.model.chat import encode_chat
    model, tok = smollm2
    prompt = encode_chat(tok, "Repeat exactly: the quick brown fox jumps over the lazy dog.")
    reference = generate(model, prompt, 32)
    for proposer in (NgramProposer(), DraftModelProposer(layer_skip_model(model, [10, 12, 14]))):
        assert speculative_generate(model, proposer, prompt, 32, num_speculative_tokens=4) == reference


# ---- theory -------------------------------------------------------------------------------

@pytest.mark.parametrize("a,K,c", [(0.0, 3, 0.1), (0.6, 4, 0.2), (0.9, 8, 0.05), (1.0, 2, 0.5)])
def test_speedup_formula_matches_simulation(a, K, c):
    sim = th.simulate_speculation(a, K, c, 200_000, torch.Generator().manual_seed(0))
    assert abs(sim / th.expected_speedup(a, K, c) - 1) < 0.01
    assert abs(th.speedup_from_speed_ratio(a, K, 1 / c) - th.expected_speedup(a, K, c)) < 1e-12
    if K > 0 and c < 1:   # the printed s / (1 + s K) is off for any real drafter
        assert abs(th.article_speedup_printed(a, K, 1 / c) / sim - 1) > 0.05


def test_best_k_and_break_even():
    for a, c in [(0.5, 0.05), (0.8, 0.1), (0.95, 0.02), (0.2, 0.5)]:
        brute = max(range(17), key=lambda k: th.expected_speedup(a, k, c))
        assert th.best_k(a, c) == brute
    # a = 0.3, K = 2, T_S = 0.1 T_L: E[tokens] = 1.39 > cost 1.2, a real speedup of 1.16x,
    # yet the printed inequality a K T_L > K T_S + T_L (0.6 > 1.2) says no.
    assert th.break_even(0.3, 2, 0.1, 1.0) and not th.article_break_even_printed(0.3, 2, 0.1, 1.0)
    assert th.simulate_speculation(0.3, 2, 0.1, 100_000, torch.Generator().manual_seed(1)) > 1.1


def test_speedup_with_prefill():
    # 64 tokens at 2x per step; prefill = 10 target forwards, the draft's own prefill = 20:
    # plain 10 + 64 = 74 units, speculative 10 + 20 + 32 = 62 units -> 74 / 62.
    assert th.speedup_with_prefill(64, 2.0, 10.0, 20.0) == pytest.approx(74 / 62)
    assert th.speedup_with_prefill(64, 2.0, 0.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="num_tokens"):
        th.speedup_with_prefill(0, 2.0, 1.0)


def test_estimate_acceptance_recovers_a():
    g = torch.Generator().manual_seed(0)
    coins = torch.rand(50_000, 4, generator=g) < 0.7
    n = coins.long().cumprod(1).sum(1)
    assert abs(th.estimate_acceptance(n, torch.full_like(n, 4)) - 0.7) < 0.01


def test_adaptive_k_tracks_best_k():
    policy = th.AdaptiveK(c=0.1, decay=0.95)
    th.simulate_policy(policy, [0.9] * 400, 0.1, torch.Generator().manual_seed(0))
    assert abs(policy.k - th.best_k(0.9, 0.1)) <= 2
    h = th.HeuristicK(5)
    h.update(5, 5)
    assert h.k == 7
    h.update(2, 7)
    assert h.k == 6


def test_speculation_runs_up_to_the_context_limit():
    """Review bug B3: the cache was sized prompt + new + K + 1 and a request that fit the context
    exactly (its input check passed) crashed; now it gives exactly generate's tokens."""
    m = tiny_model(vocab_size=32, max_seq_len=64)
    prompt = [1, 2, 3] * 16 + [1, 2]                                    # 50 + 14 = 64 tokens
    for K in (1, 4, 8):
        assert speculative_generate(m, NgramProposer(), prompt, 14, K) == generate(m, prompt, 14)
