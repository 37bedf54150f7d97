"""Chapter 6 exercises (speculative decoding). Numeric answers are judged against minillm's own
functions run on the reader's machine (all of them deterministic: enumerations, float64 tiny
models, the recorded greedy outputs); code exercises run the reader's function through a test that
a planted-broken version fails.

    >>> from minillm import exercises
    >>> exercises.check("06.2", 0.5)              # doctest: +SKIP
    06.2 not yet: that is not it (...); recompute. Hint: ...
"""
import json
from unittest import mock

import torch

from minillm.analysis import spec_theory as th
from minillm.exercises import call_reader as _call, code, numeric
from minillm.spec import exact_law

F64 = torch.float64
# exercise 06.2: two tiny float64 models and a fixed token sequence
TV_SETUP = dict(vocab_size=64, target_seed=0, draft_seed=1, token_ids=list(range(1, 21)), start=5,
                temperature=1.3)
BEST_K_SETUP = dict(prompt="extract", c=0.1, verify_cost=1.5)      # exercise 06.3
CEILING_K = 10                                                     # exercise 06.4
POLICY_STREAM, POLICY_C = ([0.95] * 40 + [0.3] * 40) * 3, 0.2     # exercise 06.5


def _table(V: int, seed: int):
    """A context-dependent law prefix -> (V,) with exact zeros (as in the chapter's section 2)."""
    g, table = torch.Generator().manual_seed(seed), {}

    def law(prefix):
        if prefix not in table:
            w = torch.rand(V, generator=g, dtype=F64) * (torch.rand(V, generator=g) > 0.3)
            w[len(prefix) % V] += 0.01
            table[prefix] = w / w.sum()
        return table[prefix]
    return law


def _test_residual(fn) -> None:
    """fn(p, q) -> the (V,) law to sample after a rejection. Run through the exact step law."""
    V, K = 4, 3
    for seeds in ((1, 2), (3, 4), (5, 6)):
        p_fn, q_fn = _table(V, seeds[0]), _table(V, seeds[1])
        want = exact_law.exact_step_law(p_fn, q_fn, K, V)             # the package's residual

        def residual(tp, dp, ids):                                       # the reader's, per row
            rows = [torch.stack([torch.as_tensor(_call(fn, tp[b, i].clone(), dp[b, i].clone()), dtype=F64)
                                 for i in range(ids.shape[1])]) for b in range(tp.shape[0])]
            return torch.cat([torch.stack(rows), tp[:, ids.shape[1]:]], dim=1)
        with mock.patch.object(exact_law, "residual_probs", residual):
            got = exact_law.exact_step_law(p_fn, q_fn, K, V)
        dev = float((got - want).abs().max())
        assert dev < 1e-9, (f"with your residual the emitted tokens' law differs from the target's "
                            f"by up to {dev:.4f} (tables seeded {seeds})")


code("06.1", "Break it, then fix it: write residual(p, q) -> the (V,) distribution a rejected "
     "draft is replaced from. The check runs the exact law of a K=3 step with it (sampling the "
     "replacement from p, the tempting shortcut, fails).", _test_residual,
     hint="rejection happens where q over-proposes; the replacement makes up where p > q")


def _alpha() -> float:
    from minillm.model.loading import tiny_model
    from minillm.spec.loop import teacher_forced_acceptance
    s = TV_SETUP
    target = tiny_model(vocab_size=s["vocab_size"], seed=s["target_seed"], dtype=F64)
    draft = tiny_model(vocab_size=s["vocab_size"], seed=s["draft_seed"], dtype=F64)
    return teacher_forced_acceptance(target, draft, s["token_ids"], s["start"],
                                     temperature=s["temperature"])["alpha"]


numeric("06.2", f"alpha = 1 - TV: for tiny_model(vocab_size=64, seed=0) as target and seed=1 as "
        f"draft (float64), along token ids {TV_SETUP['token_ids'][0]}..{TV_SETUP['token_ids'][-1]}, "
        f"average sum_x q(x) min(1, p(x)/q(x)) over the next-token laws after the first t tokens, "
        f"t = {TV_SETUP['start']}..{len(TV_SETUP['token_ids']) - 1}, at temperature "
        f"{TV_SETUP['temperature']}. What is it?",
        _alpha, rtol=1e-6,
        hint="recompute both models' next-token laws at the stated temperature, position by position, "
             "and average the per-position acceptance of section 1 (its beta)")


