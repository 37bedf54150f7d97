"""The OpenAI protocol, requests side: a body checked and turned into engine inputs. The
response and stream-chunk shapes are in responses.py; the fields past the basics in fields.py.

A body becomes a `GenRequest` (prompt token ids, one `SamplingParams`, stream flags, priority)
or an `APIError`, answered as a 4xx with OpenAI's error object, before the engine sees it.
Sampling ranges are SamplingParams' own: its `SamplingParamError` becomes the 400, naming the
field as the body spells it (`HTTP_NAMES`). Checked here: what depends on this server and model
(n and best_of within max_num_seqs, max_tokens within the room the prompt leaves, token ids in
the vocabulary) and the HTTP-only fields; a prompt too long even at `max_token_chars` characters
a token is refused before tokenizing. Fields read: `model`, `messages` or `prompt`, `max_tokens`
(or `max_completion_tokens`), `temperature`, `top_p`, `seed`, `n`, `stop`, `stream`,
`stream_options.include_usage`, vLLM's `top_k`, `ignore_eos`, `priority`, and fields.py's.

Left out on purpose: tool calls (this model's chat template has none), batches of prompts in one
completions request, images and audio, the developer and tool roles.
"""
from dataclasses import dataclass

from minillm.engine.sampling_params import SamplingParamError, SamplingParams
from minillm.model.chat import encode_chat
from minillm.serve import fields
from minillm.serve.fields import FieldError

ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class GenRequest:
    kind: str                       # "chat" or "completion"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    echo: str | None = None         # completions' echo: the prompt's text, put before each answer
    show_prompt_logprobs: bool = False   # vLLM's `prompt_logprobs` field: a top-level list
    structured_param: str | None = None  # the field that asked for structured output


def _get(body: dict, name: str, types, default=None, allow_none: bool = True):
    """body[name] checked against `types` (bool is never an int or a float here)."""
    value = body.get(name, default)
    if value is None and allow_none:
        return default
    if isinstance(value, bool) and bool not in types:
        raise APIError(400, f"'{name}' must be of type {_names(types)}, got a bool", name)
    if not isinstance(value, types):
        raise APIError(400, f"'{name}' must be of type {_names(types)}, got "
                            f"{type(value).__name__}", name)
    return value


def _names(types) -> str:
    return " or ".join({int: "integer", float: "number", str: "string", bool: "boolean",
                        list: "array", dict: "object"}[t] for t in types)


def _text(s: str, param: str) -> str:
    """`s` if it is valid Unicode text (JSON may carry a lone surrogate, which UTF-8 cannot)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' holds a lone UTF-16 surrogate, which is not text",
                       param) from None
    return s


def _too_long(chars: int, context: int, max_token_chars: int | None, param: str) -> None:
    """Refuse, before tokenizing, a text that could not fit even if every token were as long as
    the tokenizer's longest one."""
    if max_token_chars and chars > context * max_token_chars:
        raise APIError(400, f"the prompt has {chars} characters; this model's context is {context} "
                            f"tokens of at most {max_token_chars} characters each",
                       param, code="context_length_exceeded")


def _messages(body: dict, context: int, max_token_chars: int | None) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty array of {role, content} objects", "messages")
    if len(msgs) > context:                      # each message costs at least one token
        raise APIError(400, f"{len(msgs)} messages cannot fit this model's context of {context} "
                            f"tokens", "messages", code="context_length_exceeded")
    out, chars = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {list(ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):            # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}",
                               f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        chars += len(content)
        out.append({"role": m["role"], "content": _text(content, f"messages[{i}].content")})
    _too_long(chars, context, max_token_chars, "messages")
    return out


def _prompt(body: dict, kind: str, tokenizer, vocab_size: int, context: int,
            max_token_chars: int | None) -> tuple[list[int], str | None]:
    """(prompt token ids, the prompt string when one was given)."""
    if kind == "chat":
        return encode_chat(tokenizer, _messages(body, context, max_token_chars)), None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", "prompt")
        _too_long(len(prompt), context, max_token_chars, "prompt")
        return tokenizer.encode(_text(prompt, "prompt")), prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt), None
    raise APIError(400, "'prompt' must be a non-empty string or one array of token ids "
                        "(one prompt per request here)", "prompt")


def _room(body: dict, prompt_len: int, context: int, pool_tokens: int) -> int:
    """The most tokens a completion can have: what the context leaves, and the KV pool (a
    sequence longer than the whole pool could never finish: it would be preempted forever)."""
    room = min(context, pool_tokens) - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context} "
                            f"tokens (KV cache {pool_tokens}), which leaves no room for a completion",
                       "messages" if "messages" in body else "prompt", code="context_length_exceeded")
    return room


