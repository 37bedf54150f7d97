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
