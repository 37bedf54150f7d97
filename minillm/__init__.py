"""minillm: how LLMs are served fast, in pure PyTorch, one chapter at a time.

The folders are the architecture (each folder imports only lower floors; docs/layout.md):
- `model/`     chapter 0: config, the Llama layers, loading, the contiguous cache, sampling, generate
- `paging/`    chapter 3: block manager (no tensors), the paged KV cache and its int8 / fp8 storage
- `engine/`    chapters 4-5, 11: sequence, scheduler, model runner, sampler, LLMEngine, draft
               proposals, the tensor-parallel runner, moving a prefilled request's KV
- `attention/` chapters 3, 9: dense reference, FlashAttention tiles, paged attention, flash-decoding
- `spec/`      chapters 6, 10: rejection sampling, proposers, the batch-1 loop, token trees,
               Medusa / EAGLE drafters (`drafting/` trains them on this CPU by self-distillation)
- `distributed/` chapter 11: worker processes and their collectives, tensor and pipeline parallelism
- `llm.py`     vLLM's offline front door, `LLM(model=...).generate(...)` / `.chat(...)`
- `quant/`     chapter 7: weight formats and kernels, GGUF blocks, `quantize`, GPTQ, AWQ, KV int8 / fp8
- `analysis/`  chapters 1, 2, 6, 7, 11: roofline, KV-cache math, speculation theory, weight bytes,
               parallel formulas, the serving simulator and SLOs (pure functions)
- `kernels/`   CPU matmul routes tuned on this machine, the flat forward (chapter 1)
- `viz/`       figures and widgets (extra `viz`); `serve/` the HTTP server (extra `serve`; chapter
               11's disaggregated router and its prefill / decode workers too)
- `lab/`       the instruments the chapters measure with (timing, workloads, load generator, demo)
- `exercises/` every chapter's checks: `exercises.check("07.1", answer)`
"""
from minillm.paging.block_manager import BlockManager, NoFreeBlocksError
from minillm.attention.tiled import flash_attention
from minillm.model.chat import chat, encode_chat
from minillm.model.config import PRESETS, ModelConfig, get_config
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.kernels.compilation_config import CompilationConfig
from minillm.model.generate import generate, generate_batch, generate_naive
from minillm.model.kv_cache import KVCache
from .llm import LLM
from minillm.llm import load_model   # the front door: the reference model, then `accelerate`
from minillm.model.loading import default_device, tiny_model
from minillm.model.llama import Transformer
from minillm.paging.paged_cache import PagedKVCache
from minillm.model.sampling import logits_to_probs, sample
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import CompletionOutput, Logprob, RequestOutput
from minillm.engine.structured import StructuredOutputsParams
from minillm.spec.lookahead import LookaheadProposer
from minillm.spec.loop import speculative_generate
from minillm.spec.proposers import DraftModelProposer, NgramProposer
from minillm.spec.rejection import greedy_verify, rejection_sample
from minillm.spec.tree import TokenTree, TreeDraft
from minillm.spec.tree_rejection import tree_accept
from minillm.spec.tree_sizing import expected_tau, predicted_speedup, size_tree
from minillm.spec.heads import EagleDrafter, MedusaHeads
from minillm.spec.trained_proposers import EagleProposer, MedusaProposer
from minillm.drafting.train import train_eagle, train_medusa
from minillm.distributed.group import WorkerDied, WorkerGroup
from minillm.distributed.pipeline import PipelineParallel


def quantize(model, method: str = "int4", group_size: int | None = None, calibration=None,
             path: str = "auto", lm_head: str | None = None, allow_w8a8: bool = False):
    """Quantize a model's projections in place (chapter 7): method "int8" | "int4" | "gguf" |
    "gptq" | "awq"; lm_head None | "int8" | "int4"; allow_w8a8 lets int8 race its W8A8 route.
    See `minillm.quant.api.quantize`; imported on first use."""
    from minillm.quant.api import quantize as _quantize
    return _quantize(model, method, group_size, calibration, path, lm_head=lm_head,
                     allow_w8a8=allow_w8a8)


__all__ = ["LLM", "CompletionOutput", "BlockManager", "NoFreeBlocksError", "chat", "encode_chat", "PRESETS", "ModelConfig",
           "get_config", "EngineConfig", "LLMEngine", "generate", "generate_batch",
           "generate_naive", "KVCache", "default_device", "load_model", "tiny_model",
           "Transformer", "PagedKVCache", "logits_to_probs", "sample", "RequestOutput",
           "SamplingParams", "Logprob", "StructuredOutputsParams", "rejection_sample", "greedy_verify", "speculative_generate",
           "DraftModelProposer", "NgramProposer", "quantize", "flash_attention",
           "TokenTree", "TreeDraft", "tree_accept", "expected_tau", "predicted_speedup", "size_tree",
           "MedusaHeads", "EagleDrafter", "MedusaProposer", "EagleProposer", "train_medusa",
           "train_eagle", "LookaheadProposer", "WorkerGroup", "WorkerDied", "PipelineParallel"]