def _max_tokens_name(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


HTTP_NAMES = {  # SamplingParams field -> the body field that carries it, where the names differ
    "chat": {"logprobs": "top_logprobs"},
    "completion": {},
}


def http_name(field: str, body: dict, kind: str) -> str:
    """The body field to name in a 400 about SamplingParams' `field`."""
    if field == "max_tokens":
        return _max_tokens_name(body)
    return HTTP_NAMES[kind].get(field, field)


def parse_request(body, kind: str, served_model: str, tokenizer, context: int, vocab_size: int,
                  pool_tokens: int, max_n: int, max_token_chars: int | None = None) -> GenRequest:
    """A JSON body (already decoded) -> GenRequest, or APIError naming the bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _get(body, "model", (str,), None)
    if model is None:
        raise APIError(400, "'model' is required", "model")
    if model != served_model:
        raise APIError(404, f"the model {ascii(model)} does not exist; this server serves "
                            f"'{served_model}'", "model", code="model_not_found")
    try:
        return _parse(body, kind, model, tokenizer, context, vocab_size, pool_tokens, max_n,
                      max_token_chars)
    except FieldError as err:
        raise APIError(400, err.message, err.param) from None


def _parse(body, kind, model, tokenizer, context, vocab_size, pool_tokens, max_n, max_token_chars):
    fields.refuse_unimplemented(body, kind)
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {}) or {}
    priority = _get(body, "priority", (int,), 0)
    fields.token_ids_in_vocab(body, vocab_size)
    structured, structured_param = fields.structured_outputs(body)
    ids, text = _prompt(body, kind, tokenizer, vocab_size, context, max_token_chars)
    room = _room(body, len(ids), context, pool_tokens)
    given = {name: body.get(name) for name in (
        "top_p", "top_k", "seed", "n", "stop", "ignore_eos", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "bad_words",
        "stop_token_ids", "include_stop_str_in_output")}
    max_tokens = _or(body.get(_max_tokens_name(body)), room)               # vLLM's default: the room
    given.update(_scoring(body, kind, max_tokens, fields.logprobs(body, kind, stream)),
                 logit_bias=fields.logit_bias(body, vocab_size),
                 best_of=body.get("best_of"), structured_outputs=structured, max_tokens=max_tokens,
                 temperature=fields.temperature(_or(body.get("temperature"), 1.0)))   # OpenAI's
    try:              # the ranges are SamplingParams' own: null is the field's default
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None})
    except SamplingParamError as err:
        raise APIError(400, f"'{http_name(err.field, body, kind)}': {err}",
                       http_name(err.field, body, kind)) from None
    _limits(body, params, room, context, pool_tokens, max_n, stream)
    echo = None
    if kind == "completion" and body.get("echo"):
        echo = text if text is not None else tokenizer.decode(ids)
    return GenRequest(kind, model, ids, params, stream, bool(opts.get("include_usage", False)),
                      priority, echo, body.get("prompt_logprobs") is not None, structured_param)


def _scoring(body: dict, kind: str, max_tokens, lps: dict) -> dict:
    """max_tokens 0 means "score the prompt" only with completions' echo (vLLM, OpenAI's legacy
    API): the prompt's logprobs come back and nothing is generated. Otherwise a 400."""
    if type(max_tokens) is not int or max_tokens != 0:
        return lps
    if kind != "completion" or body.get("echo") is not True:
        if lps["prompt_logprobs"] is None:
            return lps                                 # SamplingParams refuses it, naming it
        name = _max_tokens_name(body)
        raise APIError(400, f"'{name}': max_tokens must be an int >= 1 (0 only with 'echo': "
                            f"true on /v1/completions), got 0", name)
    return {**lps, "prompt_logprobs": 0 if lps["prompt_logprobs"] is None else lps["prompt_logprobs"]}


def _or(value, default):
    return default if value is None else value


def _limits(body, params: SamplingParams, room: int, context: int, pool_tokens: int, max_n: int,
            stream: bool) -> None:
    """What this server and model allow beyond the fields' own ranges."""
    if params.max_tokens > room:
        limit = min(context, pool_tokens)
        what = f"context {context}" if limit == context else f"KV cache {pool_tokens} tokens"
        name = _max_tokens_name(body)
        raise APIError(400, f"'{name}' must be in [1, {room}] ({what} - prompt {limit - room} "
                            f"tokens), got {params.max_tokens}", name, code="context_length_exceeded")
    if params.n > max_n:
        raise APIError(400, f"'n' must be in [1, {max_n}] (max_num_seqs), got {params.n}", "n")
    if params.best_of is not None and params.best_of > max_n:
        raise APIError(400, f"'best_of' must be <= {max_n} (max_num_seqs), got {params.best_of}",
                       "best_of")
    if params.best_of is not None and stream:
        raise APIError(400, "'best_of' > n cannot be streamed: the best completions are known "
                            "only at the end", "best_of")
