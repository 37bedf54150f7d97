"""Speculation that steps aside: `speculative_disable_by_batch_size` (vLLM's) and
`speculative_min_seq_len` (seed 001's length condition), decided per step by `SpecDecoder.select`.

References: greedy tokens of plain `generate` (no engine, no drafts) for every drafter (n-gram,
a draft model, seeded random Medusa heads / EAGLE drafter, lookahead) while the running batch
crosses the threshold both ways mid-run; the switch's decisions are read back step by step (a spy
on `select`, the trace's "spec" column, `spec_stats`); a trained drafter still gets the target's
features on a step that follows a skipped one. The sampled law: a step without drafts is plain
sampling and the verifier is exact for any drafts, so switching per step cannot change it; the
chi-square check of test_engine_laws.py confirms it on a run where every sequence decodes
plainly first and then speculates (the draft model's q reaches the verifier).

Tiny float64 models only: the real model is not the point here (its numbers are the benchmark's).
"""
import pytest
import torch

from engine_configs import workload
from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.serve.cli import engine_options, parser
from test_engine_laws import SPEC, pvalue
from test_engine_trained_drafters import drafter_for
from test_spec_stats import LENGTH, PROMPT, SMALL, V

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 3                     # speculative_disable_by_batch_size of these runs
BASE = dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def work(model):
    """6 requests: one alone, four joining it at step 3 (5 running >= LIMIT), then one more that
    runs alone again after they finish; with the greedy references of plain `generate`."""
    prompts, _ = workload(seed=1)
    prompts = prompts[:6]
    max_tokens = [24, 4, 6, 9, 12, 18]
    arrivals = [0, 3, 3, 3, 3, 16]
    return prompts, max_tokens, arrivals, [generate(model, p, k) for p, k in zip(prompts, max_tokens)]



def make_engine(model, method, **switch):
    if method is None:
        return LLMEngine(model, EngineConfig(**BASE))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method in ("medusa", "eagle", "lookahead"):
        spec["model"] = drafter_for(model, method)
    draft = tiny_model(vocab_size=256, seed=1, dtype=torch.float64) if method == "draft_model" else None
    return LLMEngine(model, EngineConfig(**BASE, **switch), draft_model=draft,
                     speculative_config=spec)


def serve(engine, work):
    """Requests added at their arrival steps; returns their token ids in input order."""
    prompts, max_tokens, arrivals, _ = work
    rids, outs, step = {}, {}, 0
    while len(rids) < len(prompts) or engine.has_unfinished_requests():
        for i, a in enumerate(arrivals):
            if a == step:
                rids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i]))
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        step += 1
    assert engine.num_free_blocks == engine.num_blocks
    return [outs[rids[i]] for i in range(len(prompts))]


def spy_select(engine):
    """Record each step's (running requests, decoding [(seq id, tokens)], drafting seq ids)."""
    calls, real = [], engine.spec.select

    def select(decoding, running):
        chosen = real(decoding, running)
        calls.append((len({s.request_id for s in running}), [(s.seq_id, s.num_tokens) for s in decoding],
                      [s.seq_id for s in chosen]))
        return chosen
    engine.spec.select = select
    return calls


@pytest.mark.parametrize("method", ["ngram", "draft_model", "medusa", "eagle", "lookahead"])
def test_greedy_identical_off_always_and_switched(model, work, method):
    refs = work[3]
    assert serve(make_engine(model, None), work) == refs                  # off
    always = make_engine(model, method)
    assert serve(always, work) == refs                                    # always on
    assert always.spec_stats.num_steps_skipped == 0 and always.spec_active
    engine = make_engine(model, method, speculative_disable_by_batch_size=LIMIT)
    calls = spy_select(engine)
    assert serve(engine, work) == refs                                    # switched
    s = engine.spec_stats
    for num_requests, decoding, chosen in calls:      # the rule, step by step
        assert chosen == ([] if num_requests >= LIMIT else [i for i, _ in decoding])
    stepped = [bool(c) for _, d, c in calls if d]
    assert s.num_steps_speculated == sum(stepped) > 0 and s.num_steps_skipped == len(stepped) - sum(stepped) > 0
    # it crossed both ways: speculating, aside under load, speculating again when it thinned
    first_off, last_off = stepped.index(False), len(stepped) - 1 - stepped[::-1].index(False)
    assert any(stepped[:first_off]) and any(stepped[last_off:])
    assert [r["spec"] for r in engine.trace if r["spec"] is not None] == stepped
    assert engine.spec_active == stepped[-1] and s.num_draft_tokens > 0
    assert s.num_draft_tokens < always.spec_stats.num_draft_tokens


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_trained_drafters_read_features_after_a_skipped_step(model, work, method):
    """A skipped step still keeps the target's hidden rows of its new token: every draft call
    (including the first after a step aside) gets the sequence's features, never None."""
    engine = make_engine(model, method, speculative_disable_by_batch_size=LIMIT)
    calls, seen, real = spy_select(engine), [], engine.spec.proposer.propose

    def propose(*args, features=None, **kw):
        seen.append(features[0])
        return real(*args, features=features, **kw)
    engine.spec.proposer.propose = propose
    assert serve(engine, work) == work[3]
    assert seen and all(f is not None for f in seen)
    resumed = [i for i in range(1, len(calls)) if calls[i][2] and calls[i - 1][1] and not calls[i - 1][2]]
    assert resumed, "no step speculated right after a skipped one"


