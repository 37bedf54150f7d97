"""What comes into the engine, checked and mapped before anything is queued: a request's prompt
(`check_prompt`: token ids that fit the vocabulary, the context and the whole pool), its logits
processors and grammar (`request_state`), its priority (`check_request_priority`), and
`LLMEngine.generate`'s arguments as one (prompt, params, priority) per request (`batch_requests`).
The disaggregated router runs the same checks before it sends a request anywhere.

Left out on purpose: the fields of `SamplingParams` on their own (sampling_params.py checks them
when made) and the priority classes themselves (policies/priority.py).
"""
from minillm._validate import ArgumentTypeError, check_int
from minillm.engine.logits_process import LogitsProcessors
from minillm.engine.structured import GrammarState


def check_request(params, max_num_seqs: int, tokenizer) -> None:
    """What `add_request` refuses beyond the prompt: more completions than seats, and stop
    strings with no tokenizer to see text."""
    num_seqs = params.best_of or params.n
    if num_seqs > max_num_seqs:
        name = "best_of" if params.best_of else "n"
        raise ValueError(f"{name}={num_seqs} completions can never run together with "
                         f"max_num_seqs={max_num_seqs}; use {name} <= max_num_seqs")
    if params.stop and tokenizer is None:
        raise ValueError("SamplingParams.stop needs LLMEngine(..., tokenizer=...) to see text; "
                         "use stop_token_ids with token ids")


def check_prompt(prompt, params, tokenizer, model_config, num_blocks: int, block_size: int) -> list[int]:
    """A request's prompt as token ids, or a TypeError/ValueError naming what is wrong: not ids
    (or a str without a tokenizer), empty, outside the vocabulary, no room left in the context,
    or more KV slots than the whole pool holds."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("a str prompt needs LLMEngine(..., tokenizer=...); pass token ids instead")
        prompt = tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise TypeError("prompt must be a str or a list of int token ids")
    if not prompt:
        raise ValueError("prompt must hold at least one token, got an empty prompt")
    V, ctx = model_config.vocab_size, model_config.max_seq_len
    bad = [t for t in prompt if not 0 <= t < V]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {V}) (vocab_size), got {bad[:5]}")
    if len(prompt) >= ctx:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the model's "
                         f"context of max_seq_len={ctx} tokens")
    need = min(len(prompt) + params.max_tokens, ctx)
    pool = num_blocks * block_size
    if need > pool:
        raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs "
                         f"{need} KV slots, but the whole pool holds num_blocks={num_blocks}"
                         f" x block_size={block_size} = {pool}")
    return list(prompt)


def request_state(params, tokenizer, vocab_size: int, eos_token_id=None,
                  prefix_caching: bool = False):
    """A request's prepared logits processors (None if it asks for none) and its grammar state
    (None without structured output), or ValueError/TypeError naming the field: a logit_bias id
    outside the vocabulary, bad_words or structured_outputs without a tokenizer, a bad schema.
    `prefix_caching` changes nothing: a prompt_logprobs request skips the cache (scheduler.py)."""
    procs = LogitsProcessors.build(params, vocab_size, tokenizer, eos_token_id)
    grammar = None
    if params.structured_outputs is not None:
        if tokenizer is None:
            raise ArgumentTypeError("structured_outputs needs LLMEngine(..., tokenizer=...): the "
                                    "grammar is compiled against the tokenizer")
        grammar = GrammarState.start(params.structured_outputs, tokenizer, vocab_size)
    return procs, grammar


def batch_requests(prompts, params=None, sampling_params=None, priority=None) -> list[tuple]:
    """`LLMEngine.generate`'s arguments as one (prompt, params, priority) per request: one
    prompt (token ids) or a list; `params` or vLLM's `sampling_params`, one for all or one per
    prompt; `priority` None (0), an int, or one per prompt. Lengths that disagree raise."""
    if params is not None and sampling_params is not None:
        raise TypeError("pass params or sampling_params, not both")
    params = sampling_params if params is None else params
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of str or of token-id lists")
    if isinstance(prompts[0], int):
        prompts = [prompts]
    plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
    prios = priority if isinstance(priority, (list, tuple)) else \
        [0 if priority is None else priority] * len(prompts)
    if len(prios) != len(prompts):
        raise ValueError(f"got {len(prios)} priorities for {len(prompts)} prompts")
    return list(zip(prompts, plist, prios))


def check_priority_value(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (lower = served first), "
                        f"got {type(value).__name__} {value!r}")


def check_request_priority(priority, policy: str, classes) -> None:
    """add_request's check: an int; non-zero needs "priority"; with classes, one of theirs."""
    check_priority_value("priority", priority)
    if policy == "fcfs" and priority != 0:
        raise ValueError(f"priority={priority} needs EngineConfig(scheduling_policy='priority'); "
                         "fcfs serves every request at priority 0")
    allowed = sorted(c.priority for c in classes)
    if classes and priority not in allowed:
        names = ", ".join(f"{c.priority}={c.name}" for c in sorted(classes, key=lambda c: c.priority))
        raise ValueError(f"priority={priority} names no priority class; allowed: {allowed} ({names})")


def check_partial_prefills(max_num_partial_prefills: int, max_long_partial_prefills: int,
                           long_prefill_token_threshold: int, chunked: bool = True) -> None:
    """ValueError (naming the field and its range) unless 1 <= max_long_partial_prefills <=
    max_num_partial_prefills and long_prefill_token_threshold >= 0 (0: no prompt is long); the
    knobs shape chunks, so they need chunked prefill."""
    check_int("max_num_partial_prefills", max_num_partial_prefills, 1)
    check_int("max_long_partial_prefills", max_long_partial_prefills, 1, max_num_partial_prefills)
    check_int("long_prefill_token_threshold", long_prefill_token_threshold, 0)
    if not chunked and (max_num_partial_prefills > 1 or long_prefill_token_threshold > 0):
        raise ValueError("max_num_partial_prefills > 1 and long_prefill_token_threshold > 0 need "
                         "enable_chunked_prefill=True")
