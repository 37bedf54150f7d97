"""Every OpenAI and vLLM request field past the basics: honoured (mapped to `SamplingParams` by
vLLM's names) or refused with a 400 that names it. A value that would change the answer is never
silently ignored; one that changes nothing (a penalty of 0, `logit_bias: {}`) passes.

    logprobs + top_logprobs (chat), logprobs=k (completions)   -> logprobs=k
    echo (completions; with logprobs, the prompt's too)        -> prompt_logprobs=k
    presence_penalty, frequency_penalty, logit_bias, and vLLM's repetition_penalty, min_p,
    min_tokens, bad_words, stop_token_ids, prompt_logprobs (not streamed, as vLLM),
    include_stop_str_in_output                                 -> the same names
    echo with max_tokens 0 (completions)                       -> score the prompt: max_tokens=0
    n with best_of (best_of >= n; not streamed when best_of > n, as vLLM)
    response_format, guided_* and structured_outputs           -> StructuredOutputsParams
                                      (at most MAX_GRAMMAR_CHARS; compiled in app.py's thread)
    temperature in (0, 0.01)                                   -> 0.01 (vLLM's clamp)

Refused: `suffix`, `tools` / `functions` unless tool_choice is "none", and `NO_OP` fields with a
value that does something. `IGNORED` metadata (user, metadata, store, ...) and unknown fields pass.

Left out on purpose: tool calling (no parser for a model without tool support), audio and
images, beam search, `allowed_token_ids`, prompt truncation.
"""
import json

from minillm.engine.structured import StructuredOutputsParams

MIN_TEMPERATURE = 0.01     # vLLM's clamp: 0 < temperature < 0.01 overflows logits / T in fp32
MAX_GRAMMAR_CHARS = 2**20  # a grammar as llguidance reads it; its compile time grows with it
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                     "safety_identifier", "request_id", "guided_decoding_backend",
                     "parallel_tool_calls"})

_NONE = (None,)
NO_OP = {  # field -> the values that change nothing; any other value is refused
    "audio": _NONE, "prediction": _NONE, "web_search_options": _NONE, "reasoning_effort": _NONE,
    "verbosity": _NONE, "truncate_prompt_tokens": _NONE, "chat_template": _NONE,
    "documents": _NONE, "mm_processor_kwargs": _NONE, "guided_whitespace_pattern": _NONE,
    "allowed_token_ids": _NONE, "cache_salt": _NONE, "kv_transfer_params": _NONE,
    "vllm_xargs": _NONE, "modalities": (None, ["text"]),
    "use_beam_search": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "length_penalty": (None, 1, 1.0), "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False), "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
}
NO_OP_BY_KIND = {"chat": {"echo": (None, False), "add_special_tokens": (None, False)},
                 "completion": {"add_special_tokens": (None, True)}}
STRUCTURED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar"}


class FieldError(Exception):
    """A field refused: (message, param); protocol.py turns it into a 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def _same(a, b) -> bool:
    return a == b and type(a) is type(b) or (a is None and b is None) or (
        type(a) in (int, float) and type(b) in (int, float) and a == b)


def refuse_unimplemented(body: dict, kind: str) -> None:
    """FieldError for the first field whose value would have an effect this server lacks."""
    if body.get("suffix") is not None:
        raise FieldError("'suffix' is not supported (as in vLLM): this model has no "
                         "fill-in-the-middle mode", "suffix")
    for name, fine in {**NO_OP, **NO_OP_BY_KIND[kind]}.items():
        if name in body and not any(_same(body[name], v) for v in fine):
            raise FieldError(f"'{name}'={body[name]!r} is not supported by this server (it "
                             f"accepts only {' or '.join(map(repr, fine))})", name)
    _tools(body)


def _tools(body: dict) -> None:
    """tools / functions pass only when nothing would call them."""
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        given, how = body.get(tools), body.get(choice)
        if given is not None and not isinstance(given, list):
            raise FieldError(f"'{tools}' must be an array", tools)
        if how in (None, "none", "auto") and not given:
            continue                              # nothing to call
        if how == "none":
            continue                              # tools listed, never called: a plain answer
        how = "absent" if how is None else f"={how!r}" if isinstance(how, str) else "=" + json.dumps(how)
        raise FieldError(f"'{tools}' with {choice} {how}: this model's chat template has no "
                         f"tool support, so the server cannot call tools (only {choice}='none' "
                         f"is accepted)", tools if given else choice)


def logprobs(body: dict, kind: str, stream: bool = False) -> dict:
    """{logprobs, prompt_logprobs} for SamplingParams (None = off), from the HTTP shapes: chat's
    `logprobs` boolean with `top_logprobs`, completions' `logprobs` count with `echo`. Their
    ranges are SamplingParams'; vLLM's `prompt_logprobs` is refused in a stream (as vLLM)."""
    if stream and body.get("prompt_logprobs") is not None:
        raise FieldError("'prompt_logprobs' cannot be streamed (as in vLLM): send the request "
                         "with 'stream': false", "prompt_logprobs")
    if kind == "chat":
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on not in (None, True, False):
            raise FieldError(f"'logprobs' must be a boolean in chat completions, got {on!r}", "logprobs")
        if not on and top is not None and not (type(top) is int and top == 0):
            raise FieldError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (0 if top is None else top) if on else None
        echo_k = None
    else:
        k = body.get("logprobs")
        echo = body.get("echo")
        if echo not in (None, True, False):
            raise FieldError(f"'echo' must be a boolean, got {echo!r}", "echo")
        echo_k = k if echo else None
    asked = body.get("prompt_logprobs")                                     # vLLM's extra
    prompt_k = asked if echo_k is None else echo_k if asked is None else (
        max(asked, echo_k) if type(asked) is int and type(echo_k) is int else asked)
    return {"logprobs": k, "prompt_logprobs": prompt_k}


def logit_bias(body: dict, vocab_size: int) -> dict[int, object] | None:
    """{"123": 5} -> {123: 5}; JSON keys are strings of token ids (the bias range is
    SamplingParams')."""
    raw = body.get("logit_bias")
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise FieldError("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = {}
    for key, bias in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise FieldError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got "
                             f"{ascii(key)}", "logit_bias")
        out[int(key)] = bias
    return out


def token_ids_in_vocab(body: dict, vocab_size: int) -> None:
    """stop_token_ids within this model's vocabulary (their type and sign are SamplingParams')."""
    ids = body.get("stop_token_ids")
    if isinstance(ids, list) and any(type(t) is int and t >= vocab_size for t in ids):
        raise FieldError(f"'stop_token_ids' must be an array of token ids in [0, {vocab_size})",
                         "stop_token_ids")


def temperature(value):
    """vLLM clamps 0 < T < 0.01 up to 0.01: logits / 1e-40 is inf in fp32, then NaN."""
    if type(value) not in (int, float):
        return value                                   # SamplingParams refuses it
    return MIN_TEMPERATURE if 0.0 < value < MIN_TEMPERATURE else value


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(StructuredOutputsParams or None, the field that asked for it)."""
    found = []                                          # (param, kwargs)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise FieldError("'response_format' must be {'type': 'text' | 'json_object' | "
                             "'json_schema'}", "response_format")
        if rf["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise FieldError("'response_format.json_schema' must be {'name', 'schema': {...}, "
                                 "'strict'}", "response_format")
            found.append(("response_format", {"json": js["schema"]}))
    for name, key in STRUCTURED.items():
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    so = body.get("structured_outputs")
    if so is not None:
        keys = ("json", "regex", "choice", "grammar", "json_object")
        if not isinstance(so, dict) or not set(so) <= set(keys):
            raise FieldError(f"'structured_outputs' must be an object with one of {list(keys)}",
                             "structured_outputs")
        found.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
    if not found:
        return None, None
    if len(found) > 1:
        raise FieldError(f"only one kind of structured output per request; got "
                         f"{[p for p, _ in found]}", found[1][0])
    param, kwargs = found[0]
    try:
        params = StructuredOutputsParams(**kwargs)
        size = len(params.kind_and_text()[1])
    except (TypeError, ValueError) as err:
        raise FieldError(f"'{param}': {err}", param) from None
    if size > MAX_GRAMMAR_CHARS:
        raise FieldError(f"'{param}' is {size} characters as a grammar; at most "
                         f"{MAX_GRAMMAR_CHARS} are compiled", param)
    return params, param
