"""A quantized copy of the target drafting for it (chapter 10's quantized self-draft): exact.

The draft model is `quantize(copy.deepcopy(target), "int8" | "int4")` (chapter 7): the same
network with rounded weights, so it guesses the target's tokens often but not always. The
references are the target alone: greedy outputs through the engine and through the batch-1 loop
must equal plain greedy `generate`, and sampled outputs through the engine must follow the
target's exact law (the chi-square test of test_engine_laws.py on a float64 tiny model, with its
uniform-q negative control failing on the same draft).
"""
import copy
import warnings

import pytest
import torch

import minillm.engine.sampler as engine_sampler
from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.model.generate import generate
from minillm.quant.api import is_quantized, quantize
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.spec.proposers import DraftModelProposer
from test_engine_laws import ALPHA, POWER, SPEC, _uniform_draft_probs, engine_samples, pvalue
from test_spec_stats import SMALL, V

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [200, 3]]
N = 24


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)                        # fp32; d_model 64 holds int4's groups of 32


def _copy(model, method, group_size=None):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "no fast int4 kernel")     # the reference path is fine
        q = quantize(copy.deepcopy(model), method, group_size)
    assert is_quantized(q) and not is_quantized(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # target intact
    return q


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_self_draft_greedy_is_plain_greedy(target, method):
    draft = _copy(target, method)
    with torch.inference_mode():
        x = torch.tensor([PROMPTS[2]])
        assert not torch.equal(draft(x), target(x))                     # a copy, not the target
    plain = [generate(target, p, N) for p in PROMPTS]
    cfg = EngineConfig(num_speculative_tokens=3, speculative_method="draft", max_num_seqs=4)
    engine = LLMEngine(target, cfg, draft_model=draft)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0))
    assert [list(o.token_ids) for o in outs] == plain
    s = engine.spec_stats
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens             # it drafted, and was heard
    for p, ref in zip(PROMPTS, plain):
        stats = SpecStats()
        out = speculative_generate(target, DraftModelProposer(draft), p, N, num_speculative_tokens=3,
                                   stats=stats)
        assert out == ref
        assert sum(stats.num_accepted) > 0


@pytest.fixture(scope="module")
def law_target():
    return tiny_model(vocab_size=V, seed=0, dtype=torch.float64, **SMALL)


# int4 in groups of 16 (the model is 16 wide): coarse enough that some drafts are rejected, so
# the residual draw runs too; an int8 copy of this model is accepted nearly always
def test_quantized_self_draft_sampling_follows_the_targets_law(law_target):
    draft = _copy(law_target, "int4", 16)
    samples, engine = engine_samples(law_target, SPEC[0], 1000, seed=50, method="draft", draft=draft)
    s = engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens and s.num_draft_tokens > s.num_spec_steps
    p = pvalue(law_target, samples, SPEC[0])
    print(f"int4 self-draft {SPEC[0]}: p = {p:.4f}, accepted fraction {s.accepted_fraction:.2f}")
    assert p > ALPHA


def test_the_law_test_catches_a_wrong_q_with_this_draft(law_target, monkeypatch):
    monkeypatch.setattr(engine_sampler, "rejection_sample", _uniform_draft_probs)
    samples, _ = engine_samples(law_target, SPEC[0], 1000, seed=50, method="draft",
                                draft=_copy(law_target, "int4", 16))
    assert pvalue(law_target, samples, SPEC[0]) < POWER
