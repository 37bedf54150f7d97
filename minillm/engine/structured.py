"""Structured output: a grammar that masks the tokens a sequence may take next (vLLM's
`StructuredOutputsParams`: `json`, `regex`, `choice`, `grammar`, `json_object`).

Letters: V the model's vocabulary (logits width), Vt the tokenizer's, K drafts.

llguidance compiles the grammar against the tokenizer and gives, per position, a bitmask of the
ids allowed next; every other logit becomes -inf. `GrammarState` is one sequence's place:
`start` compiles (ValueError naming the field, also for a language found empty at the first
mask), `allowed(drafts)` -> (K + 1, V) bool rows after the output and after each draft prefix
(all False once llguidance is in error: a sampling failure, never a "stop"), `accept` advances,
`fork` copies for n > 1, `done` says the grammar is complete. Ids >= Vt are never allowed. The
translated tokenizer and compiled grammars are cached (`GRAMMAR_CACHE_SIZE`: a server compiles
off its event loop, then its engine copies). `generate_structured` is the one-sequence reference
loop.

Left out on purpose: llguidance's batched mask kernel and thread pool, fast-forward tokens, JSON
whitespace options, tool-call grammars.
"""
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from minillm._validate import check_int
from minillm.model.kv_cache import KVCache
from minillm.model.sampling import next_token

GRAMMAR_CACHE_SIZE = 64             # compiled grammars kept (each a few KB to a few MB)
TOKENIZER_CACHE_SIZE = 4            # tokenizers translated for llguidance
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)   # errors without a parser-state dump


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, dict or str), `regex`, `choice` (list of str),
    `grammar` (Lark), `json_object=True` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise TypeError(f"json_object must be True or False, got {self.json_object!r}")
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"{name} must be a non-empty str, got {v!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError(f"choice must be a non-empty list of non-empty str, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))

    def kind_and_text(self) -> tuple[str, str]:
        """(the field that is set, its text for llguidance): the cache key of the grammar."""
        if self.json_object:
            return "json_object", '{"type": "object"}'
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                return "json", json.dumps(schema)     # key order kept: it orders properties
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


_lock = threading.Lock()            # the server starts grammars from worker threads
_tokenizers: OrderedDict = OrderedDict()    # id(tokenizer) -> (tokenizer, LLTokenizer)
_grammars: OrderedDict = OrderedDict()      # (id(LLTokenizer), field, text) -> fresh LLMatcher


def _lltokenizer(tokenizer) -> llguidance.LLTokenizer:
    """The tokenizer translated for llguidance, once per tokenizer object. The entry holds the
    tokenizer itself, so its id cannot be reused by another object while cached."""
    key = id(tokenizer)
    with _lock:
        if key in _tokenizers:
            _tokenizers.move_to_end(key)
            return _tokenizers[key][1]
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise TypeError(f"structured output needs a fast Hugging Face tokenizer, got "
                        f"{type(tokenizer).__name__}")
    # here, not at the top: it imports transformers (0.7 s), which `import minillm` does not need
    # and which a caller holding a Hugging Face tokenizer has loaded already
    from llguidance.hf import from_tokenizer
    lltok = from_tokenizer(tokenizer)
    with _lock:
        _tokenizers[key] = (tokenizer, lltok)
        while len(_tokenizers) > TOKENIZER_CACHE_SIZE:
            _tokenizers.popitem(last=False)
    return lltok


def _grammar_text(name: str, text: str) -> str:
    if name in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(text)
    if name == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if name == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def _compile(params: StructuredOutputsParams, lltok) -> llguidance.LLMatcher:
    """A fresh matcher for these params: copied from the cache, else compiled and cached."""
    name, text = params.kind_and_text()
    key = (id(lltok), name, text)
    with _lock:
        if key in _grammars:
            _grammars.move_to_end(key)
            return _grammars[key].deep_copy()
    matcher = llguidance.LLMatcher(lltok, _grammar_text(name, text), log_level=0, limits=_LIMITS)
    if matcher.is_error():
        raise ValueError(f"structured_outputs.{name} does not compile: {matcher.get_error()}")
    probe = matcher.deep_copy()          # llguidance finds some empty languages at the first mask
    probe.compute_bitmask()
    if probe.is_error():
        raise ValueError(f"structured_outputs.{name} matches no string (its language is empty): "
                         f"{probe.get_error().splitlines()[0]}")
    with _lock:
        _grammars[key] = matcher.deep_copy()
        while len(_grammars) > GRAMMAR_CACHE_SIZE:
            _grammars.popitem(last=False)
    return matcher