def _recorded() -> dict:
    from minillm.lab.spec_replay import schedule_file
    return json.loads(schedule_file().read_text())


def _schedule(name: str, k: int):
    from minillm.lab.prompts import NGRAM_SETUP
    from minillm.lab.spec_replay import schedule
    from minillm.spec.proposers import NgramProposer
    p = _recorded()["prompts"][name]
    return schedule(p["prompt"], p["output"], k, NgramProposer(min_ngram=NGRAM_SETUP["min_ngram"]))


def _alpha_of(name: str) -> float:
    from minillm.lab.prompts import NGRAM_SETUP
    s = _schedule(name, NGRAM_SETUP["num_speculative_tokens"])
    return th.estimate_acceptance(s["num_accepted"], s["num_proposed"])


def _best_k() -> int:
    s = BEST_K_SETUP
    return th.best_k(_alpha_of(s["prompt"]), s["c"], verify_cost=s["verify_cost"])


numeric("06.3", f"Best K: take the alpha estimate of the recorded '{BEST_K_SETUP['prompt']}' output "
        f"(chapter setup), c = {BEST_K_SETUP['c']} and a verify cost v = {BEST_K_SETUP['verify_cost']} "
        "for any K. Which K from 1 to 16 maximizes the i.i.d. formula's expected speedup?",
        _best_k, rtol=0, atol=0.5,
        hint="recompute the alpha estimate (drafts tested, not drafted), then section 5's expected "
             "speedup with this v for every K; th.best_k takes a verify_cost")


def _ceiling() -> float:
    from minillm.lab.prompts import NGRAM_SETUP
    from minillm.lab.spec_replay import ceiling
    from minillm.spec.proposers import NgramProposer
    return ceiling(_recorded(), CEILING_K, NgramProposer(min_ngram=NGRAM_SETUP["min_ngram"]))["all"]


numeric("06.4", f"Ceiling at another K: with the chapter's n-gram setup but K = {CEILING_K}, what is "
        "the decode-speedup ceiling (free verify and drafting, prefill not counted) over all four "
        "recorded outputs together?", _ceiling, rtol=0.005,
        hint="recompute the four schedules at the new K and pool them as section 4's 'all four "
             "together' line does; tokens per pass is not the ceiling")


def _test_policy(policy_cls) -> None:
    """policy_cls() -> an object with .k and .update(num_accepted, num_proposed); it must beat
    FixedK(4) on a stream whose a alternates 0.95 / 0.3 every 40 steps at c = 0.2, for three seeds."""
    for seed in (0, 1, 2):
        mine = _call(lambda: th.simulate_policy(policy_cls(), POLICY_STREAM, POLICY_C,
                                                torch.Generator().manual_seed(seed)))
        fixed = th.simulate_policy(th.FixedK(4), POLICY_STREAM, POLICY_C, torch.Generator().manual_seed(seed))
        assert mine > fixed, (f"seed {seed}: your policy's speedup {mine:.3f}x does not beat "
                              f"FixedK(4)'s {fixed:.3f}x")


code("06.5", "Policies: write a K policy class (no arguments; .k, .update(num_accepted, "
     "num_proposed)) that beats FixedK(4) when a alternates 0.95 / 0.3 every 40 steps and c = 0.2 "
     "(th.simulate_policy, seeds 0, 1, 2).", _test_policy,
     hint="long K on the easy stretches, short K on the hard ones: react to what was accepted")


def _accepted_fraction() -> float:
    from minillm.lab.prompts import NGRAM_SETUP
    scheds = [_schedule(name, NGRAM_SETUP["num_speculative_tokens"]) for name in _recorded()["prompts"]]
    return sum(sum(s["num_accepted"]) for s in scheds) / sum(sum(s["num_proposed"]) for s in scheds)


numeric("06.6", "Two acceptance numbers: over the four recorded schedules together (chapter setup), "
        "what fraction of all drafted tokens was accepted (accepted / drafted, not alpha, and not "
        "the mean of the four prompts' fractions)?",
        _accepted_fraction, rtol=0.005,
        hint="recompute the four schedules and pool their drafted and accepted counts before "
             "dividing; a step that drafted nothing adds nothing to either")
