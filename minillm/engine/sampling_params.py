"""What one request asks for, `SamplingParams` (vLLM's names), and the one check of its fields.

Every field has one rule, written once in `SamplingParams._check`, and runs once, when the
object is built. Both doors build one: `LLM` / `LLMEngine.add_request` from the caller's
object, the HTTP server (serve/protocol.py) from the JSON body. So a value is refused at both
doors or at neither (tests/engine/test_sampling_params.py holds it). A refused value raises
`SamplingParamError`, a ValueError whose `field` names the field (`SamplingParamTypeError`,
also a TypeError, for a value of the wrong type); the server turns it into a 400 whose `param`
is the field's HTTP name. The ranges are OpenAI's for OpenAI's fields (at most 4 stop strings,
penalties [-2, 2], logit_bias [-100, 100]) except temperature, [0, 100] (above OpenAI's 2, as
vLLM and the offline API allow, but bounded so logits / T stays finite), and vLLM's for its
extras (top_k -1 or >= 1, repetition_penalty > 0, min_p [0, 1], at most 20 logprobs).

Left out on purpose: limits that depend on the engine or the model (n and best_of within
max_num_seqs, max_tokens within the context, token ids within the vocabulary): they are checked
where the engine is known (engine/requests.py; the server before tokenizing), not here.
"""
from dataclasses import dataclass

from minillm._validate import check_int, check_real
from minillm.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20          # most top logprobs a request may ask for (vLLM's max_logprobs)
MAX_STOP = 4               # most stop strings a request may give (OpenAI's limit)
MAX_TEMPERATURE = 100      # far past any useful value; 1e308 would turn -inf logits into nan


class SamplingParamError(ValueError):
    """A SamplingParams field out of its range; `field` is the field's name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SamplingParamTypeError(SamplingParamError, TypeError):
    """A SamplingParams field of the wrong type (a TypeError and a ValueError)."""


def _str_list(name: str, value, most: int | None = None) -> list[str] | None:
    """None, a str or a list of non-empty str -> list[str] or None (an empty list is None)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise TypeError(f"{name} must be None, a str or a list of str, got {value!r}")
    if "" in items:
        raise ValueError(f"{name} must hold non-empty strings, got {value!r}")
    if most is not None and len(items) > most:
        raise ValueError(f"{name} must hold at most {most} strings, got {len(items)}")
    return list(items) or None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names). temperature 0 = greedy; top_k -1 and top_p 1.0
    are off; `seed` gives the request its own random stream; `n` completions share the prompt.
    **Unlike vLLM (temperature=1.0) the default is greedy.** `stop`: a str or list of str; the
    text is cut before the first one it contains, with finish_reason "stop" (needs a tokenizer)."""

    temperature: float = 0.0                   # [0, 100]
    top_p: float = 1.0                         # (0, 1]
    top_k: int = -1                            # -1 (off) or >= 1
    max_tokens: int = 16                       # >= 1 (0: score the prompt, with prompt_logprobs)
    seed: int | None = None
    stop_token_ids: list[int] | None = None    # token ids >= 0
    ignore_eos: bool = False
    n: int = 1                                 # >= 1
    stop: list[str] | None = None              # at most MAX_STOP non-empty strings
    # logits processors (vLLM's names; 0 / 1.0 / None are off)
    presence_penalty: float = 0.0              # [-2, 2], minus once per token already output
    frequency_penalty: float = 0.0             # [-2, 2], minus per occurrence in the output
    repetition_penalty: float = 1.0            # > 0, over prompt + output (transformers' rule)
    min_p: float = 0.0                         # [0, 1], drop tokens below min_p * the top prob
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_tokens: int = 0                        # [0, max_tokens], no EOS / stop token before
    bad_words: list[str] | None = None         # words (token sequences) never completed
    # what comes back
    logprobs: int | None = None                # [0, 20] top logprobs per output token (0: its own)
    prompt_logprobs: int | None = None         # the same for each prompt token
    best_of: int | None = None                 # >= n: sample best_of, return the n best (n: None)
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False   # keep the stop string's (stop token's) text

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            try:
                value = getattr(self, f"_check_{name}")()
            except TypeError as err:                   # ArgumentTypeError is both: a type error
                raise SamplingParamTypeError(name, str(err)) from None
            except ValueError as err:
                raise SamplingParamError(name, str(err)) from None
            object.__setattr__(self, name, value)   # its one form: a float, a list or None

    # ---- one rule per field, in field order (min_tokens and best_of read fields checked before);
    # each returns the field's value in its one form
    def _check_temperature(self):
        return check_real("temperature", self.temperature, 0, MAX_TEMPERATURE)

    def _check_top_p(self):
        return check_real("top_p", self.top_p, 0, 1, low_open=True)

    def _check_top_k(self):
        if check_int("top_k", self.top_k, -1) == 0:
            raise ValueError("top_k must be -1 (off) or an int >= 1, got 0")
        return self.top_k

    def _check_max_tokens(self):
        if type(self.max_tokens) is int and self.max_tokens == 0 and self.prompt_logprobs is not None:
            return 0                                   # score the prompt: no token is generated
        return check_int("max_tokens", self.max_tokens, 1)

    def _check_seed(self):
        return None if self.seed is None else check_int("seed", self.seed)

    def _check_stop_token_ids(self):
        ids = self.stop_token_ids
        if not ids:
            return None
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be None or a list of token ids, got {ids!r}")
        return [check_int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(ids)] or None

    def _check_ignore_eos(self):
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        return self.ignore_eos

    def _check_n(self):
        return check_int("n", self.n, 1)

    def _check_stop(self):
        return _str_list("stop", self.stop, MAX_STOP)

    def _check_presence_penalty(self):
        return check_real("presence_penalty", self.presence_penalty, -2, 2)

    def _check_frequency_penalty(self):
        return check_real("frequency_penalty", self.frequency_penalty, -2, 2)

    def _check_repetition_penalty(self):
        return check_real("repetition_penalty", self.repetition_penalty, 0, None, low_open=True)

    def _check_min_p(self):
        return check_real("min_p", self.min_p, 0, 1)

    def _check_logit_bias(self):
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got "
                            f"{type(self.logit_bias).__name__}")
        return {check_int("logit_bias token id", tok, 0): check_real(f"logit_bias[{tok}]", b, -100, 100)
                for tok, b in self.logit_bias.items()}

    def _check_min_tokens(self):
        return check_int("min_tokens", self.min_tokens, 0, self.max_tokens)

    def _check_bad_words(self):
        if self.bad_words is not None and isinstance(self.bad_words, str):
            raise TypeError(f"bad_words must be a list of non-empty str, got {self.bad_words!r}")
        return _str_list("bad_words", self.bad_words)

    def _check_logprobs(self):
        return None if self.logprobs is None else check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    def _check_prompt_logprobs(self):
        k = self.prompt_logprobs
        return None if k is None else check_int("prompt_logprobs", k, 0, MAX_LOGPROBS)

    def _check_best_of(self):
        if self.best_of is None or check_int("best_of", self.best_of, self.n) == self.n:
            return None                                # best_of n of n: the same as none
        return self.best_of

    def _check_structured_outputs(self):
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams or None, got "
                            f"{type(so).__name__}")
        return so

    def _check_include_stop_str_in_output(self):
        if not isinstance(self.include_stop_str_in_output, bool):
            raise TypeError(f"include_stop_str_in_output must be a bool, got "
                            f"{self.include_stop_str_in_output!r}")
        return self.include_stop_str_in_output
