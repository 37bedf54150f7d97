"""The front door: vLLM's offline `LLM` class over minillm's `LLMEngine`.

    from minillm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")                   # or an HF folder, a .gguf, a Transformer
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.8, top_p=0.95))
    llm.chat([{"role": "user", "content": "Hi!"}])    # the model's chat template, then generate

`LLM(model, tokenizer=None, **options)`: options are `EngineConfig` fields plus `dtype`, `device`,
`draft_model`, `speculative_config` (vLLM's dict) and `quantization` ("int8", "int4", "gguf").
Prompts are strings, token-id lists or vLLM's prompt dicts. `load_model(name, kernels="auto")`
switches speed on in one visible step: the reference model, then on a CPU `accelerate(model)`
(the tuned matmul routes and the flat forward); `LLM(name)` loads through it, `LLM(model)` runs
the model as given. `tensor_parallel_size=n` splits it over n processes; `shutdown()` or `with`.

Left out on purpose: `encode`, `embed`, `beam_search`, LoRA, multi-modal data, hub downloads,
pipeline parallelism. Unlike vLLM, `SamplingParams()` is greedy by default (temperature 0).
"""
import dataclasses
import os

import torch

from minillm.analysis.roofline import torch_dtype
from minillm.distributed.tp_runner import TensorParallelRunner
from minillm.drafting.train import train_eagle, train_medusa
from minillm.engine.config import apply_speculative_config
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.model_runner import ModelRunner
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import RequestOutput
from minillm.kernels.cpu_kernels import ROUTES
from minillm.kernels.background import start_background_tuning
from minillm.kernels.cpu_tuning import accelerate
from minillm.model import loading
from minillm.model.chat import encode_chat
from minillm.model.llama import Transformer
from minillm.model.loading import DEFAULT_MODEL

QUANTIZATIONS = (None, "int8", "int4", "gguf")


def load_model(name_or_path: str = DEFAULT_MODEL, device=None, dtype: torch.dtype = torch.float32,
               kernels: str = "auto"):
    """Return `(model, tokenizer)` for a preset name, a local HF folder or a .gguf file, ready
    to run fast: `minillm.model.loading.load_model` (the reference `Transformer`), then
    `accelerate(model, route=kernels)` (a no-op on GPUs and for dtypes other than fp32).

    kernels="auto": this machine's tuned matmul routes (`python -m minillm.kernels` tunes them;
    until then a quick probe of a few seconds, said in one line, and one background tuner that
    times every route at the first quiet moment for later runs: `minillm.kernels.background`,
    off with MINILLM_BACKGROUND_TUNING=0); "plain": the reference model as loaded, plain
    nn.Linear and llama.py's forward; a route name ("F.linear", "x@W", ...) pins that route.
    `routes_summary(model)` says in one line which routes the model runs and how to tune.

    >>> model, tok = load_model()                     # SmolLM2-135M-Instruct, cuda if present
    >>> model, tok = load_model("path/to/llama_folder", device="cpu", dtype=torch.bfloat16)
    """
    if kernels not in ("plain", *ROUTES):
        raise ValueError(f"kernels must be 'plain' or one of {ROUTES}, got {kernels!r}")
    model, tok = loading.load_model(name_or_path, device=device, dtype=dtype)
    if kernels != "plain":
        accelerate(model, route=kernels)
        if kernels == "auto" and model.__dict__.get("linear_plan_source", "").startswith("quick"):
            model.background_tuning = start_background_tuning(name_or_path)[1]
    return model, tok


def routes_summary(model) -> str:
    """One line: which CPU matmul routes `model` runs (a tuned table, the quick probe, an untimed
    guess, pinned or plain) and how to get the tuned table."""
    source = model.__dict__.get("linear_plan_source")
    if source is None:
        return "CPU matmul routes: none (plain nn.Linear, or not a CPU fp32 model)"
    if source == "tuned":
        return "CPU matmul routes: this machine's tuned table"
    if not source.startswith("quick"):
        return f"CPU matmul routes: {source}"
    later = model.__dict__.get("background_tuning") or "no background tuner"
    return (f"CPU matmul routes: {source.removeprefix('quick: ')}. {later}; or tune now (about a "
            f"minute): python -m minillm.kernels")


def resolve_dtype(dtype) -> torch.dtype | None:
    """vLLM's dtype argument as a torch dtype: None stays None (the loader's default), "auto"
    is float32 here (every chapter's reference), a name ("bfloat16", "float16", "bf16", ...) or
    a torch dtype. Anything else raises ValueError naming the choices."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    try:
        chosen = torch_dtype(dtype)
    except (TypeError, ValueError):
        chosen = None
    if chosen is None or not chosen.is_floating_point:
        raise ValueError(f"dtype must be a torch.dtype, 'auto', or one of float32, bfloat16, float16 "
                         f"(fp32, bf16, fp16), got {dtype!r}")
    return chosen


class LLM:
    """An engine with a model and its tokenizer; `generate` and `chat` run prompts to completion."""

    def __init__(self, model=DEFAULT_MODEL, tokenizer=None, *, dtype=None, device=None,
                 draft_model=None, speculative_config: dict | None = None,
                 quantization: str | None = None, **engine_options):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - fields)
        if unknown:
            raise TypeError(f"LLM got unknown options {unknown}; engine options are the EngineConfig "
                            f"fields {sorted(fields)} and dtype, device, draft_model, "
                            f"speculative_config, quantization")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r} "
                             f"(gptq / awq: minillm.quantize(model, ..., calibration=...) first)")
        dtype = resolve_dtype(dtype)
        config = EngineConfig(**engine_options)          # validates before any weights load
        # the name a server announces (vLLM: the --model string); a Transformer: its config's name
        self.model_name = str(model) if isinstance(model, (str, os.PathLike)) else \
            getattr(getattr(model, "config", None), "name", None)
        if isinstance(model, Transformer):
            if dtype is not None or device is not None:
                raise ValueError("dtype and device apply to a model given by name; move a "
                                 "Transformer yourself (model.to(device, dtype))")
        elif isinstance(model, (str, os.PathLike)):
            model, own_tok = load_model(model, device=device, dtype=dtype or torch.float32)
            tokenizer = own_tok if tokenizer is None else tokenizer
        else:
            raise TypeError(f"model must be a model name, a path or a Transformer, "
                            f"got {type(model).__name__}")
        if quantization is not None:
            from minillm.quant.api import quantize
            quantize(model, quantization)
        if isinstance(tokenizer, (str, os.PathLike)):                 # a local folder, never the hub
            if not os.path.isdir(tokenizer):
                raise ValueError(f"tokenizer must be a tokenizer object or a local folder, "
                                 f"got {tokenizer!r}")
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        if isinstance(draft_model, (str, os.PathLike)):
            draft_model = self._load_draft(draft_model, model)
        if isinstance(speculative_config, dict):
            speculative_config = self._resolve_drafter(speculative_config, config, model, tokenizer)
        # tensor parallelism: a runner with worker processes in place of the one-process runner
        runner = TensorParallelRunner if config.tensor_parallel_size > 1 else ModelRunner
        self.llm_engine = LLMEngine(model, config, draft_model, tokenizer, speculative_config,
                                    runner=runner)

    def _resolve_drafter(self, spec: dict, config: EngineConfig, model, tokenizer) -> dict:
        """A copy of `spec` whose "model" the engine can take: a draft model given by name is
        loaded; "medusa" / "eagle" heads given as None are the cached trained ones, trained on
        first use (`train_medusa` / `train_eagle`); the rest goes on as it is (a path to heads
        is loaded and checked by the engine). The dict is checked first, so a bad one trains
        nothing."""
        apply_speculative_config(config, {**spec, "model": None} if "model" in spec else spec)
        method, drafter = spec.get("method", "draft_model"), spec.get("model")
        if method in ("draft_model", "draft") and isinstance(drafter, str):
            return {**spec, "model": self._load_draft(drafter, model)}
        if method in ("medusa", "eagle") and drafter is None:
            if tokenizer is None:
                raise ValueError(f"speculative_config['model']=None trains {method} heads on the "
                                 f"model's own answers, which needs a tokenizer; pass heads")
            k = spec["num_speculative_tokens"]
            heads = (train_medusa(model, tokenizer, num_heads=max(4, k)) if method == "medusa"
                     else train_eagle(model, tokenizer))
            return {**spec, "model": heads}
        return dict(spec)

    @staticmethod
    def _load_draft(name, target: Transformer) -> Transformer:
        """A draft model given by name, on the target's device and in its dtype."""
        param = next(target.parameters())
        return load_model(name, device=param.device, dtype=param.dtype)[0]

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1). Idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def model(self) -> Transformer:
        return self.llm_engine.model

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in prompt order.

        prompts: a str, a list of str, a token-id list, a list of token-id lists, or vLLM's
        {"prompt": str} / {"prompt_token_ids": list[int]} dicts. sampling_params: one
        SamplingParams for all, or a list with one per prompt; None = SamplingParams().
        priority: None, an int or one per prompt (lower first; needs scheduling_policy="priority").
        """
        prompts = self._prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        return self.llm_engine.generate(prompts, sampling_params=sampling_params, use_tqdm=use_tqdm,
                                        priority=priority)

    def chat(self, messages, sampling_params: SamplingParams | list | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them: apply the
        model's chat template (`encode_chat`), generate the assistant's turn. `prompt` of each
        output is the templated text."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (its chat template); pass LLM(..., tokenizer=...)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(one conversation) or a list of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in convs:
            _check_conversation(conv)
        ids = [encode_chat(tok, list(conv)) for conv in convs]
        outs = self.generate(ids, sampling_params, use_tqdm)
        for o in outs:
            o.prompt = tok.decode(o.prompt_token_ids)
        return outs

    def _prompts(self, prompts) -> list:
        """Normalize to a list of str / token-id lists; str needs a tokenizer."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a str, a token-id list or a non-empty list of them, "
                             f"got {prompts!r}")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            prompts = [list(prompts)]                          # one token-id prompt
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if set(p) not in ({"prompt"}, {"prompt_token_ids"}):
                    raise ValueError(f"prompts[{i}]: a dict prompt needs exactly one key, 'prompt' "
                                     f"or 'prompt_token_ids', got {sorted(p)}")
                p = next(iter(p.values()))
            if isinstance(p, str) and self.get_tokenizer() is None:
                raise ValueError(f"prompts[{i}] is a str, but this model has no tokenizer; pass "
                                 f"token ids, or LLM(..., tokenizer=...)")
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"prompts[{i}] must be a str or a list of token ids, "
                                f"got {type(p).__name__}")
            out.append(p if isinstance(p, str) else list(p))
        return out


def _check_conversation(conv) -> None:
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
    for m in conv:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"each message must be a dict with str 'role' and 'content', got {m!r}")
