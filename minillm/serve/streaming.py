"""A streamed answer as server-sent events: what each engine snapshot adds, per completion.

One `data: {json}` line per chunk of new text, a last chunk per completion with its
`finish_reason`, the `usage` chunk when `stream_options.include_usage` is set, then
`data: [DONE]`. The text of a stream is exactly the non-streamed text: the detokenizer already
holds back an incomplete UTF-8 character, and with stop strings the stream also holds back the
last len(stop) - 1 characters until the request ends, since those may turn out to be the start
of a stop string that is cut.

Logprobs travel with the text they belong to: a chunk carries the logprobs of the tokens whose
text it completes, judged by the running sum of the tokens' own texts (which is never shorter
than the text they made: a split character counts once per piece, a special token shows
nothing), so held-back text holds back its tokens' logprobs too; the finish chunk carries the
rest. Put together, the chunks' logprobs are the non-streamed answer's. With `echo` the first
chunk of each completion starts with the prompt (and its logprobs).

Left out on purpose: the prompt's logprobs as vLLM's top-level field in a stream.
"""
import bisect
import json
from dataclasses import dataclass, field

from minillm.serve import responses


def sse(data) -> str:
    """One event; ASCII-only JSON, so no character can fail to encode on the way out."""
    return f"data: {json.dumps(data, ensure_ascii=True)}\n\n"


DONE = "data: [DONE]\n\n"


def holdback(stop) -> int:
    """Characters a stream keeps back while a stop string might still be forming."""
    return max(map(len, stop)) - 1 if stop else 0


@dataclass
class _Choice:
    chars: int = 0                         # characters of text sent
    tokens: int = 0                        # tokens whose logprobs were sent
    ends: list = field(default_factory=list)   # running sum of the tokens' texts
    offset: int = 0                        # completions' text_offset so far
    started: bool = False
    ended: bool = False


class StreamWriter:
    """The events of one streamed request, snapshot by snapshot."""

    def __init__(self, req, rid: str, tt: responses.TokenText):
        self.req, self.rid, self.tt = req, rid, tt
        self.keep = holdback(req.params.stop)
        self.choices: dict[int, _Choice] = {}

    def events(self, out) -> list[str]:
        return [e for c in out.outputs for e in self._choice(out, c)]

    def _ready(self, st: _Choice, c, upto: int, done: bool) -> int:
        """How many of c's tokens have their text inside text[:upto]."""
        if done:
            return len(c.token_ids)
        for j in range(len(st.ends), min(len(c.token_ids), len(c.logprobs))):
            tok = c.token_ids[j]
            st.ends.append((st.ends[-1] if st.ends else 0)
                           + len(self.tt.text(tok, c.logprobs[j].get(tok))))
        return bisect.bisect_right(st.ends, upto)

    def _logprobs(self, st: _Choice, c, upto_tok: int, prompt_entries=None):
        req, k = self.req, self.req.params.logprobs
        if k is None or c.logprobs is None:
            return None
        ids, entries = c.token_ids[st.tokens:upto_tok], c.logprobs[st.tokens:upto_tok]
        st.tokens = max(st.tokens, upto_tok)
        if req.kind == "chat":
            return {"content": responses.chat_logprobs(entries, ids, k, self.tt)}
        if prompt_entries is not None:
            ids, entries = req.prompt_token_ids + ids, list(prompt_entries) + list(entries)
        res, st.offset = responses.completion_logprobs(entries, ids, k, self.tt, st.offset)
        return res

    def _choice(self, out, c) -> list[str]:
        req, st = self.req, self.choices.setdefault(c.index, _Choice())
        if st.ended:
            return []
        events, done, text = [], c.finish_reason is not None, c.text or ""
        echo = None
        if not st.started:
            st.started = True
            if req.kind == "chat":
                events.append(sse(responses.chunk(req, self.rid, c.index, None, first=True)))
            elif req.echo is not None:
                echo = req.echo
        upto = len(text) if done else max(st.chars, len(text) - self.keep)
        if upto > st.chars or echo is not None:
            with_lp = req.params.logprobs is not None and c.logprobs is not None
            ready = self._ready(st, c, upto, done) if with_lp else 0
            prompt = out.prompt_logprobs if echo is not None and req.params.prompt_logprobs is not None else None
            lp = self._logprobs(st, c, ready, prompt) if with_lp else None
            events.append(sse(responses.chunk(req, self.rid, c.index, (echo or "") + text[st.chars:upto],
                                              logprobs=lp)))
            st.chars = upto
        if done:
            lp = None
            if req.params.logprobs is not None and c.logprobs is not None and st.tokens < len(c.token_ids):
                lp = self._logprobs(st, c, len(c.token_ids))
            events.append(sse(responses.chunk(req, self.rid, c.index, None, c.finish_reason, logprobs=lp)))
            st.ended = True
        return events
