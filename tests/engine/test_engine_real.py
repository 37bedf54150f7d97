"""The engine on the real model (SmolLM2-135M, fp32): a ragged batch with chunked prefill and
preemption gives every prompt the same greedy tokens as `minillm.generate` alone."""
import pytest

from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.\n", "1, 2, 3, 4,"]


@pytest.mark.slow
def test_real_model_engine_matches_generate(smollm2):
    from minillm import generate
    model, tok = smollm2
    ids = [tok.encode(p) for p in PROMPTS]
    refs = [generate(model, p, 10) for p in ids]
    # 5 blocks of 8 tokens: the 4 prompts (5-11 tokens) with 10 new tokens each need 10 blocks
    # at once, so requests get preempted
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=5, max_num_batched_tokens=8),
                       tokenizer=tok)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert outs[0].text == tok.decode(refs[0])
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_blocks
