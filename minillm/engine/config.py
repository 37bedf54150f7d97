"""`EngineConfig`: every knob of the serving engine in one frozen dataclass, with vLLM's names,
validated when it is made (a bad value raises ValueError naming the field and its range), and
`apply_speculative_config`, which maps vLLM's `speculative_config` dict onto its flat fields.

The groups, each with the module that reads it: the KV pool (`num_blocks`, `gpu_memory_utilization`,
`kv_cache_memory_bytes`: paging/sizing.py; `kv_cache_dtype`: paging/kv_storage.py),
the batch (`max_num_seqs`, `max_num_batched_tokens`), the order within a step and partial prefills
(`prefill_first`, `long_prefill_token_threshold`, ...: scheduler.py; `prefill_step_target_ms`:
policies/prefill_pacer.py), the order across requests (`scheduling_policy`, `priority_classes`:
policies/priority.py), speculative decoding (`num_speculative_tokens`, `speculative_method`,
`speculative_token_tree`, the switch's `speculative_disable_by_batch_size` and
`speculative_min_seq_len`: spec/decoder.py), the decode attention backend (attention/backends.py),
`tensor_parallel_size` (distributed/tp_runner.py, passed in by `LLM`), SLO targets
(policies/slo_controller.py), the host KV tier (`kv_offloading_size`, `offload_idle_s`:
paging/offload.py), `logprobs_mode` (sampler.py), and what a long-running engine keeps
(`retain_finished`, `max_trace_steps`).

Left out on purpose: vLLM's other speculative methods (mtp, suffix).
"""
from dataclasses import dataclass, replace

