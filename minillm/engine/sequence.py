"""Request and sequence state of the serving engine: where each sequence of a request stands
(`Sequence`), and what the engine hands back (`RequestOutput`). `SamplingParams` is in
sampling_params.py.

No tensors and no policy: these classes only remember. A request holds `n` sequences, forked from
one after its prompt is prefilled. A sequence's tokens are prompt + output; `num_computed_tokens`
of them have KV in the cache, the rest are what the next passes compute (preemption by recompute
resets it to 0). A sequence may carry its `Detokenizer` (text, stop strings), prepared logits
processors (`procs`), its grammar state (`grammar`) and logprobs (`logprobs`,
`cumulative_logprob`).

`best_of` > n samples best_of sequences and returns the n with the highest cumulative logprob,
indexed 0..n-1 in that order (vLLM's semantics); until the request finishes they are the best so
far, so a server refuses to stream such a request.

Left out on purpose: beam search, LoRA.
"""
import enum
from dataclasses import dataclass, field

from minillm.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not in the cache: new, or preempted by recompute
    RUNNING = "running"      # has blocks; scheduled every step
    SWAPPED = "swapped"      # preempted by swap: its KV waits in CPU memory
    FINISHED = "finished"


@dataclass(eq=False)   # identity, not field equality: each sequence is one object
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0                       # which of the request's n completions
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    swapped_kv: object = None            # CPU copy of its blocks while SWAPPED
    num_preemptions: int = 0
    num_cached_tokens: int = 0           # prompt tokens found in the prefix cache at admission
    draft_token_ids: list[int] = field(default_factory=list)   # speculative drafts for this step
    draft_probs: object = None           # (1, K, V) q of a sampling draft model, else None
    draft_parents: list[int] | None = None   # a token tree: parents of [newest, *drafts]; None: chain
    features: object = None              # FeatureWindow: the target's hidden rows (spec/features.py)
    error: str | None = None             # why it was aborted, when a token could not be drawn
    detok: object = None                 # Detokenizer (text, stop strings) when there is a tokenizer
    priority: int = 0                    # lower = served first (scheduling_policy="priority")
    promoted: bool = False               # waited past its class's max_queue_wait (policies/priority.py)
    procs: object = None                 # LogitsProcessors (logits_process.py), None: none asked
    grammar: object = None               # GrammarState (structured.py) for structured output
    logprobs: list = field(default_factory=list)   # one {token id: Logprob} per output token
    cumulative_logprob: float = 0.0      # sum of the output tokens' logprobs (when computed)

    def child(self, seq_id: int, index: int) -> "Sequence":
        """Completion `index` of the same request, forked after the prompt: the prompt's progress,
        processors, a copy of the grammar's and of the features' state."""
        return Sequence(seq_id, self.request_id, self.prompt_token_ids, self.params,
                        self.arrival_time, index=index, num_computed_tokens=self.num_computed_tokens,
                        priority=self.priority, procs=self.procs,
                        grammar=self.grammar.fork() if self.grammar is not None else None,
                        features=self.features.copy() if self.features is not None else None)

    def clear_drafts(self) -> None:      # no drafts this step, chain or tree
        self.draft_token_ids, self.draft_probs, self.draft_parents = [], None, None

    @property
    def needs_processing(self) -> bool:
        """Whether its logits change before sampling (a grammar or any processor)."""
        return self.procs is not None or self.grammar is not None

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached blocks: not when it asks for prompt logprobs,
        which need every prompt position computed (vLLM skips the cache for it too)."""
        return self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """(prompt + output + drafts)[start:] without building the whole context first: the
        scheduler and the runner ask every step for a decode's newest token (and its drafts)."""
        p = len(self.prompt_token_ids)
        if start < p:
            tail = self.prompt_token_ids[start:] + self.output_token_ids
        else:
            tail = self.output_token_ids[start - p:]
        if not self.draft_token_ids:
            return tail
        return tail + self.draft_token_ids[max(0, start - self.num_tokens):]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish_reason_after(self, tok: int, eos_token_id, max_seq_len: int) -> str | None:
        """Why the sequence ends with `tok` just appended: "stop" (a stop string, a stop token,
        EOS unless ignored, or a complete grammar), "length" (max_tokens or the model's
        context), or None."""
        p = self.params
        if (self.detok is not None and self.detok.stopped) or tok in (p.stop_token_ids or ()) or (
                not p.ignore_eos and tok == eos_token_id) or (
                self.grammar is not None and self.grammar.done):
            return "stop"
        if len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_seq_len:
            return "length"
        return None


