"""The model a learner reads (chapter 0), the ground floor: `config` (ModelConfig and presets),
`llama` (RMSNorm, RoPE, grouped-query attention, SwiGLU, the Transformer), `loading` (GGUF / HF
weights into the reference `Transformer`, `tiny_model`, `random_model`), `kv_cache` (the
contiguous cache), `sampling`, `generate` (cached and naive) and `chat`. Plain PyTorch that
imports nothing above it: fast CPU matmul routes live in `minillm.kernels`, switched on by the
front door (`minillm.load_model`)."""
from minillm.model.llama import (Attention, Block, DenseCausalAttention, MLP, RMSNorm,  # noqa: F401
                                 Transformer, apply_rope, rope_cos_sin)
