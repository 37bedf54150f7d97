"""Every OpenAI / vLLM request field is honoured (mapped to SamplingParams by vLLM's names) or
refused with a 400 naming it; values that change nothing pass and give the very request without
them. Checked on `parse_request` directly (no server, no model: SmolLM2's tokenizer only)."""
import pytest

from minillm.engine.sampling_params import MAX_LOGPROBS
from minillm.engine.structured import StructuredOutputsParams
from minillm.serve import fields
from minillm.serve.protocol import APIError, parse_request

LIMITS = dict(context=512, vocab_size=49152, pool_tokens=4096, max_n=8, max_token_chars=81)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}



def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}


def completion(**extra):
    return {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, **extra}


def parse(tok, body, kind=None):
    kind = kind or ("chat" if "messages" in body else "completion")
    return parse_request(body, kind, "m", tok, **LIMITS)


def refused(tok, body, kind=None) -> APIError:
    with pytest.raises(APIError) as info:
        parse(tok, body, kind)
    assert info.value.status == 400 and info.value.body()["error"]["message"]
    return info.value


HONOURED = [  # (body, {SamplingParams field: value})
    (chat(logprobs=True, top_logprobs=3), {"logprobs": 3, "prompt_logprobs": None}),
    (chat(logprobs=True), {"logprobs": 0}),
    (chat(logprobs=True, top_logprobs=MAX_LOGPROBS), {"logprobs": MAX_LOGPROBS}),
    (completion(logprobs=2), {"logprobs": 2, "prompt_logprobs": None}),
    (completion(logprobs=0), {"logprobs": 0}),                      # the sampled token's only
    (completion(logprobs=2, echo=True), {"logprobs": 2, "prompt_logprobs": 2}),
    (completion(prompt_logprobs=1), {"prompt_logprobs": 1}),        # vLLM's extra
    (completion(echo=True, max_tokens=0, logprobs=1),                # score the prompt (vLLM)
     {"max_tokens": 0, "logprobs": 1, "prompt_logprobs": 1}),
    (completion(echo=True, max_tokens=0), {"max_tokens": 0, "prompt_logprobs": 0}),
    (chat(include_stop_str_in_output=True), {"include_stop_str_in_output": True}),
    (chat(presence_penalty=1.5, frequency_penalty=-1), {"presence_penalty": 1.5, "frequency_penalty": -1.0}),
    (completion(repetition_penalty=1.3, min_p=0.1), {"repetition_penalty": 1.3, "min_p": 0.1}),
    (completion(min_tokens=3), {"min_tokens": 3}),
    (completion(bad_words=["Paris"]), {"bad_words": ["Paris"]}),
    (completion(stop_token_ids=[5, 7]), {"stop_token_ids": [5, 7]}),
    (completion(logit_bias={"5": 100, "7": -50.5}), {"logit_bias": {5: 100.0, 7: -50.5}}),
    (completion(n=2, best_of=3), {"n": 2, "best_of": 3}),
    (chat(response_format={"type": "json_object"}),
     {"structured_outputs": StructuredOutputsParams(json_object=True)}),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}),
     {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    (chat(guided_json=SCHEMA), {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    (chat(guided_regex="[0-9]+"), {"structured_outputs": StructuredOutputsParams(regex="[0-9]+")}),
    (chat(guided_choice=["yes", "no"]), {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])}),
    (chat(guided_grammar='start: "a"'), {"structured_outputs": StructuredOutputsParams(grammar='start: "a"')}),
    (chat(structured_outputs={"regex": "a+"}), {"structured_outputs": StructuredOutputsParams(regex="a+")}),
    (chat(temperature=1e-40), {"temperature": 0.01}),                # vLLM's clamp
    (chat(temperature=5e-324), {"temperature": 0.01}),
    (chat(temperature=0.005), {"temperature": 0.01}),
    (chat(temperature=0.02), {"temperature": 0.02}),
    (chat(temperature=0), {"temperature": 0.0}),
]


@pytest.mark.parametrize("body,want", HONOURED, ids=range(len(HONOURED)))
def test_honoured_fields_reach_sampling_params(tok, body, want):
    params = parse(tok, body).params
    for name, value in want.items():
        assert getattr(params, name) == value, name


def test_echo_puts_the_prompt_text_first_and_structured_requests_name_their_field(tok):
    assert parse(tok, completion(echo=True)).echo == "The capital of France is"
    ids = tok.encode("Hello there")
    assert parse(tok, completion(prompt=ids, echo=True)).echo == tok.decode(ids)
    assert parse(tok, completion()).echo is None and parse(tok, completion(echo=False)).echo is None
    assert parse(tok, chat(guided_choice=["a"])).structured_param == "guided_choice"
    assert parse(tok, completion(prompt_logprobs=0)).show_prompt_logprobs