class GrammarState:
    """One sequence's position in its grammar (see the module docstring for the contract)."""

    def __init__(self, matcher: llguidance.LLMatcher, lltok: llguidance.LLTokenizer,
                 vocab_size: int):
        self._m, self._lltok, self.vocab_size = matcher, lltok, vocab_size
        self._vt, self._eos = lltok.vocab_size, frozenset(lltok.eos_tokens)

    @classmethod
    def start(cls, params: StructuredOutputsParams, tokenizer, vocab_size: int) -> "GrammarState":
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"params must be a StructuredOutputsParams, got {type(params).__name__}")
        if tokenizer is None:
            raise TypeError("structured output needs the model's tokenizer, got None")
        check_int("vocab_size", vocab_size, 1)
        lltok = _lltokenizer(tokenizer)
        return cls(_compile(params, lltok), lltok, vocab_size)

    def _row(self, out: np.ndarray) -> None:
        """Write the matcher's bitmask now into out (V,) bool: bit i of 32-bit word w is id
        32 w + i (little-endian words, so numpy's little bit order reads the bytes in id order).
        numpy, not torch: on a busy CPU torch's thread pool makes each small op cost ~10 ms."""
        packed = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)          # (4 W,)
        if self._m.is_error():              # no way on (its mask allows EOS): nothing is allowed
            out[:] = False
            return
        bits = np.unpackbits(packed, bitorder="little").view(np.bool_)            # (32 W,)
        n = min(self._vt, self.vocab_size)
        out[:n] = bits[:n]
        out[n:] = False

    def _takes(self, token_id: int) -> bool:
        """Whether the grammar takes token_id next (touches nothing). Once the grammar is done
        only EOS is taken, and llguidance's validate_tokens says no to that: asked apart."""
        if not 0 <= token_id < self._vt:
            return False
        if self._m.is_stopped():
            return token_id in self._eos
        return self._m.validate_tokens([token_id]) == 1

    def _advance(self, token_id: int) -> int:
        """Consume a token `_takes` said yes to; 1 if it moved the matcher (a rollback step),
        0 for an EOS after the end, which llguidance takes without recording it."""
        if self._m.is_stopped():
            return 0
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"llguidance refused a token it validated: {self._m.get_error()}")
        return 1

    def allowed(self, drafts=()) -> torch.Tensor:
        """(K + 1, V) bool: row j is what may follow the output so far plus drafts[:j]."""
        drafts = [int(t) for t in drafts]
        rows = np.ones((len(drafts) + 1, self.vocab_size), dtype=np.bool_)     # (K + 1, V)
        self._row(rows[0])
        moved = 0
        for j, t in enumerate(drafts):
            if not self._takes(t):                # refused: rows j + 1 onwards stay all True
                break
            moved += self._advance(t)
            self._row(rows[j + 1])
        if moved and not self._m.rollback(moved):
            raise RuntimeError(f"llguidance could not roll back {moved} drafts: {self._m.get_error()}")
        return torch.from_numpy(rows)

    def accept(self, token_ids) -> None:
        """Advance by the tokens the engine appended; a token the grammar refuses is a bug
        upstream (the mask forbade it) and raises ValueError with the state unchanged."""
        ids = [int(t) for t in token_ids]
        moved = 0
        for i, t in enumerate(ids):
            if not self._takes(t):
                if moved:
                    self._m.rollback(moved)
                raise ValueError(f"token id {t} (position {i} of {ids}) is not allowed by the "
                                 f"grammar here; the mask from allowed() forbids it")
            moved += self._advance(t)

    def fork(self) -> "GrammarState":
        return GrammarState(self._m.deep_copy(), self._lltok, self.vocab_size)

    @property
    def done(self) -> bool:
        return self._m.is_stopped() and not self._m.is_error()


@torch.inference_mode()
def generate_structured(model, prompt_ids: list[int], state: GrammarState, max_new_tokens: int,
                        eos_token_id: int, temperature: float = 0.0,
                        generator: torch.Generator | None = None, trace: list | None = None
                        ) -> list[int]:
    """The reference constrained decode of one prompt: each step masks the logits with
    `state.allowed()`, takes the next token (greedy or sampled), `accept`s it, and stops at
    `eos_token_id` or `max_new_tokens`. Returns the new ids (EOS included if reached). With a
    `trace` list, appends (raw logits (V,), allowed (V,)) per step, for `viz.token_mask`."""
    check_int("max_new_tokens", max_new_tokens, 1)
    T, dev = len(prompt_ids), model.device
    cache = KVCache(model.config, 1, T + max_new_tokens, dev, model.dtype)
    x = torch.tensor([list(prompt_ids)], device=dev)                 # (1, T)
    logits = model(x, torch.arange(T, device=dev), cache,
                   logits_index=torch.tensor([T - 1], device=dev))[:, -1]    # (1, V)
    out: list[int] = []
    while True:
        allowed = state.allowed()[0].to(dev)                         # (V,)
        if trace is not None:
            trace.append((logits[0].float().cpu(), allowed.cpu()))
        tok = next_token(logits.masked_fill(~allowed, float("-inf")), temperature,
                         generator=generator)                        # (1,)
        out.append(int(tok))
        state.accept(out[-1:])
        if out[-1] == eos_token_id or len(out) == max_new_tokens:
            return out
        position = torch.tensor([T + len(out) - 1], device=dev)
        logits = model(tok[:, None], position, cache)[:, -1]         # (1, V)
