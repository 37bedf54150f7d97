"""Name and layout mapping between Hugging Face Llama checkpoints and minillm's `Transformer`.

HF keeps q/k/v and gate/up as separate matrices; minillm fuses each group into one matmul
(`qkv_proj`, `gate_up_proj`), so loading concatenates rows and exporting splits them again.
`to_hf_model` builds a transformers `LlamaForCausalLM` with minillm's weights: the tests use it
to check our forward pass against transformers' own on random models of any shape.
"""
import torch

from minillm.model.config import ModelConfig


def config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """A ModelConfig from a Llama-family config.json dict (transformers 4 or 5 style)."""
    if hf.get("model_type", "llama") not in ("llama", "mistral", "qwen2") or hf.get("attention_bias"):
        raise ValueError(f"only Llama-family checkpoints without attention bias are supported, "
                         f"got model_type={hf.get('model_type')!r}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported (default RoPE only)")
    n_head = hf["num_attention_heads"]
    return ModelConfig(
        n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        d_model=hf["hidden_size"], d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), name=name)


def load_hf_state_dict(hf: dict, cfg: ModelConfig) -> dict:
    """HF tensor names -> minillm names, fusing q/k/v and gate/up."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    out["lm_head.weight"] = hf["model.embed_tokens.weight"] if cfg.tie_embeddings else hf["lm_head.weight"]
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn.qkv_proj.weight"] = torch.cat(
            [hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
        out[f"layers.{i}.attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)
        out[f"layers.{i}.mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.input_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


def hf_config(cfg: ModelConfig):
    """The transformers LlamaConfig with the same shape."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@torch.no_grad()
def to_hf_model(model):
    """A transformers LlamaForCausalLM holding a copy of `model`'s weights (same dtype/device)."""
    from transformers import LlamaForCausalLM
    cfg = model.config
    hf = LlamaForCausalLM(hf_config(cfg)).to(dtype=model.dtype, device=model.device).eval()
    H, Hkv, D, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.qkv_proj.weight.split([H * D, Hkv * D, Hkv * D], dim=0)
        gate, up = layer.mlp.gate_up_proj.weight.split([F, F], dim=0)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attn.o_proj.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                   p + "input_layernorm.weight": layer.input_norm.weight,
                   p + "post_attention_layernorm.weight": layer.post_attn_norm.weight})
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf
