"""minillm: how LLMs are served fast, in pure PyTorch, one chapter at a time.

The front door is `LLM` (llm.py: vLLM's offline API over `LLMEngine`). Chapter 0: model,
loading, generation. 1-2: `roofline`, `kv_math`. 3: `block_manager`, `paged_attention`. 4-5:
`engine` (scheduler, model_runner, sequence, workloads). 6: `speculative`, `proposers`,
`spec_decode`, `spec_theory`. Benchmarks: `python -m minillm.bench all`.
"""
from .block_manager import BlockManager, NoFreeBlocksError
from .chat import chat, encode_chat
from .config import PRESETS, ModelConfig, get_config
from .engine import EngineConfig, LLMEngine
from .generate import generate, generate_batch, generate_naive
from .kv_cache import KVCache
from .llm import LLM
from .loading import default_device, load_model, tiny_model
from .model import Transformer
from .paged_attention import PagedKVCache
from .sampling import logits_to_probs, sample
from .sequence import CompletionOutput, RequestOutput, SamplingParams
from .spec_decode import speculative_generate
from .proposers import DraftModelProposer, NgramProposer
from .speculative import greedy_verify, rejection_sample

__all__ = ["LLM", "CompletionOutput", "BlockManager", "NoFreeBlocksError", "chat", "encode_chat", "PRESETS", "ModelConfig",
           "get_config", "EngineConfig", "LLMEngine", "generate", "generate_batch",
           "generate_naive", "KVCache", "default_device", "load_model", "tiny_model",
           "Transformer", "PagedKVCache", "logits_to_probs", "sample", "RequestOutput",
           "SamplingParams", "rejection_sample", "greedy_verify", "speculative_generate",
           "DraftModelProposer", "NgramProposer"]
