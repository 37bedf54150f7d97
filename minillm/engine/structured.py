"""Structured output: a grammar that masks the tokens a sequence may take next (vLLM's
`StructuredOutputsParams`: `json`, `regex`, `choice`, `grammar`, `json_object`).

The grammar engine is llguidance (one of the two vLLM uses): it compiles a JSON schema, a regex,
a list of choices or a Lark grammar against the tokenizer, and for each position says which token
ids may come next, as a bitmask over the vocabulary. The engine turns that into a boolean row
(True = allowed) and sets every other logit to -inf before it samples, so the answer can only
take a shape the grammar accepts.

`GrammarState` is one sequence's place in its grammar. Its contract with the engine:
- `GrammarState.start(params, tokenizer, vocab_size)` compiles (ValueError naming the field on a
  bad schema, regex or grammar);
- `allowed(drafts)` -> (len(drafts) + 1, V) bool: the tokens allowed after the output so far and
  after each prefix drafts[:j] (speculative decoding scores K drafts at once); rows after the
  first draft the grammar refuses are all True, since that draft's target probability is 0 and
  the rows after it are never used;
- `accept(token_ids)` advances by the tokens the engine appended;
- `fork()` copies the state for the n completions of one prompt;
- `done`: the grammar is complete and allows nothing more but the end of the sequence.
"""
from dataclasses import dataclass


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


class GrammarState:
    """One sequence's position in its grammar (see the module docstring for the contract)."""

    @classmethod
    def start(cls, params: StructuredOutputsParams, tokenizer, vocab_size: int) -> "GrammarState":
        raise NotImplementedError

    def allowed(self, drafts=()):
        raise NotImplementedError

    def accept(self, token_ids) -> None:
        raise NotImplementedError

    def fork(self) -> "GrammarState":
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError
