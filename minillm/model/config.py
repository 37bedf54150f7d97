"""Model shapes: one `ModelConfig` dataclass and named presets of the models the chapters discuss.

Nothing here touches tensors. The presets are the published shapes of each model (its
config.json); the chapters use them for FLOP, byte and KV-cache arithmetic, and `tiny_model`
builds small random models of the same class for tests.
"""
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    head_dim: int = 64
    d_model: int = 576
    d_ff: int = 1536
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    name: str = "custom"

    def __post_init__(self):
        for field in ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff",
                      "vocab_size", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"ModelConfig.n_head ({self.n_head}) must be a multiple of "
                             f"n_kv_head ({self.n_kv_head})")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and norm_eps must be > 0")

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (1 = multi-head attention, n_head = multi-query)."""
        return self.n_head // self.n_kv_head

    @property
    def num_params(self) -> int:
        """Parameter count (the tied embedding counted once)."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_head * hd + 2 * d * self.n_kv_head * hd + self.n_head * hd * d
        mlp = 3 * d * self.d_ff
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layer * per_layer + emb + d

    def with_(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, e.g. `cfg.with_(n_kv_head=cfg.n_head)` for MHA."""
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        n_layer=30, n_head=9, n_kv_head=3, head_dim=64, d_model=576, d_ff=1536,
        vocab_size=49152, rope_theta=100000.0, max_seq_len=8192, norm_eps=1e-5,
        tie_embeddings=True, name="SmolLM2-135M"),
    "llama-2-7b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=32, head_dim=128, d_model=4096, d_ff=11008,
        vocab_size=32000, rope_theta=10000.0, max_seq_len=4096, norm_eps=1e-5,
        tie_embeddings=False, name="Llama-2-7B"),
    "llama-2-70b": ModelConfig(
        n_layer=80, n_head=64, n_kv_head=8, head_dim=128, d_model=8192, d_ff=28672,
        vocab_size=32000, rope_theta=10000.0, max_seq_len=4096, norm_eps=1e-5,
        tie_embeddings=False, name="Llama-2-70B"),
    "llama-3-8b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, head_dim=128, d_model=4096, d_ff=14336,
        vocab_size=128256, rope_theta=500000.0, max_seq_len=8192, norm_eps=1e-5,
        tie_embeddings=False, name="Llama-3-8B"),
    "llama-3-70b": ModelConfig(
        n_layer=80, n_head=64, n_kv_head=8, head_dim=128, d_model=8192, d_ff=28672,
        vocab_size=128256, rope_theta=500000.0, max_seq_len=8192, norm_eps=1e-5,
        tie_embeddings=False, name="Llama-3-70B"),
    "mistral-7b": ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, head_dim=128, d_model=4096, d_ff=14336,
        vocab_size=32000, rope_theta=10000.0, max_seq_len=32768, norm_eps=1e-5,
        tie_embeddings=False, name="Mistral-7B"),
}


def get_config(name: str) -> ModelConfig:
    """Look up a preset by name (case-insensitive), e.g. `get_config("llama-2-70b")`."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[key]
