"""Structured output through the engine: the real SmolLM2 and the real grammar (llguidance), in a
batch with unconstrained requests, with and without n-gram speculation. Each constrained answer
validates against its schema (jsonschema, re, the choice list); greedy answers are
token-for-token those of the reference loop (`generate_structured`, one sequence, mask by hand);
the unconstrained neighbours are those of the same engine without any constrained request."""
import json
import re

import jsonschema
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams
from minillm.engine.structured import GrammarState, generate_structured
from minillm.model.chat import encode_chat

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
COLORS = {"type": "object", "additionalProperties": False, "required": ["colors"],
          "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                    "minItems": 2, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[0-9]{4}"
CASES = [   # (prompt, structured params, check of the text)
    ("Give a person as JSON with a name and an age.", StructuredOutputsParams(json=PERSON),
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("List two or three colors as JSON.", StructuredOutputsParams(json=COLORS),
     lambda t: jsonschema.validate(json.loads(t), COLORS) is None),
    ("Give a phone number.", StructuredOutputsParams(regex=REGEX), lambda t: bool(re.fullmatch(REGEX, t))),
    ("What color is the sky?", StructuredOutputsParams(choice=["red", "green", "blue"]),
     lambda t: t in ("red", "green", "blue")),
]
FREE = ["Tell me about the moon.", "Write a haiku about rain."]


@pytest.fixture(scope="module", params=[0, 3], ids=["plain", "ngram3"])
def llm(request, one_thread, smollm2):
    return LLM(*smollm2, max_num_seqs=8, num_speculative_tokens=request.param,
               speculative_method="ngram" if request.param else None)


def _prompts(llm):
    return [encode_chat(llm.get_tokenizer(), p) for p, _, _ in CASES] + \
           [encode_chat(llm.get_tokenizer(), p) for p in FREE]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 11)], ids=["greedy", "sampled"])
def test_constrained_answers_validate_beside_free_ones(llm, temperature, seed):
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=48, temperature=temperature, seed=seed, structured_outputs=s)
              for _, s, _ in CASES] + [SamplingParams(max_tokens=24, temperature=temperature, seed=seed)
                                      for _ in FREE]
    outs = llm.generate(prompts, params)
    for (prompt, _, check), out in zip(CASES, outs):
        assert out.finish_reason == "stop", (prompt, out.text)     # the grammar finished, not cut
        assert check(out.text), (prompt, out.text)
    alone = llm.generate(prompts[len(CASES):], params[len(CASES):])
    assert [o.token_ids for o in outs[len(CASES):]] == [o.token_ids for o in alone]


def test_greedy_constrained_answers_are_the_reference_loops(llm):
    model, tok = llm.model, llm.get_tokenizer()
    for prompt, structured, _ in CASES[:3]:
        ids = encode_chat(tok, prompt)
        want = generate_structured(model, ids, GrammarState.start(structured, tok, model.config.vocab_size),
                                   48, tok.eos_token_id)
        got = llm.generate([ids], SamplingParams(max_tokens=48, structured_outputs=structured))[0]
        if want[-1] == tok.eos_token_id:
            want = want[:-1]          # the engine stops when the grammar is done, before EOS
        assert got.token_ids == want, prompt


def test_the_mask_composes_with_n_and_logprobs(llm):
    out = llm.generate([encode_chat(llm.get_tokenizer(), CASES[0][0])],
                       SamplingParams(max_tokens=48, temperature=0.9, seed=5, n=3, logprobs=2,
                                      structured_outputs=CASES[0][1]))[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
        assert len(c.logprobs) == len(c.token_ids)
        assert all(c.token_ids[i] in c.logprobs[i] for i in range(len(c.token_ids)))
