"""The OpenAI protocol, both ways: a request body checked and turned into engine inputs, and the
engine's outputs turned into OpenAI's response and stream-chunk shapes.

A body becomes a `GenRequest` (prompt token ids, one `SamplingParams`, stream flags, priority)
or an `APIError`, which the app answers as a 4xx with OpenAI's error object
{"error": {"message", "type", "param", "code"}}. Everything is checked here, before the engine
sees it, so a bad request costs its sender a 400 and nobody else anything.

Fields read: `model`, `messages` (chat) or `prompt` (completions: a str, or one list of token
ids), `max_tokens` (or `max_completion_tokens`), `temperature` (OpenAI's default 1.0), `top_p`,
`seed`, `n`, `stop`, `stream`, `stream_options.include_usage`, and vLLM's extras `top_k`,
`ignore_eos` and `priority`. Other fields (user, penalties at 0, ...) are ignored, as vLLM does.

Left out on purpose: logprobs, tools and function calls, `echo`, `best_of`, batches of prompts in
one completions request, images.
"""
import math
import secrets
import time
from dataclasses import dataclass

from minillm.engine.sequence import SamplingParams

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


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty array of {role, content} objects", "messages")
    out = []
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
        out.append({"role": m["role"], "content": content})
    return out


def _prompt_ids(body: dict, kind: str, tokenizer, vocab_size: int) -> list[int]:
    from minillm.model.chat import encode_chat
    if kind == "chat":
        return encode_chat(tokenizer, _messages(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
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
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context} "
                            f"tokens, which leaves no room for a completion", "messages"
                       if "messages" in body else "prompt", code="context_length_exceeded")
    value = _get(body, name, (int,), None)
    if value is None:                              # vLLM's default: whatever the context leaves
        return max(1, min(room, pool_tokens - prompt_len))
    if value < 1 or value > room:
        raise APIError(400, f"'{name}' must be in [1, {room}] (context {context} - prompt "
                            f"{prompt_len} tokens), got {value}", name, code="context_length_exceeded"
                       if value > room else None)
    return value


def parse_request(body, kind: str, served_model: str, tokenizer, context: int, vocab_size: int,
                  pool_tokens: int, max_n: int) -> GenRequest:
    """A JSON body (already decoded) -> GenRequest, or APIError naming the bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _get(body, "model", (str,), None)
    if model is None:
        raise APIError(400, "'model' is required", "model")
    if model != served_model:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{served_model}'", "model", code="model_not_found")
    ids = _prompt_ids(body, kind, tokenizer, vocab_size)
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= max_n:
        raise APIError(400, f"'n' must be in [1, {max_n}] (max_num_seqs), got {n}", "n")
    seed = _get(body, "seed", (int,), None)
    top_k = _get(body, "top_k", (int,), -1)
    if top_k == 0 or top_k < -1:
        raise APIError(400, f"'top_k' must be -1 (off) or >= 1, got {top_k}", "top_k")
    opts = _get(body, "stream_options", (dict,), {}) or {}
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=top_k,
        max_tokens=_max_tokens(body, len(ids), context, pool_tokens), seed=seed, n=n,
        stop=_stop(body), ignore_eos=_get(body, "ignore_eos", (bool,), False))
    return GenRequest(kind, model, ids, params, _get(body, "stream", (bool,), False),
                      bool(opts.get("include_usage", False)), _get(body, "priority", (int,), 0))


# ---- responses ---------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _object(kind: str, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def response(req: GenRequest, rid: str, texts: list[str], reasons: list[str | None],
             num_tokens: int) -> dict:
    """The whole (non-streamed) answer."""
    if req.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": _object(req.kind, False), "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": usage(len(req.prompt_token_ids), num_tokens)}


def chunk(req: GenRequest, rid: str, index: int, text: str | None, finish_reason=None,
          first: bool = False) -> dict:
    """One streamed event for completion `index`: new text and/or its finish reason."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {"id": rid, "object": _object(req.kind, True), "created": int(time.time()),
           "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None                       # OpenAI: null on every chunk but the last
    return out


def usage_chunk(req: GenRequest, rid: str, num_tokens: int) -> dict:
    return {"id": rid, "object": _object(req.kind, True), "created": int(time.time()),
            "model": req.model, "choices": [], "usage": usage(len(req.prompt_token_ids), num_tokens)}
