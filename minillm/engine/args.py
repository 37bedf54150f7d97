"""What comes into the engine, checked and mapped: a request's prompt (`check_prompt`), its logits
processors and grammar (`request_state`), a batch of requests (`batch_requests`), vLLM-style
`speculative_config` dicts, and sizing the block pool from `gpu_memory_utilization`.

Pool size, in order: `num_blocks` if given (vLLM's num_gpu_blocks_override); on a CUDA device with
`gpu_memory_utilization` set, N = floor((u * total - weights - activations) / bytes per block),
the arithmetic of `kv_math.plan_capacity`, but with the weights and the activation peak measured
on the device; otherwise `kv_cache_memory_bytes` // bytes per block. On a CPU
`gpu_memory_utilization` is ignored with a warning, so one script runs on a laptop and a GPU.
Bytes per block follow `kv_cache_dtype` (scales included): int8 or fp8 KV gets about 2x (bf16)
or 4x (fp32) the blocks of the same memory. The host KV tier's slots (`offload_num_blocks`) are
`kv_offloading_size` GiB // the same bytes per block, refused beyond the host memory available.

Left out on purpose: memory held by other processes (vLLM checks free memory at start-up),
CUDA-graph memory, and vLLM's other speculative methods (mtp, suffix).
"""
import dataclasses
import math
import warnings

import torch

from minillm.engine.logits_process import LogitsProcessors
from minillm.engine.spec_methods import TREE_METHODS, check_tree
from minillm.engine.structured import GrammarState
from minillm.paging.host_pool import host_num_blocks
from minillm.paging.paged_cache import PagedKVCache
from minillm._validate import ArgumentTypeError, check_int, check_real

SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
             "speculative_token_tree", "disable_by_batch_size")
SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "medusa": "medusa",
                "eagle": "eagle", "lookahead": "lookahead"}   # vLLM's -> ours


def apply_speculative_config(config, spec: dict, draft_model=None):
    """(EngineConfig, vLLM speculative_config dict, draft_model) -> (EngineConfig, draft_model,
    drafter).

    The dict fills the flat fields (its "disable_by_batch_size" is
    `speculative_disable_by_batch_size`, as in vLLM); a flat field already set to something else raises ValueError.
    "model" is a Transformer for "draft_model" (`LLM` loads one given by name first), and the
    drafter for "medusa" / "eagle" / "lookahead" (a proposer, or None; spec_methods.py). The
    dict is only read, and everything is checked before anything is made.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; allowed: {list(SPEC_KEYS)}")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(SPEC_METHODS)}, "
                         f"got {method!r}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs 'num_speculative_tokens'")
    k = spec["num_speculative_tokens"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int >= 1, "
                         f"got {k!r}")
    fields = {"speculative_method": SPEC_METHODS[method]}
    fields.update({k: spec[k] for k in SPEC_KEYS[1:4] if k in spec})
    if spec.get("disable_by_batch_size") is not None:   # vLLM's SpeculativeConfig key -> flat field
        fields["speculative_disable_by_batch_size"] = check_int(
            "speculative_config['disable_by_batch_size'] (None or)", spec["disable_by_batch_size"], 2)
    if spec.get("speculative_token_tree") is not None:
        if fields["speculative_method"] not in TREE_METHODS:
            raise ValueError(f"speculative_config['speculative_token_tree'] needs a method in "
                             f"{list(TREE_METHODS)}, got {method!r}")
        fields["speculative_token_tree"] = check_tree(spec["speculative_token_tree"], k, None)
    defaults = type(config)()
    for name, value in fields.items():
        flat = getattr(config, name)
        if flat != getattr(defaults, name) and flat != value:
            raise ValueError(f"speculative_config sets {name}={value!r} but EngineConfig has "
                             f"{name}={flat!r}; set it in one place")
    drafter = None
    if "model" in spec and fields["speculative_method"] in TREE_METHODS:
        drafter = spec["model"]
    elif "model" in spec:
        if fields["speculative_method"] != "draft":
            raise ValueError("speculative_config['model'] needs method 'draft_model', 'medusa' "
                             "or 'eagle'")
        draft = spec["model"]
        if isinstance(draft, str):
            raise ValueError("a draft model given by name needs LLM(...); LLMEngine takes a Transformer")
        if draft_model is not None and draft_model is not draft:
            raise ValueError("the draft model is given twice (draft_model= and speculative_config"
                             "['model']); set it in one place")
        draft_model = draft
    return dataclasses.replace(config, **fields), draft_model, drafter


def num_blocks_for_memory(total_bytes: float, utilization: float, weight_bytes: float,
                          activation_bytes: float, cfg, block_size: int,
                          dtype=torch.float32, kv_cache_dtype: str = "auto") -> int:
    """N = floor((utilization * total - weights - activations) / (P * KV bytes per token)).

    The same arithmetic as `kv_math.plan_capacity`, for measured weight and activation bytes.
    """
    check_real("gpu_memory_utilization", utilization, 0, 1, low_open=True)
    kv_budget = utilization * total_bytes - weight_bytes - activation_bytes
    per_block = PagedKVCache.bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
    if kv_budget < per_block:
        raise ValueError(f"gpu_memory_utilization={utilization} of {total_bytes / 2**30:.2f} GiB "
                         f"leaves no KV block after weights ({weight_bytes / 2**30:.2f} GiB) and "
                         f"activations ({activation_bytes / 2**30:.2f} GiB)")
    return int(math.floor(kv_budget / per_block))


def param_bytes(*models) -> int:
    """Bytes of the models' parameters (a tied embedding counted once)."""
    seen, total = set(), 0
    for m in models:
        for p in (m.parameters() if m is not None else ()):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