@dataclass
class RequestMetrics:
    """Wall-clock times (seconds on the engine's clock) and engine steps of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    arrival_step: int = 0
    first_token_step: int | None = None
    finish_step: int | None = None
    num_generated: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0                 # prompt tokens found in the prefix cache
    num_spec_steps: int = 0                    # speculative decoding: verify steps,
    num_draft_tokens: int = 0                  # draft tokens proposed,
    num_accepted_tokens: int = 0               # and those accepted
    token_times: list[float] = field(default_factory=list)   # when each token of completion 0 came
    priority: int = 0                          # the request's priority (lower = served first)
    first_scheduled_time: float | None = None  # start of the first step that ran it (vLLM's name)
    num_promotions: int = 0                    # 1 once it waited past its class's bound

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that ran it (vLLM's time_in_queue)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated - 1)

    @property
    def accepted_fraction(self) -> float | None:
        """Accepted / drafted tokens, as measured (None without speculative decoding). Not the
        per-token alpha of the theory (`SpecStats.alpha_estimate`), which counts tested drafts only."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_rate(self) -> float | None:
        """Alias of `accepted_fraction`, kept for code that reads the earlier name. In minillm
        `acceptance_rate` means accepted / drafted and nothing else."""
        return self.accepted_fraction

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, queue_time=self.queue_time, accepted_fraction=self.accepted_fraction,
                 acceptance_rate=self.acceptance_rate)
        return d


@dataclass
class Logprob:
    """One token's log probability (vLLM's shape; the model's own or the law it was drawn from,
    by `EngineConfig.logprobs_mode`): its rank there (1 = the most likely) and its text when the
    engine has a tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion. `text` is None without a tokenizer; a stop string cuts it (not the ids).
    With `SamplingParams(logprobs=k)`, `logprobs[i]` maps the sampled token i and the k most
    likely ids to their `Logprob`; `cumulative_logprob` sums the sampled tokens' logprobs."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What `step()` and `generate()` return for one request. With n > 1, `outputs` holds every
    completion and `token_ids` / `finish_reason` / `text` are those of completion 0. `prompt` is
    the prompt string when one was given (None for token ids). `error` says why a request ended
    with finish_reason "abort" when the engine knows (a queue timeout, a token that could not be
    drawn); None otherwise."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    text: str | None = None
    prompt: str | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # [0] is None, as in vLLM

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class Request:
    """One request: its sequences (1 before the prompt is prefilled, then n) and its metrics."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    forked: bool = False
    prompt: str | None = None            # the string the prompt ids came from, if any
    prompt_logprobs: list | None = None  # SamplingParams(prompt_logprobs=k): [None, {id: Logprob}..]

    @property
    def num_seqs(self) -> int:
        """Sequences the request samples: best_of when set, else n."""
        return self.params.best_of or self.params.n

    @property
    def finished(self) -> bool:
        done = all(s.is_finished for s in self.seqs)
        return done and (self.forked or self.num_seqs == 1 or self.seqs[0].finish_reason == "abort")

    def output(self, with_text: bool = False) -> RequestOutput:
        """A snapshot. `with_text` (the engine has a tokenizer): text is "" before a first token.
        With best_of > n: the n best completions by cumulative logprob, best first."""
        p = self.params
        best_of = self.num_seqs > p.n
        outs = [CompletionOutput(s.index, list(s.output_token_ids), s.finish_reason,
                                 s.detok.text if s.detok is not None else ("" if with_text else None),
                                 list(s.logprobs) if p.logprobs is not None else None,
                                 s.cumulative_logprob if p.logprobs is not None or best_of else None)
                for s in sorted(self.seqs, key=lambda s: s.index)]
        if best_of and self.forked:
            outs = sorted(outs, key=lambda o: (-o.cumulative_logprob, o.index))[:p.n]
            for i, o in enumerate(outs):
                o.index = i
        error = next((s.error for s in self.seqs if s.error), None)
        prompt_lps = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs,
                             self.finished, self.metrics, outs[0].text, self.prompt, error,
                             prompt_lps)