NO_OPS = [
    (chat, dict(presence_penalty=0, frequency_penalty=0.0)), (chat, dict(logprobs=False)),
    (chat, dict(logprobs=None, top_logprobs=None)), (chat, dict(top_logprobs=0)),
    (chat, dict(logit_bias={})), (chat, dict(logit_bias=None)),
    (chat, dict(response_format={"type": "text"})), (completion, dict(echo=False)),
    (completion, dict(best_of=1)), (completion, dict(n=2, best_of=2)), (completion, dict(suffix=None)),
    (chat, dict(tools=[TOOL], tool_choice="none")), (chat, dict(tools=[])),
    (chat, dict(tool_choice="auto")), (chat, dict(tool_choice="none")),
    (chat, dict(functions=[TOOL["function"]], function_call="none")),
    (chat, dict(user="alice", metadata={"a": "b"}, store=False, service_tier="auto",
                parallel_tool_calls=True, prompt_cache_key="k", safety_identifier="s")),
    (chat, dict(modalities=["text"], skip_special_tokens=True, include_stop_str_in_output=False,
                use_beam_search=False, length_penalty=1.0, add_generation_prompt=True)),
    (chat, dict(stream_options={"include_usage": True})),           # without stream
    (chat, dict(repetition_penalty=1.0, min_p=0.0, min_tokens=0, bad_words=[], stop_token_ids=[])),
    (chat, dict(some_future_field={"a": {"b": {"c": [1, 2, {"d": None}]}}})),   # unknown: ignored
]


@pytest.mark.parametrize("make,extra", NO_OPS, ids=range(len(NO_OPS)))
def test_no_op_values_pass_and_change_nothing(tok, make, extra):
    n = extra.get("n", 1)
    ref = parse(tok, make(n=n) if n != 1 else make())
    got = parse(tok, make(**extra))
    assert got.params == ref.params and got.prompt_token_ids == ref.prompt_token_ids


