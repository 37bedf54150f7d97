"""The model a learner reads (chapter 0): `config` (ModelConfig and presets), `llama` (RMSNorm,
RoPE, grouped-query attention, SwiGLU, the Transformer), `loading` (GGUF / HF weights,
`tiny_model`), `kv_cache` (the contiguous cache), `sampling`, `generate` (cached and naive) and
`chat`. Plain PyTorch: fast CPU matmul routes live in `minillm.kernels`."""
from minillm.model.llama import (ROUTES, Attention, Block, DenseCausalAttention, Linear, MLP,  # noqa: F401
                                 RMSNorm, Transformer, apply_rope, linear_route, rope_cos_sin,
                                 skinny_route)
