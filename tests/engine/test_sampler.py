"""The engine's sampler and the one place that applies its results.

References: the seed rule written out here by hand (a generator seeded with
hash((seed, completion index, k)) & (2**63 - 1) draws token k; the drafter's stream sits at
k + 10**6), `torch.multinomial` and `rejection_sample` called directly with it, and a dense
forward pass of the whole context for the logits. The sampler must change no sequence; the engine
must keep every sequence's computed count and its blocks in step after each verify."""
import math
import random

import pytest
import torch

from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampler import SampleRow, Sampler
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Sequence
from minillm.spec.decoder import SpecDecoder
from minillm.model.sampling import logits_to_probs
from minillm.spec.rejection import rejection_sample

F64 = torch.float64
V = 64

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


def rule(seed: int, index: int, k: int) -> torch.Generator:
    """The seed rule, by hand: the generator of token k of completion `index`."""
    return torch.Generator().manual_seed(hash((seed, index, k)) & (2**63 - 1))


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=V, seed=0, dtype=F64)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(vocab_size=V, seed=1, dtype=F64)


def _seq(params, output=(), drafts=(), index=0, prompt=(1, 2, 3)):
    seq = Sequence(index, "r", list(prompt), params, 0.0, index=index)
    seq.output_token_ids, seq.draft_token_ids = list(output), list(drafts)
    return seq


def test_seeded_plain_tokens_follow_the_rule(model):
    """Every token of every seeded completion in a chunked, batched run is the draw the rule's
    generator makes from the target's law given the tokens before it (a dense forward pass)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    params = [SamplingParams(temperature=0.9, top_k=20 if i % 2 else -1, top_p=0.95,
                             max_tokens=6, seed=10 + i, n=2 if i == 1 else 1) for i in range(4)]
    engine = LLMEngine(model, EngineConfig(block_size=3, num_blocks=100, max_num_batched_tokens=8))
    for prompt, p, out in zip(prompts, params, engine.generate(prompts, params)):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            for k, tok in enumerate(c.token_ids):
                with torch.inference_mode():
                    logits = model(torch.tensor([prompt + c.token_ids[:k]]))[0, -1]       # (V,)
                probs = logits_to_probs(logits[None].float(), p.temperature, p.top_k, p.top_p)
                assert tok == int(torch.multinomial(probs, 1, generator=rule(p.seed, c.index, k)))


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_and_drafts_use_the_same_rule(with_q):
    """A verify row that produces token k draws with the rule's generator for k, exactly as a
    direct `rejection_sample` call with it; the drafter's generator is the rule at k + 10**6."""
    g = torch.Generator().manual_seed(0)
    K, k = 3, 5
    p = SamplingParams(temperature=0.8, top_k=30, seed=7, max_tokens=20)
    seq = _seq(p, output=range(k), drafts=[4, 9, 4], index=1)
    if with_q:
        seq.draft_probs = torch.softmax(torch.randn(1, K, V, generator=g, dtype=F64), -1)
    logits = torch.randn(K + 1, V, generator=g, dtype=F64)                        # (K+1, V)
    sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(2):                                   # the same draw every time it is asked
        got = sampler.sample([SampleRow(seq, 1, 0)], logits)[0]
        target = logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p)   # (1, K+1, V)
        toks, n = rejection_sample(target, seq.draft_probs, torch.tensor([seq.draft_token_ids]),
                                   generator=rule(7, 1, k))
        assert got.token_ids == toks[0, :int(n) + 1].tolist() and got.num_drafts == K
        assert got.num_accepted + got.num_rejected == K
    assert sampler.draft_generator(seq).initial_seed() == rule(7, 1, k + 10**6).initial_seed()
    assert sampler.generator_for(SamplingParams(), 0, 0) is sampler.generator     # unseeded: shared