def test_min_seq_len_drafts_only_long_sequences(model, work):
    """Per sequence: in one step a long sequence drafts while a short one decodes plainly."""
    engine = make_engine(model, "ngram", speculative_min_seq_len=30)
    calls = spy_select(engine)
    assert serve(engine, work) == work[3]
    for _, decoding, chosen in calls:
        assert chosen == [i for i, n in decoding if n >= 30]
    assert any(0 < len(c) < len(d) for _, d, c in calls)       # both kinds side by side
    assert engine.spec_stats.num_draft_tokens > 0 and engine.spec_stats.num_steps_skipped > 0


def test_switch_keeps_the_sampled_law(monkeypatch):
    """Speculative sampling with a draft model (its q reaches the verifier), every sequence's
    first decode step aside (6 tokens < speculative_min_seq_len = 7) and its next one drafted:
    the first 3 tokens of 1000 seeded requests against the enumerated law (test_engine_laws)."""
    n, (temperature, top_k, top_p) = 1000, SPEC[1]
    target = tiny_model(vocab_size=V, seed=0, dtype=torch.float64, **SMALL)
    draft = tiny_model(vocab_size=V, seed=1, dtype=torch.float64, **SMALL)
    cfg = EngineConfig(block_size=16, num_blocks=n, max_num_seqs=n, max_num_batched_tokens=8 * n,
                       num_speculative_tokens=2, speculative_method="draft", speculative_min_seq_len=7)
    engine = LLMEngine(target, cfg, draft_model=draft)
    sps = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=LENGTH + 1,
                          seed=41 * 10**6 + i) for i in range(n)]
    outs = engine.generate([PROMPT] * n, sps)
    s = engine.spec_stats
    assert s.num_steps_skipped > 0 and s.num_steps_speculated > 0
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    samples = torch.tensor([o.token_ids[:LENGTH] for o in outs])
    assert pvalue(target, samples, SPEC[1]) > 1e-3


def test_bad_values_and_where_they_come_from(model):
    for value, err in ((1, ValueError), (0, ValueError), (-2, ValueError), ("4", TypeError),
                       (True, TypeError), (2.0, TypeError)):
        with pytest.raises(err, match="speculative_disable_by_batch_size"):
            EngineConfig(speculative_disable_by_batch_size=value)
        with pytest.raises(err, match=r"speculative_config\['disable_by_batch_size'\]"):
            LLMEngine(model, EngineConfig(**BASE), speculative_config={
                "method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": value})
    for value, err in ((0, ValueError), (-1, ValueError), (1.5, TypeError)):
        with pytest.raises(err, match="speculative_min_seq_len"):
            EngineConfig(speculative_min_seq_len=value)
    engine = LLMEngine(model, EngineConfig(**BASE), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert engine.config.speculative_disable_by_batch_size == 4 == engine.spec.disable_by_batch_size
    with pytest.raises(ValueError, match="set it in one place"):
        LLMEngine(model, EngineConfig(**BASE, speculative_disable_by_batch_size=2), speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    args = parser().parse_args(["--speculative-disable-by-batch-size", "4",
                                "--speculative-min-seq-len", "33"])
    opts = engine_options(args)
    assert opts["speculative_disable_by_batch_size"] == 4 and opts["speculative_min_seq_len"] == 33
    plain = LLMEngine(model, EngineConfig(**BASE, speculative_disable_by_batch_size=2))
    assert plain.spec is None and not plain.spec_active     # inert without speculation


def test_lab_compare_runs_the_three_modes_and_picks_a_threshold(tok):
    """`minillm.lab.spec_switch.compare` on a tiny model with SmolLM2's tokenizer: the dict's
    shape, identical greedy outputs in every mode, and the threshold rule on given speedups."""
    from minillm.lab.spec_switch import choose_threshold, compare, spread_lengths
    tiny = tiny_model(vocab_size=len(tok), seed=0)
    r = compare(tiny, tok, batch_sizes=(1, 3), max_tokens=6, k=3)
    assert r["same_outputs"] and r["batch_sizes"] == [1, 3] and len(r["sweep_speedup"]) == 2
    assert (r["low"], r["high"]) == (1, 3)
    assert r["threshold"] in (None, 2, 3) and r["threshold_from"] == "measured"
    assert set(r["modes"]) == {"off", "always", "switch"}
    assert r["modes"]["off"]["high_steps_speculated"] == 0 == r["modes"]["always"]["high_steps_skipped"]
    assert all(r["modes"][m]["high_tokens_per_s"] > 0 for m in r["modes"])
    given = compare(tiny, tok, batch_sizes=(1, 2), max_tokens=4, k=2, threshold=2)
    assert given["threshold"] == 2 and given["modes"]["switch"]["high_steps_skipped"] > 0
    assert given["modes"]["switch"]["low_steps_skipped"] == 0
    assert choose_threshold([1, 2, 4, 8], [1.4, 1.1, 0.9, 0.6]) == 4
    assert choose_threshold([1, 4], [0.9, 0.5]) == 2 and choose_threshold([1, 4], [1.2, 1.1]) is None
    assert choose_threshold([1, 2, 4, 8], [1.4, 0.9, 1.2, 0.8]) == 8
    assert spread_lengths(4, 8) == [8, 7, 6, 5]
