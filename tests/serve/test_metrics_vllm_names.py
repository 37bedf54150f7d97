"""The vLLM v1 series a dashboard charts, under `minillm:`, counted by hand: requests of known
sizes go to a server one at a time (token-id prompts, `ignore_eos`, so every length is known),
and `/metrics`, read by prometheus_client's parser, must hold what each request implies.

    iteration_tokens_total             histogram: per engine step, the prompt tokens of requests
                                       whose prefill ended in it plus the tokens it generated
    request_params_n / _max_tokens     histograms of the request parameters
    request_max_num_generation_tokens  histogram: the longest completion of each request
    request_prefill_kv_computed_tokens histogram: prompt tokens not found in the prefix cache
    prompt_tokens_by_source_total      counter by source (local_compute, local_cache_hit)
    prompt_tokens_cached_total         counter
    spec_decode_num_drafts_total       counter: one per sequence and step that verified drafts
    cache_config_info                  gauge: the KV cache's configuration in its labels
"""
import httpx
import pytest

from minillm.serve import running
from serve_tiny import MODEL, scrape, settled, settles, tiny_llm  # noqa: F401 (settles: autouse)


def complete(srv, prompt_ids, max_tokens, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def hist(m: dict, name: str) -> dict:
    """{"count", "sum", le bound (float): cumulative count} of histogram minillm:`name`."""
    out = {}
    for (sample, labels), value in m.items():
        if sample == f"minillm:{name}_count":
            out["count"] = value
        elif sample == f"minillm:{name}_sum":
            out["sum"] = value
        elif sample == f"minillm:{name}_bucket":
            out[float(dict(labels)["le"])] = value
    return out


def one(m: dict, name: str, **labels) -> float:
    return m[(f"minillm:{name}", frozenset(labels.items()))]


@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok), served_model_name=MODEL) as s:
        yield s


def test_step_and_request_histograms_hold_the_hand_counts(srv):
    before = settled(srv.url)
    assert hist(before, "iteration_tokens_total")["count"] == 0
    complete(srv, list(range(100, 105)), 4)                   # steps: 5 + 1, 1, 1, 1
    complete(srv, list(range(200, 203)), 3, n=2, temperature=1.0, seed=0)   # 3 + 2, 2, 2
    complete(srv, list(range(300, 304)), 2)                   # 4 + 1, 1
    m = settled(srv.url)
    steps = hist(m, "iteration_tokens_total")
    assert (steps["count"], steps["sum"]) == (9, 6 + 3 + 5 + 4 + 5 + 1)
    assert (steps[1.0], steps[8.0], steps[16384.0]) == (4, 9, 9)          # the 1-token decodes
    n = hist(m, "request_params_n")
    assert (n["count"], n["sum"], n[1.0], n[2.0], n[20.0]) == (3, 4, 2, 3, 3)
    mt = hist(m, "request_params_max_tokens")
    assert (mt["count"], mt["sum"], mt[1.0], mt[2.0], mt[5.0]) == (3, 4 + 3 + 2, 0, 1, 3)
    assert max(b for b in mt if isinstance(b, float) and b < float("inf")) == 500   # 1-2-5 to 512
    gen = hist(m, "request_max_num_generation_tokens")
    assert (gen["count"], gen["sum"]) == (3, 4 + 3 + 2)                     # n=2: 3, not 6
    kv = hist(m, "request_prefill_kv_computed_tokens")
    assert (kv["count"], kv["sum"]) == (3, 5 + 3 + 4)
    assert one(m, "prompt_tokens_by_source_total", source="local_compute") == 12
    assert one(m, "prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert one(m, "prompt_tokens_cached_total") == 0
    assert one(m, "cache_config_info", block_size="16", num_gpu_blocks="128",
               enable_prefix_caching="False") == 1


def test_prefix_cache_hits_are_counted_by_source(tok):
    """A 40-token prompt twice with 16-token blocks: the second finds 2 full blocks (32 tokens;
    the last token is always computed) and computes 8."""
    prompt = list(range(400, 440))
    with running(tiny_llm(tok, enable_prefix_caching=True), served_model_name=MODEL) as s:
        complete(s, prompt, 2)
        complete(s, prompt, 2)
        m = settled(s.url)
    kv = hist(m, "request_prefill_kv_computed_tokens")
    assert (kv["count"], kv["sum"], kv[10.0]) == (2, 40 + 8, 1)
    assert one(m, "prompt_tokens_by_source_total", source="local_compute") == 48
    assert one(m, "prompt_tokens_by_source_total", source="local_cache_hit") == 32
    assert one(m, "prompt_tokens_cached_total") == 32
    assert hist(m, "iteration_tokens_total")["sum"] == 2 * (40 + 2)       # the whole prompt: vLLM's
    assert one(m, "cache_config_info", block_size="16", num_gpu_blocks="128",
               enable_prefix_caching="True") == 1


def test_spec_decode_num_drafts_counts_verify_steps(tok):
    """n-gram drafting (up to 2 tokens: what followed the latest earlier match of the longest
    tail, of 3 tokens at most) on the prompt a b a b a b a b, with `a` forced by a logit bias.
    Prefill: a. Then the tail a b a last matched 3 back: draft b a, b rejected, +a. Tail b a a
    has no match, a a neither, a matched 1 back: draft a, kept, +a (2 tokens); the same twice
    more (the tail a a a matched 1 back). 8 tokens; 4 drafts, 5 draft tokens, 3 accepted;
    steps of 8 + 1, 1, 2, 2, 2 tokens."""
    a, b = tok.encode("7")[-1], tok.encode("x")[-1]
    with running(tiny_llm(tok, num_speculative_tokens=2), served_model_name=MODEL) as s:
        out = complete(s, [a, b] * 4, 8, logit_bias={str(a): 100})
        m = settled(s.url)
    assert out["usage"]["completion_tokens"] == 8
    assert one(m, "spec_decode_num_drafts_total") == 4
    assert one(m, "spec_decode_num_draft_tokens_total") == 5
    assert one(m, "spec_decode_num_accepted_tokens_total") == 3
    steps = hist(m, "iteration_tokens_total")
    assert (steps["count"], steps["sum"], steps[1.0], steps[8.0]) == (5, 8 + 8, 1, 4)
