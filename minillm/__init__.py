"""minillm: how LLMs are served fast, in pure PyTorch, one chapter at a time."""
from .config import PRESETS, ModelConfig, get_config
from .generate import generate, generate_batch, generate_naive
from .kv_cache import KVCache
from .loading import default_device, load_model, tiny_model
from .model import Transformer
from .sampling import logits_to_probs, sample

__all__ = ["PRESETS", "ModelConfig", "get_config", "generate", "generate_batch", "generate_naive",
           "KVCache", "default_device", "load_model", "tiny_model", "Transformer",
           "logits_to_probs", "sample"]
