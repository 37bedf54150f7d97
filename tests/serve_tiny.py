"""Helpers for the server tests that need HTTP but not SmolLM2's weights: a tiny random model of
the real class with SmolLM2's tokenizer, served by uvicorn in a thread, and `/metrics` read back
with prometheus_client's own parser."""
import time

import httpx
import pytest

MODEL = "tiny"


def tokenizer():
    from minillm.model.loading import load_tokenizer
    tok = load_tokenizer()
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not cached (load_model() once)")
    return tok


def tiny_llm(tok, max_seq_len: int = 512, **engine_options):
    from minillm import LLM
    from minillm.model.loading import tiny_model
    opts = dict(max_num_seqs=8, num_blocks=128, block_size=16, max_num_batched_tokens=256)
    return LLM(tiny_model(vocab_size=len(tok), max_seq_len=max_seq_len), tok,
               **{**opts, **engine_options})


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels other than model_name): value}, by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def gauge(values: dict, name: str) -> float:
    return values[(f"minillm:{name}", frozenset())]


def settled(url: str, timeout_s: float = 30.0) -> dict:
    """/metrics once it shows 0 running, 0 waiting and 0 KV blocks in use (or the last scrape)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        idle = all(gauge(m, g) == 0 for g in ("num_requests_running", "num_requests_waiting",
                                               "kv_cache_blocks_in_use"))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_settled(url: str) -> None:
    m = settled(url)
    assert [gauge(m, g) for g in ("num_requests_running", "num_requests_waiting",
                                  "kv_cache_blocks_in_use")] == [0, 0, 0]


def chat(content="Hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **extra}


def completion(prompt="The capital of France is", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines() if line]


@pytest.fixture(autouse=True)
def settles(request):
    """Imported by a test module: after each test that used the module's `srv`, /metrics must
    settle at 0 running, 0 waiting and 0 KV blocks in use."""
    yield
    if "srv" in request.fixturenames:
        assert_settled(request.getfixturevalue("srv").url)
