"""Shared fixtures."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and a busy CI box does not oversubscribe)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer alone (no weights); a test module may define its own `tok`."""
    from minillm.model.loading import load_tokenizer
    t = load_tokenizer()
    if t is None:
        pytest.skip("SmolLM2's tokenizer is not cached (minillm.load_model() writes it)")
    return t


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct as `minillm.load_model(device="cpu")` gives it
    (fp32, this machine's matmul routes), loaded once for the whole run instead of once per module
    (seconds each). Shared, so read-only: a test that changes the model (weights, dtype, a hook it
    might leave on, `unflatten`) loads its own copy."""
    import minillm
    return minillm.load_model(device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2():
    """Hugging Face transformers' own LlamaForCausalLM read from the same GGUF file (fp32, eval):
    the trusted reference the real-model tests compare against, loaded once. Read-only."""
    from transformers import AutoModelForCausalLM

    from minillm.model.loading import smollm2_gguf_path
    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()
