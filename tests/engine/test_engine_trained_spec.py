"""The engine with chapter 10's speculative methods ("medusa", "eagle", "lookahead") against trusted
references: greedy outputs equal `minillm.generate` run alone (tiny float64 model) over block
sizes, chunked prefill, both preemption modes, prefix caching, forks, aborts, stop strings and
max_tokens caps; the features a drafter is handed equal the hidden rows of a dense forward pass
over its context; bad speculative configs are refused before anything is built, and a bad
request leaves its neighbours their exact answers.

The drafters here are stand-ins with the proposer interface (spec/proposer.py): they draft the
target's own greedy continuation with one token made wrong at a place set by the context length,
so drafts are both accepted and rejected, and a drafter that reads features checks them."""
import types

import pytest
import torch

from engine_configs import CONFIGS
from minillm import generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels.flat_forward import flatten
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import Proposal
from tree_drafters import model, work  # noqa: F401 (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3
# drafts take fewer steps, so fewer requests overlap: a smaller pool forces recompute preemption
CONFIGS = {**CONFIGS, "preempt_recompute": dict(block_size=2, num_blocks=28, max_num_seqs=64,
                                                max_num_batched_tokens=64)}


_GREEDY, _HIDDEN = {}, {}          # (model id, context[, k]) -> reference, shared by the tests


def greedy(model, ctx: list[int], k: int) -> list[int]:
    key = (id(model), tuple(ctx), k)
    if key not in _GREEDY:
        _GREEDY[key] = generate(model, ctx, k)
    return list(_GREEDY[key])


def dense_hidden(model, ctx: list[int]) -> torch.Tensor:
    """The final norm's output of a plain forward pass over the whole context: (S, C)."""
    key = (id(model), tuple(ctx))
    if key not in _HIDDEN:
        with torch.no_grad():
            _HIDDEN[key] = model(torch.tensor([ctx]), return_hidden=True)[1][0]
    return _HIDDEN[key]


class StandInDrafter(Proposer):
    """Proposer stand-in: greedy continuation of the target, one token wrong every third call."""

    def __init__(self, model, needs_features: bool, feature_window: int = 1, max_rank: int = 4):
        self.model, self.needs_features = model, needs_features
        self.feature_window, self.max_rank = feature_window, max_rank
        self.checked = self.missing = self.calls = 0

    def propose(self, contexts, k, temperature=0.0, top_k=None, top_p=None, generator=None,
                features=None, key=None):
        assert len(contexts) == 1 and (features is not None) == self.needs_features
        assert (key is not None) == self.keyed
        ctx = list(contexts[0])
        if self.needs_features:
            self._check(ctx, features[0])
        self.calls += 1
        toks = greedy(self.model, ctx, k)
        if len(ctx) % 3 == 0:                                   # a wrong draft: rejected there
            toks[len(ctx) % k] = (toks[len(ctx) % k] + 1) % self.model.config.vocab_size
        return Proposal(torch.tensor([toks]))

    def _check(self, ctx, feats):
        """The rows handed over are the dense forward pass's hidden rows ending at S - 2."""
        if feats is None:
            self.missing += 1
            return
        S, w = len(ctx), len(feats)
        assert 1 <= w <= self.feature_window
        ref = dense_hidden(self.model, ctx)                                       # (S, C)
        atol = 1e-9 if ref.dtype == torch.float64 else 1e-4     # paged vs dense sums in fp32
        torch.testing.assert_close(feats, ref[S - 1 - w:S - 1], atol=atol, rtol=0)
        self.checked += 1


class StandInLookahead(StandInDrafter):
    """Keeps state per sequence, so it is keyed and sees the verify logits, which must be the
    dense forward pass's logits at [last token, drafts]."""

    observed, keyed = 0, True

    def observe_chain(self, context_ids, draft_ids, logits, key=None):
        ids = list(context_ids) + list(draft_ids)
        with torch.no_grad():
            ref = self.model(torch.tensor([ids]))[0, len(context_ids) - 1:]       # (K + 1, V)
        torch.testing.assert_close(logits, ref, atol=1e-9, rtol=0)
        self.observed += 1


DRAFTERS = {"medusa": dict(needs_features=True, feature_window=1),
            "eagle": dict(needs_features=True, feature_window=5),
            "lookahead": dict(needs_features=False)}


def stand_in(model, method):
    return (StandInLookahead if method == "lookahead" else StandInDrafter)(model, **DRAFTERS[method])


def engine_for(model, method, cfg, **spec):
    drafter = stand_in(model, method)
    engine = LLMEngine(model, EngineConfig(**cfg), speculative_config={
        "method": method, "num_speculative_tokens": K, "model": drafter, **spec})
    return engine, drafter


def check_run(engine, drafter, outs, refs):
    assert [o.token_ids for o in outs] == refs
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens      # kept and rejected
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert engine.num_free_blocks == engine.num_blocks
    if drafter.needs_features:
        assert drafter.checked == drafter.calls > 0 and drafter.missing == 0
    if drafter.keyed:                                      # one verify pass per step with drafts
        assert drafter.observed == stats.num_spec_steps > 0


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("method", list(DRAFTERS))
def test_greedy_equals_plain_decoding(model, work, method, name):
    prompts, max_tokens, refs = work
    engine, drafter = engine_for(model, method, CONFIGS[name])
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    check_run(engine, drafter, outs, refs)
    assert [len(o.token_ids) for o in outs] == max_tokens              # max_tokens caps hold
    if "preempt" in name or "swap" in name:
        assert engine.scheduler.num_preemptions > 0
    if not drafter.needs_features:      # the runner is not asked for hidden rows at all
        assert all(s.features is None for r in engine.requests.values() for s in r.seqs)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_flat_forward_paged_rows_give_the_same_features(work, method):
    """The flat loop's `attend_rows` path over the paged cache hands over the same features."""
    flat = flatten(tiny_model(vocab_size=256, seed=0, dtype=torch.float64))
    prompts, max_tokens, refs = work
    engine, drafter = engine_for(flat, method, CONFIGS["prefix_cache_swap"])
    with torch.inference_mode():
        assert flat.flat_ok(torch.zeros(1, 2, dtype=torch.long))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    check_run(engine, drafter, outs, refs)


def test_n_completions_fork_with_their_features(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine, drafter = engine_for(model, "eagle", CONFIGS["bs3_chunk8"])
    out = engine.generate([prompt], SamplingParams(n=3, max_tokens=12))[0]
    assert [c.token_ids for c in out.outputs] == [generate(model, prompt, 12)] * 3
    assert drafter.calls > 3 and drafter.missing == 0 and drafter.checked == drafter.calls


def test_abort_mid_run_leaves_the_others_exact(model, work):
    prompts, max_tokens, refs = work
    engine, drafter = engine_for(model, "medusa", CONFIGS["preempt_swap"])
    params = SamplingParams(max_tokens=20)
    rids = [engine.add_request(p, params) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.abort_request(rids[2])
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.requests[r].output() for r in rids]
    assert outs[2].finish_reason == "abort"
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == \
        [generate(model, p, 20) for i, p in enumerate(prompts) if i != 2]
    assert engine.num_free_blocks == engine.num_blocks and drafter.missing == 0


def test_stop_string_inside_an_accepted_run(tok):
    """A stop string that ends inside a run of accepted drafts cuts the text exactly where plain
    decoding does, and the request stops there."""
    tiny = tiny_model(vocab_size=len(tok), seed=0, dtype=torch.float64)
    prompt = tok.encode("Once upon a time")
    ref = generate(tiny, prompt, 24)
    text = tok.decode(ref)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and stop in text
    cfg = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=24, stop=[stop])
    plain = LLMEngine(tiny, EngineConfig(**cfg), tokenizer=tok).generate([prompt], params)[0]
    for method in DRAFTERS:
        drafter = stand_in(tiny, method)
        engine = LLMEngine(tiny, EngineConfig(**cfg), tokenizer=tok, speculative_config={
            "method": method, "num_speculative_tokens": 4, "model": drafter})
        out = engine.generate([prompt], params)[0]
        assert out.outputs[0].text == plain.outputs[0].text == text[:text.index(stop)]
        assert out.finish_reason == plain.finish_reason == "stop"
        assert engine.spec_stats.num_accepted_tokens > 0


def test_a_token_tree_is_checked_and_its_chain_verified(model, work):
    prompts, max_tokens, refs = work
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]          # JSON's lists, as a server receives
    engine, drafter = engine_for(model, "medusa", CONFIGS["bs1"], speculative_token_tree=tree)
    assert engine.config.speculative_token_tree == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    check_run(engine, drafter, outs, refs)


BAD = [
    ({"method": "medusa2"}, "'medusa', 'eagle', 'lookahead'"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an int >= 1"),
    ({"num_speculative_tokens": 2.5}, r"num_speculative_tokens'\] must be an int >= 1"),
    ({"speculative_token_tree": [(0,), (0, 0, 1)]}, "must be prefix-closed"),
    ({"speculative_token_tree": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]}, "deeper than the 3 tokens"),
    ({"speculative_token_tree": [(0,), (4,)]}, r"rank >= 4"),
    ({"speculative_token_tree": [()]}, "non-empty tuple of ranks"),
    ({"speculative_token_tree": [(0,), (-1,)]}, "non-empty tuple of ranks"),
    ({"speculative_token_tree": "big"}, "speculative_token_tree must be None, 'auto'"),
    ({"speculative_token_tree": []}, "non-empty list of paths"),
    ({"method": "ngram", "speculative_token_tree": [(0,)]}, "needs a method in"),
    ({"model": None}, "use minillm.LLM"),
    ({"model": 3}, "must be a MedusaHeads, a path to one, None or a Proposer"),
    ({"model": types.SimpleNamespace(propose=print)}, "None or a Proposer, got SimpleNamespace"),
]


@pytest.mark.parametrize("change, match", BAD)
def test_bad_speculative_config_is_refused_untouched(model, change, match):
    spec = {"method": "medusa", "num_speculative_tokens": K,
            "model": StandInDrafter(model, needs_features=True), **change}
    before = dict(spec)
    with pytest.raises((ValueError, TypeError), match=match):
        LLMEngine(model, EngineConfig(num_blocks=16), speculative_config=spec)
    assert spec == before                                          # nothing mutated


def test_flat_fields_name_the_methods_and_check_the_tree(model):
    with pytest.raises(ValueError, match="speculative_method must be None or one of"):
        EngineConfig(num_speculative_tokens=2, speculative_method="typical")
    with pytest.raises(ValueError, match="speculative_token_tree needs speculative_method"):
        EngineConfig(num_speculative_tokens=2, speculative_method="ngram",
                     speculative_token_tree=[(0,)])
    with pytest.raises(ValueError, match="use minillm.LLM"):       # flat fields, no heads given
        LLMEngine(model, EngineConfig(num_blocks=16, num_speculative_tokens=2,
                                      speculative_method="medusa"))


def test_a_bad_request_leaves_its_neighbours_exact(model, work):
    prompts, max_tokens, refs = work
    engine, drafter = engine_for(model, "eagle", CONFIGS["prefix_cache_swap"])
    params = [SamplingParams(max_tokens=k) for k in max_tokens]
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params)]
    engine.step()
    for bad in ([], [256], [1] * 600):
        with pytest.raises(ValueError):
            engine.add_request(bad, SamplingParams(max_tokens=4))
    rids += [engine.add_request(p, sp) for p, sp in zip(prompts[4:], params[4:])]
    while engine.has_unfinished_requests():
        engine.step()
    check_run(engine, drafter, [engine.requests[r].output() for r in rids], refs)


# ---- the server ---------------------------------------------------------------------------------
def test_serve_parses_speculative_config_and_hands_it_to_llm(monkeypatch):
    import json

    from minillm import llm as front_door
    from minillm.serve.cli import build_llm, parser
    spec = {"method": "eagle", "num_speculative_tokens": 4, "model": None,
            "speculative_token_tree": [[0], [1], [0, 0]]}
    args = parser().parse_args(["--speculative-config", json.dumps(spec)])
    assert args.speculative_config == spec
    seen = {}
    monkeypatch.setattr(front_door, "LLM", lambda *a, **kw: seen.update(kw))
    build_llm(args)
    assert seen["speculative_config"] == spec
    for bad in ("{method: eagle}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--speculative-config", bad])


def test_serve_with_a_trained_method_answers_as_plain_decoding(tok):
    """Over HTTP: a tiny model served with a medusa stand-in answers what plain decoding does,
    and a bad request beside it is refused while the good one still gets its answer."""
    import httpx
    from minillm.serve import running
    from serve_tiny import MODEL, completion, tiny_llm
    plain = tiny_llm(tok)
    drafter = stand_in(plain.llm_engine.model, "medusa")
    spec = {"method": "medusa", "num_speculative_tokens": 3, "model": drafter}
    body = completion("Once upon a time", max_tokens=12, ignore_eos=True)
    want = plain.generate(["Once upon a time"], SamplingParams(max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    with running(tiny_llm(tok, speculative_config=spec), served_model_name=MODEL) as srv:
        bad = httpx.post(srv.base_url + "/completions", json={**body, "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    assert drafter.calls > 0 and drafter.missing == 0