def test_unseeded_rows_share_one_stream_verifies_first():
    """Unseeded rows draw from the engine's generator: drafting rows first, then plain rows."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g, dtype=F64)            # row 0 plain, rows 1-3 verify
    p = SamplingParams(temperature=1.0, max_tokens=20)
    plain, drafting = _seq(p, output=[1]), _seq(p, output=[1], drafts=[2, 3])
    got = Sampler(torch.device("cpu"), seed=5).sample(
        [SampleRow(plain, 0, 0), SampleRow(drafting, 0, 1)], logits)
    ref = torch.Generator().manual_seed(5)
    toks, n = rejection_sample(logits_to_probs(logits[None, 1:], 1.0), None, torch.tensor([[2, 3]]), ref)
    first = int(torch.multinomial(logits_to_probs(logits[:1].float(), 1.0), 1, generator=ref))
    assert got[1].token_ids == toks[0, :int(n) + 1].tolist() and got[0].token_ids == [first]


def test_sampling_changes_nothing_and_a_bad_row_harms_nobody():
    logits = torch.randn(5, V, dtype=F64)
    logits[1] = float("nan")
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=20)
    seqs = [_seq(p, output=[7]), _seq(p, output=[7], index=1), _seq(p, output=[7], drafts=[1, 2])]
    before = [(s.output_token_ids[:], s.draft_token_ids[:], s.num_computed_tokens, s.error, s.status)
              for s in seqs]
    rows = [SampleRow(seqs[0], 0, 0), SampleRow(seqs[1], 1, 1), SampleRow(seqs[2], 0, 2)]
    out = Sampler(torch.device("cpu")).sample(rows, logits)
    assert out[1].token_ids == [] and out[1].error.split(":")[0] in ("RuntimeError", "ValueError")
    assert out[0].error is None and len(out[0].token_ids) == 1
    assert out[2].error is None and 1 <= len(out[2].token_ids) <= 3
    assert [(s.output_token_ids, s.draft_token_ids, s.num_computed_tokens, s.error, s.status)
            for s in seqs] == before


def test_the_spec_decoder_only_proposes(draft):
    """Drafts come back as values; no sequence is changed by proposing."""
    spec = SpecDecoder("draft", 3, draft, max_seq_len=64)
    p = SamplingParams(temperature=1.0, seed=1, max_tokens=6)
    seqs = [_seq(p, output=[5, 6]), _seq(p, output=[5, 6, 7, 8, 9])]     # room for 3 and for 0
    drafts = spec.propose(seqs, Sampler(torch.device("cpu")).draft_generator)
    assert len(drafts[0][0]) == 3 and drafts[0][1].shape == (1, 3, V) and drafts[1] == ([], None, None)
    assert all(s.draft_token_ids == [] and s.draft_probs is None for s in seqs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_speculation_does_not_depend_on_the_batch(model, draft, method):
    """A seeded request's speculative output is the same alone and in a batch, chunked or not,
    as long as its drafts fit every step (a step that cannot fit them decodes one plain token:
    preemption or a tight budget changes which steps speculate, so the tokens, not their law)."""
    rng = random.Random(0)
    base = [rng.randrange(V) for _ in range(5)]
    prompts = [(base * 6)[:rng.randint(4, 28)] for _ in range(6)]
    params = [SamplingParams(temperature=0.8, top_k=16 if i % 2 else -1, max_tokens=6 + 3 * i,
                             seed=50 + i, n=2 if i == 3 else 1) for i in range(len(prompts))]

    def run(cfg, ps, pr):
        engine = LLMEngine(model, EngineConfig(**cfg, num_speculative_tokens=3,
                                               speculative_method=method),
                           draft_model=draft if method == "draft" else None)
        outs = engine.generate(pr, ps)
        assert not any(r["num_preempted"] for r in engine.trace)
        return [[c.token_ids for c in o.outputs] for o in outs], engine.spec_stats

    runs = [run(dict(block_size=4, num_blocks=200), [p], [q]) for p, q in zip(params, prompts)]
    alone = [r[0][0] for r in runs]
    # max_num_seqs * (K + 1) <= max_num_batched_tokens: every decoding sequence's drafts fit
    for cfg in (dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64),
                dict(block_size=3, num_blocks=200, max_num_seqs=2, max_num_batched_tokens=8)):
        got, stats = run(cfg, params, prompts)
        assert stats.num_spec_steps == sum(r[1].num_spec_steps for r in runs), cfg  # same steps drafted
        assert got == alone, cfg
        assert stats.num_accepted_tokens > 0


def test_a_sequence_that_drafts_nothing_samples_as_without_speculation(model):
    """In a speculative engine, a seeded request whose n-gram lookup never matches gets exactly
    the tokens of an engine without speculation, while its (greedy) neighbours speculate."""
    rng = random.Random(1)
    base = [rng.randrange(V) for _ in range(4)]
    prompts = [(base * 8)[:24], [3, 17, 40, 22, 9], (base * 5)[:15], [61, 5, 33]]
    params = [SamplingParams(max_tokens=12) if i % 2 == 0 else
              SamplingParams(temperature=0.7, max_tokens=12, seed=90 + i) for i in range(4)]
    cfg = dict(block_size=4, num_blocks=200)
    plain = LLMEngine(model, EngineConfig(**cfg)).generate(prompts, params)
    engine = LLMEngine(model, EngineConfig(**cfg, num_speculative_tokens=3, prompt_lookup_min=2))
    spec = engine.generate(prompts, params)
    assert [o.metrics.num_draft_tokens > 0 for o in spec] == [True, False, True, False]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_counts_and_blocks_stay_in_step_after_every_verify(model, draft, method):
    """After each step every running sequence's computed count is the block manager's, its
    table holds exactly the blocks of its tokens, and the metrics add up to the engine's stats."""
    rng = random.Random(3)
    base = [rng.randrange(V) for _ in range(6)]
    prompts = [(base * 5)[:rng.randint(3, 25)] for _ in range(6)]
    engine = LLMEngine(model, EngineConfig(block_size=3, num_blocks=60, max_num_batched_tokens=24,
                                           num_speculative_tokens=3, speculative_method=method,
                                           enable_prefix_caching=True),
                       draft_model=draft if method == "draft" else None)
    for i, pr in enumerate(prompts):        # greedy requests accept n-gram drafts, sampled ones reject
        engine.add_request(pr, SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=15, seed=i))
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert not seq.draft_token_ids
            assert bm.num_computed_tokens(seq.seq_id) == seq.num_computed_tokens
            assert len(bm.block_table(seq.seq_id)) == math.ceil(bm.num_tokens(seq.seq_id) / 3)
            assert seq.num_computed_tokens <= seq.num_tokens - 1
    m = [r.metrics for r in engine.requests.values()]
    s = engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert (sum(x.num_spec_steps for x in m), sum(x.num_draft_tokens for x in m),
            sum(x.num_accepted_tokens for x in m)) == (s.num_spec_steps, s.num_draft_tokens,
                                                       s.num_accepted_tokens)
    assert engine.num_free_blocks == engine.num_blocks
    # one meaning of acceptance_rate: the request metrics' alias of accepted / drafted
    assert any(0 < (x.accepted_fraction or 0) < 1 for x in m)
    assert all(x.acceptance_rate == x.accepted_fraction == (x.num_accepted_tokens / x.num_draft_tokens
               if x.num_draft_tokens else None) for x in m)
    assert s.accepted_fraction == s.num_accepted_tokens / s.num_draft_tokens