REFUSED = [  # (body, kind or None, param)
    (completion(suffix="!"), None, "suffix"),
    (chat(tools=[TOOL]), None, "tools"),
    (chat(tools=[TOOL], tool_choice="auto"), None, "tools"),
    (chat(tools=[TOOL], tool_choice="required"), None, "tools"),
    (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None, "tools"),
    (chat(tool_choice="required"), None, "tool_choice"),
    (chat(tools={"a": 1}), None, "tools"),
    (chat(functions=[TOOL["function"]]), None, "functions"),
    (chat(functions=[TOOL["function"]], function_call="auto"), None, "functions"),
    (chat(top_logprobs=2), None, "top_logprobs"),                   # needs logprobs: true
    (chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), None, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=-1), None, "top_logprobs"),
    (chat(logprobs=2), None, "logprobs"),
    (completion(logprobs=MAX_LOGPROBS + 1), None, "logprobs"),
    (completion(logprobs=True), None, "logprobs"),
    (completion(echo="yes"), None, "echo"),
    (chat(echo=True), None, "echo"),
    (completion(logit_bias={"abc": 1}), None, "logit_bias"),
    (completion(logit_bias={"-1": 1}), None, "logit_bias"),
    (completion(logit_bias={"49152": 1}), None, "logit_bias"),
    (completion(logit_bias={"\u0665": 1}), None, "logit_bias"),      # a non-ASCII digit
    (completion(logit_bias={"5": 101}), None, "logit_bias"),
    (completion(logit_bias={"5": "x"}), None, "logit_bias"),
    (completion(logit_bias={"5": True}), None, "logit_bias"),
    (completion(logit_bias=[5]), None, "logit_bias"),
    (completion(presence_penalty=2.5), None, "presence_penalty"),
    (completion(frequency_penalty="x"), None, "frequency_penalty"),
    (completion(frequency_penalty=float("nan")), None, "frequency_penalty"),
    (completion(repetition_penalty=0), None, "repetition_penalty"),
    (completion(min_p=1.5), None, "min_p"),
    (completion(min_tokens=-1), None, "min_tokens"),
    (completion(min_tokens=9), None, "min_tokens"),                  # > max_tokens 8
    (completion(bad_words="Paris"), None, "bad_words"),
    (completion(bad_words=[""]), None, "bad_words"),
    (completion(stop_token_ids=[49152]), None, "stop_token_ids"),
    (completion(n=2, best_of=1), None, "best_of"),
    (completion(best_of=3, stream=True), None, "best_of"),
    (completion(best_of=1000), None, "best_of"),
    (chat(response_format={"type": "xml"}), None, "response_format"),
    (chat(response_format={"type": "json_schema"}), None, "response_format"),
    (chat(response_format="json"), None, "response_format"),
    (chat(response_format={"type": "json_object"}, guided_json=SCHEMA), None, "guided_json"),
    (chat(guided_regex="a", guided_choice=["a"]), None, "guided_choice"),
    (chat(guided_choice=[]), None, "guided_choice"),
    (chat(guided_regex=""), None, "guided_regex"),
    (chat(structured_outputs={"yaml": "x"}), None, "structured_outputs"),
    (chat(structured_outputs={"regex": "a", "choice": ["a"]}), None, "structured_outputs"),
    (chat(audio={"voice": "alloy"}), None, "audio"),
    (chat(modalities=["text", "audio"]), None, "modalities"),
    (chat(prediction={"type": "content", "content": "x"}), None, "prediction"),
    (chat(reasoning_effort="high"), None, "reasoning_effort"),
    (completion(max_tokens=0), None, "max_tokens"),                      # scoring needs echo
    (completion(max_tokens=0, prompt_logprobs=1), None, "max_tokens"),
    (chat(max_tokens=None, max_completion_tokens=0, logprobs=True), None, "max_completion_tokens"),
    (chat(use_beam_search=True), None, "use_beam_search"),
    (chat(add_generation_prompt=False), None, "add_generation_prompt"),
    (chat(chat_template="{{ x }}"), None, "chat_template"),
    (chat(skip_special_tokens=False), None, "skip_special_tokens"),
    (chat(logits_processors=["x"]), None, "logits_processors"),
    (chat(messages=[{"role": "user", "content": "a"}] * (LIMITS["context"] + 1)), None, "messages"),
    (completion(prompt="\ud800"), None, "prompt"),                    # a lone surrogate
    (chat(messages=[{"role": "user", "content": "a\udfffb"}]), None, "messages[0].content"),
    (completion(prompt_logprobs=2, stream=True), None, "prompt_logprobs"),   # vLLM refuses it too
    (chat(prompt_logprobs=0, stream=True), None, "prompt_logprobs"),
    (completion(guided_regex="a" * (2**20 + 1)), None, "guided_regex"),      # too big to compile
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "enum": [f"value {i}" for i in range(120_000)]}}}), None, "response_format"),
]


@pytest.mark.parametrize("body,kind,param", REFUSED, ids=range(len(REFUSED)))
def test_fields_with_an_effect_not_implemented_are_400_naming_them(tok, body, kind, param):
    assert refused(tok, body, kind).param == param


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(tok):
    class Counting:                                # the real tokenizer, counting its calls
        def __init__(self):
            self.calls = 0

        def encode(self, text):
            self.calls += 1
            return tok.encode(text)
    t = Counting()
    bound = LIMITS["context"] * LIMITS["max_token_chars"]
    with pytest.raises(APIError) as info:
        parse_request(completion(prompt="a" * (bound + 1)), "completion", "m", t, **LIMITS)
    assert info.value.code == "context_length_exceeded" and t.calls == 0
    assert "characters" in info.value.message
    with pytest.raises(APIError) as info:                             # at the bound: tokenized
        parse_request(completion(prompt="a " * (bound // 2)), "completion", "m", t, **LIMITS)
    assert t.calls == 1 and info.value.code == "context_length_exceeded"


def test_the_char_bound_holds_for_every_token_of_the_vocabulary(tok):
    """No token stands for more characters than max_token_chars: the bound is safe."""
    from minillm.serve.app import max_token_chars
    longest = max(len(tok.decode([i])) for i in range(len(tok)))
    assert longest <= max_token_chars(tok) <= 2 * longest


def test_the_model_name_is_echoed_ascii_safe(tok):
    with pytest.raises(APIError) as info:
        parse_request({"model": "\ud800", "prompt": "x"}, "completion", "m", tok, **LIMITS)
    assert info.value.status == 404 and "\\ud800" in info.value.message
    info.value.message.encode("ascii")


def test_field_tables_name_only_known_fields():
    assert not set(fields.NO_OP) & fields.IGNORED
    assert fields.temperature(0.0) == 0.0 and fields.temperature(1e-3) == fields.MIN_TEMPERATURE