@torch.no_grad()
def measure_activation_bytes(model, num_tokens: int) -> int:
    """Peak CUDA memory above the weights during one forward of `num_tokens` tokens."""
    device = next(model.parameters()).device
    num_tokens = min(num_tokens, model.config.max_seq_len)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model(torch.zeros(1, num_tokens, dtype=torch.long, device=device))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def pool_num_blocks(model, config, draft_model=None) -> int:
    """How many KV blocks the engine's pool gets (the order is in the module docstring)."""
    param = next(model.parameters())
    per_block = PagedKVCache.bytes_per_block(model.config, config.block_size, param.dtype,
                                             config.kv_cache_dtype)
    if config.num_blocks is not None:
        return config.num_blocks
    if config.gpu_memory_utilization is not None:
        if param.device.type == "cuda":
            total = torch.cuda.mem_get_info(param.device)[1]
            act = measure_activation_bytes(model, config.max_num_batched_tokens)
            return num_blocks_for_memory(total, config.gpu_memory_utilization,
                                         param_bytes(model, draft_model), act, model.config,
                                         config.block_size, param.dtype, config.kv_cache_dtype)
        warnings.warn(f"gpu_memory_utilization is ignored on {param.device.type}: the pool is "
                      f"sized by kv_cache_memory_bytes={config.kv_cache_memory_bytes}")
    return max(1, config.kv_cache_memory_bytes // per_block)


def offload_num_blocks(model, config) -> int:
    """Host-tier slots for `config.kv_offloading_size` GiB (0: no tier; paging/host_pool.py)."""
    param = next(model.parameters())
    per_block = PagedKVCache.bytes_per_block(model.config, config.block_size, param.dtype,
                                             config.kv_cache_dtype)
    return host_num_blocks(config.kv_offloading_size, per_block)


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
    outside the vocabulary, bad_words or structured_outputs without a tokenizer, a bad schema, or
    prompt_logprobs with prefix caching (a cached prompt token is never computed: no logits)."""
    if params.prompt_logprobs is not None and prefix_caching:
        raise ValueError("prompt_logprobs needs enable_prefix_caching=False: prompt tokens found "
                         "in the prefix cache are never computed, so they have no logits")
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
