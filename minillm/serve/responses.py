"""The OpenAI protocol, responses side: the engine's `RequestOutput` as OpenAI's answer, stream
chunk and usage shapes, with logprobs in the shape of each endpoint.

    chat         choices[i].logprobs = {"content": [{"token", "logprob", "bytes",
                                        "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}
    completions  choices[i].logprobs = {"tokens", "token_logprobs",
                                        "top_logprobs": [{token: logprob}], "text_offset"}

From `CompletionOutput.logprobs` (one {token_id: Logprob} per output token: the sampled token
and the k most likely) and `RequestOutput.prompt_logprobs` (echo; its first entry is None, so the
first prompt token's logprob is null). A token's text is the engine's `decoded_token`, else its
lone decode; its `bytes` are the token's own bytes (a byte-level token may hold a third of a
character, whose lone decode is U+FFFD). `top_logprobs` lists the entries of rank <= k, most
likely first; completions' dict also holds the sampled token, as vLLM's does. A logprob of -inf
(a token a mask removed) is written -9999.0, as vLLM does: JSON has no infinity.

Left out on purpose: `return_tokens_as_token_ids`, vLLM's `prompt_token_ids` in the response.
"""
import math
import secrets
import time

NEG_LOGPROB = -9999.0              # what JSON shows for -inf (vLLM's value)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _object(kind: str, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2's, SmolLM2's) writes byte b as one printable character: itself when
    printable Latin-1, else chr(256 + i) for the i-th byte that is not. The inverse map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Each token's text and bytes, computed once per token id (one per server)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in type(decoder).__name__
        self._bytes_of = _byte_decoder() if self.byte_level else None
        self._text, self._bytes = {}, {}

    def text(self, token_id: int, lp=None) -> str:
        if lp is not None and getattr(lp, "decoded_token", None) is not None:
            return lp.decoded_token
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def bytes(self, token_id: int) -> list[int]:
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.byte_level else None
            if piece is not None and all(c in self._bytes_of for c in piece):
                self._bytes[token_id] = [self._bytes_of[c] for c in piece]
            else:                                   # special tokens, other tokenizers
                self._bytes[token_id] = list(self.text(token_id).encode("utf-8", "replace"))
        return self._bytes[token_id]


def _lp(x: float) -> float:
    return NEG_LOGPROB if math.isnan(x) or x < NEG_LOGPROB else float(x)


def top_entries(entry: dict, k: int) -> list[tuple[int, object]]:
    """The k most likely (token id, Logprob) of one position, most likely first."""
    items = list(entry.items())
    if all(lp.rank is not None for _, lp in items):
        return sorted([it for it in items if it[1].rank <= k], key=lambda it: it[1].rank)[:k]
    return sorted(items, key=lambda it: -it[1].logprob)[:k]


def chat_logprobs(entries, token_ids, k: int, tt: TokenText) -> list[dict]:
    """The `content` list of chat logprobs for these positions."""
    out = []
    for tok, entry in zip(token_ids, entries):
        lp = entry.get(tok)
        out.append({"token": tt.text(tok, lp), "logprob": _lp(lp.logprob if lp else -math.inf),
                    "bytes": tt.bytes(tok),
                    "top_logprobs": [{"token": tt.text(t, p), "logprob": _lp(p.logprob),
                                      "bytes": tt.bytes(t)} for t, p in top_entries(entry, k)]})
    return out


def completion_logprobs(entries, token_ids, k: int, tt: TokenText, offset: int) -> tuple[dict, int]:
    """Completions' logprobs object for these positions (an entry of None: the first prompt
    token, logprob null), and the text offset after them."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        text = tt.text(tok, entry.get(tok) if entry else None)
        res["tokens"].append(text)
        res["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            res["token_logprobs"].append(None)
            res["top_logprobs"].append(None)
            continue
        lp = entry.get(tok)
        res["token_logprobs"].append(_lp(lp.logprob) if lp else NEG_LOGPROB)
        top = {tt.text(t, p): _lp(p.logprob) for t, p in top_entries(entry, k)}
        if lp is not None:
            top.setdefault(tt.text(tok, lp), _lp(lp.logprob))
        res["top_logprobs"].append(top)
    return res, offset


def prompt_logprobs(out, tt: TokenText) -> list | None:
    """vLLM's top-level `prompt_logprobs`: per prompt token None or {id: {logprob, rank,
    decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(p.logprob), "rank": p.rank,
                                             "decoded_token": tt.text(t, p)} for t, p in e.items()}
            for e in out.prompt_logprobs]


def choice_logprobs(req, c, tt: TokenText, prompt_entries=None):
    """The logprobs of one whole completion `c` (None when not asked for)."""
    k = req.params.logprobs
    if k is None or c.logprobs is None:
        return None
    if req.kind == "chat":
        return {"content": chat_logprobs(c.logprobs, c.token_ids, k, tt)}
    offset = 0
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt_entries is not None:
        res, offset = completion_logprobs(prompt_entries, req.prompt_token_ids, k, tt, 0)
    more, _ = completion_logprobs(c.logprobs, c.token_ids, k, tt, offset)
    return {key: res[key] + more[key] for key in res}


def response(req, rid: str, out, tt: TokenText) -> dict:
    """The whole (non-streamed) answer to `req` from its last RequestOutput."""
    echo_entries = out.prompt_logprobs if req.echo is not None else None
    choices = []
    for i, c in enumerate(out.outputs):
        text, logprobs = (c.text or ""), choice_logprobs(req, c, tt, echo_entries)
        if req.kind == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": i, "text": (req.echo or "") + text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    res = {"id": rid, "object": _object(req.kind, False), "created": int(time.time()),
           "model": req.model, "choices": choices,
           "usage": usage(len(req.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
    if req.show_prompt_logprobs:
        res["prompt_logprobs"] = prompt_logprobs(out, tt)
    return res


def chunk(req, rid: str, index: int, text: str | None, finish_reason=None, first: bool = False,
          logprobs=None) -> dict:
    """One streamed event for completion `index`: new text and/or its finish reason."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
    out = {"id": rid, "object": _object(req.kind, True), "created": int(time.time()),
           "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None                       # OpenAI: null on every chunk but the last
    return out


def usage_chunk(req, rid: str, num_tokens: int) -> dict:
    return {"id": rid, "object": _object(req.kind, True), "created": int(time.time()),
            "model": req.model, "choices": [], "usage": usage(len(req.prompt_token_ids), num_tokens)}
