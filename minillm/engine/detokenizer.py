"""Incremental detokenization and stop strings: a sequence's text grows with each sampled token.

A byte-level tokenizer (SmolLM2's, GPT-2's) can split one character over several tokens:
"日" is three tokens here, and decoding the first alone gives U+FFFD, the replacement character.
So `Detokenizer.append` decodes only a short window (the last settled token(s) for context, plus
the tokens not yet shown), and holds text back while the window ends in U+FFFD; the character
appears whole once its last byte arrives. Decoding a window instead of the whole output keeps a
step's cost independent of how long the answer already is. The context token matters for
SentencePiece tokenizers, which drop a leading space when a decode starts at a word.

Stop strings are searched only where a new match can be: the new text plus the last
`len(stop) - 1` characters before it. On a match the text is cut before the stop string
(vLLM's default; after it with `include_stop`) and `stopped` turns True.

Left out on purpose: holding back a prefix of a stop string
while streaming (a client may briefly see the start of a stop string that is then cut), and
`skip_special_tokens=False` (special tokens such as <|im_end|> are never shown, as in vLLM).
"""

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 4           # prompt tokens decoded before the first output token, for spaces


class Detokenizer:
    """The text of one sequence's output tokens, updated one token at a time.

    >>> d = Detokenizer(tok, prompt_ids, stop=["\\n\\n"])
    >>> d.append(token_id); d.text, d.stopped
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.include_stop = include_stop   # cut after the stop string, not before it
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT:])   # context, then every output token
        self.context_start = 0             # window = ids[context_start:]
        self.shown = len(self.ids)         # ids[:shown] are in `text` (or are prompt context)
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> str:
        """Add one output token; returns the text it made visible ("" while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The sequence finished: show whatever is held back, even a lone U+FFFD."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        head = self._decode(self.ids[self.context_start:self.shown])
        window = self._decode(self.ids[self.context_start:])
        if not final and (window.endswith(REPLACEMENT_CHAR) or len(window) <= len(head)):
            return ""                      # an incomplete character (or nothing new yet)
        new = window[len(head):]
        self.context_start, self.shown = self.shown, len(self.ids)
        before = len(self.text)
        self.text += new
        self._check_stop(before)
        return self.text[before:]

    def _check_stop(self, before: int) -> None:
        """Cut `text` before the first stop string that ends in the part added after `before`."""
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop)
                if i >= 0]
        if hits:
            first, end = min(hits)
            self.text, self.stopped = self.text[:end if self.include_stop else first], True
