"""The OpenAI protocol, requests side: a body checked and turned into engine inputs. The
response and stream-chunk shapes are in responses.py; the fields past the basics in fields.py.

A body becomes a `GenRequest` (prompt token ids, one `SamplingParams`, stream flags, priority)
or an `APIError`, which the app answers as a 4xx with OpenAI's error object
{"error": {"message", "type", "param", "code"}}. Everything is checked here, before the engine
sees it, so a bad request costs its sender a 400 and nobody else anything. The app runs
`parse_request` in one worker thread (tokenizing a 4 MiB prompt takes seconds), and a prompt
whose characters could not fit the context even at the tokenizer's longest token
(`max_token_chars` characters a token) is refused before it is tokenized at all.

Fields read: `model`, `messages` (chat; at most `context` of them, each costs a token) or
`prompt` (completions: a str, or one list of token ids), `max_tokens` (or
`max_completion_tokens`), `temperature` (OpenAI's default 1.0; (0, 0.01) is clamped to 0.01 as
vLLM does), `top_p`, `seed`, `n`, `stop`, `stream`, `stream_options.include_usage`, vLLM's
extras `top_k`, `ignore_eos` and `priority`, and every field fields.py maps (logprobs, echo,
penalties, logit_bias, best_of, structured output) or refuses (suffix, tools, ...).

Left out on purpose: tool calls (this model's chat template has none), batches of prompts in one
completions request, images and audio, the developer and tool roles.
"""
import math
from dataclasses import dataclass

from minillm.engine.sequence import SamplingParams
from minillm.model.chat import encode_chat
from minillm.serve import fields
from minillm.serve.fields import FieldError

ROLES = ("system", "user", "assistant")
MAX_STOP = 4                        # OpenAI allows up to 4 stop sequences


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


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' must be a non-empty string or an array of at most {MAX_STOP} "
                            "non-empty strings", "stop")
    return stop or None


def _number(body: dict, name: str, default: float, low: float, high: float, low_open=False) -> float:
    v = float(_get(body, name, (int, float), default))
    if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
        raise APIError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {v}", name)
    return v


def _max_tokens(body: dict, prompt_len: int, context: int, pool_tokens: int) -> int:
    """max_tokens checked against the room the context leaves, and the KV pool: a sequence
    longer than the whole pool could never finish (it would be preempted forever)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = min(context, pool_tokens)
    what = f"context {context}" if limit == context else f"KV cache {pool_tokens} tokens"
    room = limit - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context} "
                            f"tokens (KV cache {pool_tokens}), which leaves no room for a completion",
                       "messages" if "messages" in body else "prompt", code="context_length_exceeded")
    value = _get(body, name, (int,), None)
    if value is None:                              # vLLM's default: whatever the context leaves
        return room
    if value < 1 or value > room:
        raise APIError(400, f"'{name}' must be in [1, {room}] ({what} - prompt {prompt_len} "
                            f"tokens), got {value}", name, code="context_length_exceeded"
                       if value > room else None)
    return value


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
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= max_n:
        raise APIError(400, f"'n' must be in [1, {max_n}] (max_num_seqs), got {n}", "n")
    seed = _get(body, "seed", (int,), None)
    top_k = _get(body, "top_k", (int,), -1)
    if top_k == 0 or top_k < -1:
        raise APIError(400, f"'top_k' must be -1 (off) or >= 1, got {top_k}", "top_k")
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {}) or {}
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    stop, ignore_eos = _stop(body), _get(body, "ignore_eos", (bool,), False)
    priority = _get(body, "priority", (int,), 0)
    extras = {**fields.penalties(body, vocab_size), **fields.logprobs(body, kind),
              "best_of": fields.best_of(body, n, max_n, stream)}
    structured, structured_param = fields.structured_outputs(body)
    min_tokens = fields.min_tokens(body)
    ids, text = _prompt(body, kind, tokenizer, vocab_size, context, max_token_chars)
    max_tokens = _max_tokens(body, len(ids), context, pool_tokens)
    if min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' must be <= max_tokens ({max_tokens}), got {min_tokens}",
                       "min_tokens")
    params = SamplingParams(
        temperature=fields.temperature(temperature), top_p=top_p, top_k=top_k,
        max_tokens=max_tokens, seed=seed, n=n, stop=stop, ignore_eos=ignore_eos,
        min_tokens=min_tokens, structured_outputs=structured, **extras)
    echo = None
    if kind == "completion" and body.get("echo"):
        echo = text if text is not None else tokenizer.decode(ids)
    return GenRequest(kind, model, ids, params, stream, bool(opts.get("include_usage", False)),
                      priority, echo, body.get("prompt_logprobs") is not None, structured_param)