from minillm._validate import ArgumentTypeError, check_int, check_real
from minillm.attention.backends import ATTENTION_BACKENDS
from minillm.engine.logits_process import LOGPROBS_MODES
from minillm.engine.policies.priority import PriorityClass, check_classes
from minillm.engine.requests import check_partial_prefills
from minillm.kernels.compilation_config import compilation_config
from minillm.spec.methods import SPEC_METHODS, TREE_METHODS, check_tree, tree_paths
from minillm.paging.kv_storage import check_kv_cache_dtype   # the platform is probed by the cache


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs (vLLM's names). `num_blocks=None` sizes the pool from `kv_cache_memory_bytes`,
    or on a GPU from `gpu_memory_utilization` when set (paging/sizing.py; ignored on a CPU)."""

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int | None = None                # None: min(32, what the token budget allows)
    max_num_batched_tokens: int = 256
    enable_chunked_prefill: bool = True
    prefill_first: bool = False                  # True: prompts take the budget before decodes
    max_num_partial_prefills: int = 1            # prompts mid-prefill at once
    max_long_partial_prefills: int = 1           # ... of which longer than the threshold
    long_prefill_token_threshold: int = 0        # chunk cap; more tokens left = long (0: off)
    prefill_step_target_ms: float | None = None  # chunk cap in time, measured per step (None/0: off)
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"           # or "swap"
    scheduling: str = "continuous"               # or "static" (the baseline)
    kv_cache_memory_bytes: int = 512 * 2**20
    num_speculative_tokens: int = 0
    speculative_method: str | None = None         # see SPEC_METHODS (spec/methods.py)
    speculative_token_tree: tuple | str | None = None   # paths of top-k ranks, "auto", None: chain
    speculative_disable_by_batch_size: int | None = None   # no drafts once this many requests run
    speculative_min_seq_len: int | None = None    # a sequence drafts once it holds this many tokens
    prompt_lookup_min: int = 1                    # "ngram": shortest / longest tail to match
    prompt_lookup_max: int = 3
    seed: int = 0                                 # for requests without their own seed
    retain_finished: int = 4096                   # finished requests kept for inspection
    max_trace_steps: int = 100_000                # trace rows kept (oldest dropped first)
    gpu_memory_utilization: float | None = None   # e.g. 0.9: size the pool from GPU memory
    kv_cache_dtype: str = "auto"                  # "auto" (the model's dtype), "int8" or "fp8"
    scheduling_policy: str = "fcfs"               # or "priority" (vLLM's names; policies/priority.py)
    priority_classes: tuple[PriorityClass, ...] = ()   # allowed priorities and their queue bounds
    attention_backend: str = "auto"               # "paged" | "flash_decoding" | "auto" (decode steps)
    tensor_parallel_size: int = 1                 # ranks the model is split over (LLM; tp_runner)
    slo_ttft_p95_ms: float | None = None          # SLO controller targets (policies/slo_controller.py);
    slo_tpot_p95_ms: float | None = None          # None: no target; both None: no controller
    slo_interval_s: float = 2.0                   # seconds between the controller's decisions
    kv_offloading_size: float | None = None       # GiB of host KV tier (None / 0: off; offload.py)
    offload_idle_s: float = 2.0                   # cached blocks idle this long go to the host tier
    compilation_config: object = None             # None: eager; a dict or CompilationConfig:
                                                  # compiled steps (kernels/compiled_steps.py)
    logprobs_mode: str = "raw_logprobs"           # what logprobs show (LOGPROBS_MODES, sampler.py)

    def __post_init__(self):
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("EngineConfig.tensor_parallel_size", self.tensor_parallel_size, 1)  # vs the model: tp_runner
        if self.tensor_parallel_size > 1 and self.num_speculative_tokens > 0:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not support "
                             f"speculative decoding (num_speculative_tokens="
                             f"{self.num_speculative_tokens}, speculative_config); use "
                             f"tensor_parallel_size=1 for it")
        if self.max_num_seqs is None and isinstance(self.max_num_batched_tokens, int):
            object.__setattr__(self, "max_num_seqs", max(1, min(32, self.max_num_batched_tokens)))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "retain_finished", "max_trace_steps"):
            check_int(f"EngineConfig.{name}", getattr(self, name), 1)
        if self.num_blocks is not None:
            check_int("EngineConfig.num_blocks (None or)", self.num_blocks, 1)
        if not isinstance(self.prefill_first, bool):
            raise ArgumentTypeError(f"EngineConfig.prefill_first must be True or False, got "
                                    f"{self.prefill_first!r}")
        check_partial_prefills(self.max_num_partial_prefills, self.max_long_partial_prefills,
                               self.long_prefill_token_threshold, self.enable_chunked_prefill)
        if self.prefill_step_target_ms is not None:
            check_real("EngineConfig.prefill_step_target_ms (None or)", self.prefill_step_target_ms, 0)
            if self.prefill_step_target_ms and not self.enable_chunked_prefill:   # nothing to size
                raise ValueError("prefill_step_target_ms needs enable_chunked_prefill=True")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode must be one of {list(LOGPROBS_MODES)}, "
                             f"got {self.logprobs_mode!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if isinstance(self.priority_classes, list):      # one form: a tuple (the dataclass is frozen)
            object.__setattr__(self, "priority_classes", tuple(self.priority_classes))
        if self.scheduling_policy != "fcfs" or self.priority_classes != ():   # fcfs, no classes: valid
            check_classes(self.scheduling_policy, self.priority_classes)
        if self.scheduling_policy == "priority" and self.scheduling == "static":
            raise ValueError("scheduling_policy='priority' needs scheduling='continuous' "
                             "(a static batch admits no one until it drains)")
        if self.speculative_method not in (None,) + SPEC_METHODS:
            raise ValueError(f"speculative_method must be None or one of {list(SPEC_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if isinstance(self.speculative_token_tree, list):   # one form: tuples (frozen dataclass)
            object.__setattr__(self, "speculative_token_tree", tree_paths(self.speculative_token_tree))
        if self.speculative_token_tree is not None and self.speculative_method not in TREE_METHODS:
            raise ValueError(f"speculative_token_tree needs speculative_method in "
                             f"{list(TREE_METHODS)}, got {self.speculative_method!r}")
        if self.speculative_disable_by_batch_size is not None:   # 1 would never speculate
            check_int("EngineConfig.speculative_disable_by_batch_size (None or)",
                      self.speculative_disable_by_batch_size, 2)
        if self.speculative_min_seq_len is not None:
            check_int("EngineConfig.speculative_min_seq_len (None or)", self.speculative_min_seq_len, 1)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        # otherwise decodes that miss the budget are skipped and newer requests starve
        if self.max_num_batched_tokens < max(self.max_num_seqs, 1 + self.num_speculative_tokens):
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} (every running sequence decodes "
                             f"each step) and >= 1 + num_speculative_tokens="
                             f"{1 + self.num_speculative_tokens} (one verify step)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of "
                             f"{list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        self._check_slo()
        if self.gpu_memory_utilization is not None:
            check_real("gpu_memory_utilization (None or)", self.gpu_memory_utilization, 0, 1, low_open=True)
        check_offload(self)
        if self.compilation_config is not None:       # a dict or CompilationConfig, checked
            object.__setattr__(self, "compilation_config", compilation_config(
                self.compilation_config, self.max_num_batched_tokens))
        if self.compilation_config is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"compilation_config needs tensor_parallel_size=1, got "
                             f"{self.tensor_parallel_size} (each rank would compile its own shard)")

    def _check_slo(self) -> None:
        for name in ("slo_ttft_p95_ms", "slo_tpot_p95_ms"):
            if getattr(self, name) is not None:
                check_real(f"EngineConfig.{name} (None or)", getattr(self, name), 0, low_open=True)
        check_real("EngineConfig.slo_interval_s", self.slo_interval_s, 0, low_open=True)
        if self.scheduling == "static" and (self.slo_ttft_p95_ms or self.slo_tpot_p95_ms):
            raise ValueError("slo_ttft_p95_ms / slo_tpot_p95_ms need scheduling='continuous': a "
                             "static batch admits no one until it drains, so no budget moves its latency")


def check_offload(cfg: EngineConfig) -> None:
    """The host KV tier's fields: `kv_offloading_size` None or a real number of GiB >= 0 (its
    bound by host memory is checked when the engine allocates it), `offload_idle_s` >= 0; a tier
    needs prefix caching (it keeps and finds prefix-cache blocks) and one process (TP = 1)."""
    if cfg.kv_offloading_size is not None:
        check_real("EngineConfig.kv_offloading_size (GiB; None or)", cfg.kv_offloading_size, 0)
    check_real("EngineConfig.offload_idle_s", cfg.offload_idle_s, 0)
    if cfg.kv_offloading_size and not cfg.enable_prefix_caching:
        raise ValueError("EngineConfig.kv_offloading_size > 0 needs enable_prefix_caching=True "
                         "(the host tier keeps and finds prefix-cache blocks)")
    if cfg.kv_offloading_size and cfg.tensor_parallel_size > 1:
        raise ValueError(f"EngineConfig.kv_offloading_size > 0 needs tensor_parallel_size=1, got "
                         f"{cfg.tensor_parallel_size} (each rank would need its own host tier)")


SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
             "speculative_token_tree", "disable_by_batch_size")
VLLM_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "medusa": "medusa",
                "eagle": "eagle", "lookahead": "lookahead"}   # vLLM's -> ours


def apply_speculative_config(config, spec: dict, draft_model=None):
    """(EngineConfig, vLLM speculative_config dict, draft_model) -> (EngineConfig, draft_model,
    drafter).

    The dict fills the flat fields (its "disable_by_batch_size" is
    `speculative_disable_by_batch_size`, as in vLLM); a flat field already set to something else
    raises ValueError.
    "model" is a Transformer for "draft_model" (`LLM` loads one given by name first), and the
    drafter for "medusa" / "eagle" / "lookahead" (a proposer, or None; spec/methods.py). The
    dict is only read, and everything is checked before anything is made.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; allowed: {list(SPEC_KEYS)}")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in VLLM_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(VLLM_METHODS)}, "
                         f"got {method!r}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs 'num_speculative_tokens'")
    k = spec["num_speculative_tokens"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int >= 1, "
                         f"got {k!r}")
    fields = {"speculative_method": VLLM_METHODS[method]}
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
    return replace(config, **fields), draft_model, drafter
