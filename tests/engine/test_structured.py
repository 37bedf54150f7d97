"""Structured output (minillm.engine.structured): the grammar state against its contract, and a
schema suite where the real SmolLM2 decodes under the mask, greedy and sampled, and every answer
is checked by a trusted reference (json.loads + jsonschema.validate, re.fullmatch, `in`).

The state tests need only the tokenizer; the suite loads the model (marked slow)."""
import json
import re

import jsonschema
import pytest
import torch

import minillm
from minillm.engine import structured
from minillm.engine.structured import GrammarState, StructuredOutputsParams, generate_structured
from minillm.model.chat import encode_chat
from minillm.model.generate import generate

V = 49152                               # SmolLM2's logits width


def _obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


# (name, prompt, schema): short answers, each kind of constraint at least once
SCHEMAS = [
    ("required_fields", "Give a person as JSON with a name and an age.",
     _obj({"name": {"type": "string", "maxLength": 12},
           "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("nested_object", "Give a user as JSON: a user object with an id and an email.",
     _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "email": {"type": "string", "maxLength": 20}})})),
    ("array_min_max", "List two or three colors as JSON.",
     _obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 8},
                      "minItems": 2, "maxItems": 3}})),
    ("enum", "What size is an elephant? Answer in JSON.",
     _obj({"size": {"enum": ["small", "medium", "large"]}})),
    ("integer_bounds", "In what year did the first person walk on the moon? Answer in JSON.",
     _obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}})),
    ("string_pattern", "Give today's date as JSON.",
     _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("string_max_length", "Name a city as JSON.",
     _obj({"city": {"type": "string", "minLength": 2, "maxLength": 10}})),
    ("any_of", "Give a value as JSON: a number or a short word.",
     _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                               {"type": "string", "maxLength": 10}]}})),
    ("boolean_null", "Is water wet? Answer in JSON with a boolean and a null note.",
     _obj({"answer": {"type": "boolean"}, "note": {"type": "null"}})),
    ("top_level_array", "Give three digits as a JSON array.",
     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
      "minItems": 3, "maxItems": 3}),
]
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: NUM " + " NUM\nNUM: /[0-9]{1,3}/'



def person(tok) -> GrammarState:
    return GrammarState.start(StructuredOutputsParams(json=SCHEMAS[0][2]), tok, V)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --- the state, with the tokenizer alone -------------------------------------------------------

def test_allowed_rows_equal_accepting_the_drafts_one_by_one(tok):
    state = person(tok)
    state.accept(ids(tok, '{"name": "'))
    drafts = ids(tok, 'Bob", "age": 4') + ids(tok, "x") + ids(tok, '2}')   # "x" is refused
    k = len(ids(tok, 'Bob", "age": 4'))
    rows = state.allowed(drafts)
    assert rows.shape == (len(drafts) + 1, V) and rows.dtype == torch.bool
    ref = state.fork()
    for j in range(k + 1):                 # rows up to the refused draft: accept one by one
        assert torch.equal(rows[j], ref.allowed()[0]), j
        if j < k:
            ref.accept(drafts[j:j + 1])
    assert not rows[k, drafts[k]]          # the refused draft was masked in its own row
    assert rows[k + 1:].all()              # rows after it: all True (never used)


def test_allowed_leaves_the_state_unchanged(tok):
    state = person(tok)
    state.accept(ids(tok, '{"name": "Al'))
    before = state.allowed()[0].clone()
    answer = ids(tok, 'ice", "age": 30}')
    rows = state.allowed(answer + [tok.eos_token_id] * 3)   # EOS after the end, several times
    assert rows[len(answer)].sum() == 1 and rows[len(answer), tok.eos_token_id]
    assert torch.equal(state.allowed()[0], before) and not state.done
    state.accept(answer)                   # and the state still goes on from where it was
    assert state.done
    assert json.loads('{"name": "Alice", "age": 30}') == {"name": "Alice", "age": 30}


def test_done_allows_only_eos_and_accepts_eos(tok):
    state = GrammarState.start(StructuredOutputsParams(choice=CHOICES), tok, V)
    assert not state.done
    state.accept(ids(tok, "green"))
    assert state.done
    row = state.allowed()[0]
    assert row.sum() == 1 and row[tok.eos_token_id]
    state.accept([tok.eos_token_id, tok.eos_token_id])
    assert state.done


def test_fork_is_independent(tok):
    a = person(tok)
    a.accept(ids(tok, '{"name": "'))
    b = a.fork()
    row_a = a.allowed()[0].clone()
    b.accept(ids(tok, 'Bob", "age": 7}'))
    assert b.done and not a.done
    assert torch.equal(a.allowed()[0], row_a)
    a.accept(ids(tok, 'Eve", "age"'))
    assert b.allowed()[0].sum() == 1                 # b still done, untouched by a


def test_refused_token_raises_and_changes_nothing(tok):
    state = person(tok)
    state.accept(ids(tok, '{"name": "Bob", '))
    before = state.allowed()[0].clone()
    bad = ids(tok, '"age": x')
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        state.accept(bad)                            # "age": accepted, then x refused
    assert torch.equal(state.allowed()[0], before)
    with pytest.raises(ValueError):
        state.accept([V + 5])                        # an id the tokenizer does not have


def test_rows_are_the_models_width(tok):
    wide = GrammarState.start(StructuredOutputsParams(regex="[a-z]+"), tok, V + 64)
    row = wide.allowed()[0]
    assert row.shape == (V + 64,) and not row[V:].any() and row[:V].any()
    narrow = GrammarState.start(StructuredOutputsParams(regex="[a-z]+"), tok, 1000)
    assert torch.equal(narrow.allowed()[0], row[:1000])


def test_the_mask_matches_what_the_grammar_says(tok):
    """Each allowed token of a regex row, decoded, extends a string the regex can finish."""
    state = GrammarState.start(StructuredOutputsParams(regex=REGEX), tok, V)
    state.accept(ids(tok, "12"))
    allowed = state.allowed()[0].nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch(r"[0-9]{1,2}(-[0-9]{0,4})?|-[0-9]{0,4}",
                                        tok.decode([t])) for t in allowed)
    assert set(allowed) >= {ids(tok, d)[0] for d in "0123456789"}


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json"),
    (StructuredOutputsParams(json='{"type": "object"'), "structured_outputs.json"),
    (StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/nope"}}}),
     "structured_outputs.json"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(("}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(("), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar"),
])
def test_bad_grammar_is_a_value_error_naming_the_field(tok, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        GrammarState.start(params, tok, V)


def test_bad_arguments(tok):
    with pytest.raises(TypeError, match="tokenizer"):
        GrammarState.start(StructuredOutputsParams(json_object=True), None, V)
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        GrammarState.start({"json_object": True}, tok, V)
    with pytest.raises((TypeError, ValueError), match="vocab_size"):
        GrammarState.start(StructuredOutputsParams(json_object=True), tok, 0)


def test_a_schema_compiles_once(tok, monkeypatch):
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}}
    built = []
    original = structured.llguidance.LLMatcher

    class Counting:
        def __new__(cls, *args, **kwargs):
            built.append(args[1])
            return original(*args, **kwargs)
        grammar_from_json_schema = staticmethod(original.grammar_from_json_schema)

    monkeypatch.setattr(structured.llguidance, "LLMatcher", Counting)
    states = [GrammarState.start(StructuredOutputsParams(json=given), tok, V)
              for given in (schema, json.dumps(schema), schema)]   # dict or str: one grammar
    assert len(built) == 1
    states[1].accept(ids(tok, '{"only_here": 1}'))    # each start is its own copy of the cache's
    assert states[1].done and not states[0].done and not states[2].done
    assert torch.equal(states[0].allowed(), states[2].allowed())
    first = states[2].allowed()
    states[0].accept(ids(tok, '{"'))                 # the state compiled first, too
    fresh = GrammarState.start(StructuredOutputsParams(json=schema), tok, V)
    assert torch.equal(fresh.allowed(), first)


# --- the schema suite: the real model decodes under the mask -----------------------------------

@pytest.fixture(scope="module")
def real(one_thread, smollm2):
    return smollm2


def decode(model, tok, prompt: str, params, seed: int | None):
    """One constrained answer: greedy (seed None) or sampled at temperature 0.7."""
    state = GrammarState.start(params, tok, model.config.vocab_size)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    out = generate_structured(model, encode_chat(tok, prompt), state, 60, tok.eos_token_id,
                              temperature=0.0 if seed is None else 0.7, generator=gen)
    assert state.done and out[-1] == tok.eos_token_id, tok.decode(out)   # finished, not cut
    return tok.decode(out[:-1])


MODES = [pytest.param(None, id="greedy"), pytest.param(0, id="sampled")]


@pytest.mark.slow
@pytest.mark.parametrize("seed", MODES)
@pytest.mark.parametrize("name, prompt, schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_json_schema_answers_validate(real, name, prompt, schema, seed):
    model, tok = real
    text = decode(model, tok, prompt, StructuredOutputsParams(json=schema), seed)
    jsonschema.validate(json.loads(text), schema)


OTHERS = [   # (name, prompt, params, check of the text)
    ("json_object", "Give a point as JSON with x and y.", StructuredOutputsParams(json_object=True),
     lambda text: isinstance(json.loads(text), dict)),
    ("regex", "Give a phone number.", StructuredOutputsParams(regex=REGEX),
     lambda text: re.fullmatch(REGEX, text)),
    ("choice", "What color is the sky?", StructuredOutputsParams(choice=CHOICES),
     lambda text: text in CHOICES),
    ("grammar", "Write an addition.", StructuredOutputsParams(grammar=LARK),
     lambda text: re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3}", text)),
]


@pytest.mark.slow
@pytest.mark.parametrize("seed", MODES)
@pytest.mark.parametrize("name, prompt, params, check", OTHERS, ids=[o[0] for o in OTHERS])
def test_json_object_regex_choice_grammar_answers(real, name, prompt, params, check, seed):
    model, tok = real
    text = decode(model, tok, prompt, params, seed)
    assert check(text), text


@pytest.mark.slow
def test_without_the_mask_the_answer_is_not_json(real):
    """The same prompt, unconstrained: the model wraps its JSON in prose or a code fence, so
    the suite above would fail without the mask."""
    model, tok = real
    name, prompt, schema = SCHEMAS[0]
    out = generate(model, encode_chat(tok, prompt), 60, stop_token_ids=[tok.eos_token_id])
    with pytest.raises(ValueError):
        json.loads(tok.decode(out, skip_special_tokens=True))


def test_token_mask_figure_colors_each_candidate_by_the_mask():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from minillm.viz import token_mask

    class Chars:                                     # a tokenizer whose id i is chr(97 + i)
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])     # (T, V)
    allowed = torch.tensor([[False, True, True, False], [True, False, False, True]])
    fig = token_mask.plot_token_mask(list(zip(logits, allowed)), [1, 3], Chars(), top_k=3)
    colors = [to_hex(p.get_facecolor()) for p in fig.axes[0].patches]
    # row 0: top-3 a (masked), b, c, then the taken b; row 1: d, c (masked), b (masked), taken d
    expect = [0, 1, 1, 1, 1, 0, 0, 1]
    assert colors == [token_mask.ALLOWED if e else token_mask.MASKED for e in expect]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "b\nrank 2" in texts and "2 allowed" in texts
