"""`GET /dashboard` over plain HTTP (no browser: tests/serve/test_dashboard_browser.py opens it), and the
metrics it draws: the page and its files, their types and Content-Security-Policy, nothing from
another origin, its query parameters (a bad or unknown one is a 400 naming `param`), the same
key rule as /metrics, and the metric contract (the SLO controller, the speculation
switch and the host KV tier export the same names with 0 when off, and what the engine keeps
when on; per-priority gauges; queue timeouts in their own counter)."""
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from minillm import SamplingParams
from minillm.engine.policies.priority import SEED_CLASSES, PriorityClass
from minillm.serve import running
from minillm.serve.dashboard import CSP, PARAMS, asset
from minillm.serve.metrics import ServerMetrics
from serve_tiny import MODEL, completion, scrape, settles, tiny_llm  # noqa: F401 (autouse)

CONTRACT = ("slo_max_num_batched_tokens", "slo_adjustments_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_enabled", "spec_decode_steps_skipped_total",
            "kv_cache_blocks_cached", "kv_offload_blocks_in_use", "kv_offload_blocks_total",
            "kv_offload_stored_blocks_total", "kv_offload_restored_blocks_total",
            "request_queue_timeouts_total")
FAMILIES = CONTRACT + ("slo_queue_timeout_seconds", "slo_ttft_p95_seconds", "slo_tpot_p95_seconds")


@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok), served_model_name=MODEL, api_key="secret") as s:
        yield s


def values(metrics: ServerMetrics) -> dict:
    """{(name, labels without model_name): value} of one render, by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families
    text = metrics.render()[0].decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def one(vals: dict, name: str, **labels) -> float:
    return vals[(f"minillm:{name}", frozenset(labels.items()))]


def test_the_page_its_files_and_their_headers(srv):
    r = httpx.get(srv.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["content-security-policy"] == CSP and "default-src 'none'" in CSP
    assert r.headers["x-content-type-options"] == "nosniff"
    assert 'data-window-s="300" data-poll-ms="1000" data-rate-s="10"' in r.text
    for name, ctype in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        f = httpx.get(f"{srv.url}/dashboard/{name}")
        assert f.status_code == 200 and f.headers["content-type"].startswith(ctype)
        assert f.headers["content-security-policy"] == CSP and f.text == asset(name)
    assert httpx.post(srv.url + "/dashboard").status_code == 405


def test_nothing_comes_from_another_origin():
    """No URL with a scheme or a protocol-relative one in the page, its script or style, and a
    policy that allows this origin only (and data: for the empty favicon)."""
    for name in ("dashboard.html", "dashboard.js", "dashboard.css"):
        text = asset(name)
        for pattern in (r"https?:", r"(src|href)=\"//", r"url\(", r"@import", r"\bimport\("):
            assert not re.search(pattern, text), (name, pattern)
    assert re.findall(r"fetch\(([^,)]*)", asset("dashboard.js")) == ['"/metrics"']
    assert re.findall(r'(?:src|href)="([^"]*)"', asset("dashboard.html")) == [
        "data:,", "/dashboard/dashboard.css", "/dashboard/dashboard.js", "/metrics"]
    sources = re.findall(r"(\S+-src) ([^;]+)", CSP)
    assert {k for k, _ in sources} >= {"default-src", "script-src", "connect-src", "style-src"}
    assert all(set(v.split()) <= {"'self'", "'none'", "data:"} for _, v in sources)
    assert "unsafe" not in CSP and "frame-ancestors 'none'" in CSP


def test_query_parameters_are_checked_naming_param(srv):
    ok = httpx.get(srv.url + "/dashboard", params={"window_s": 60, "poll_ms": 250, "rate_s": "2.5"})
    assert ok.status_code == 200 and 'data-window-s="60" data-poll-ms="250" data-rate-s="2.5"' in ok.text
    bad = [("window_s=5", "window_s"), ("window_s=3601", "window_s"), ("poll_ms=abc", "poll_ms"),
           ("poll_ms=nan", "poll_ms"), ("rate_s=inf", "rate_s"), ("rate_s=", "rate_s"),
           ("refresh=1", "refresh"), ("window_s=60&window_s=70", "window_s")]
    for query, param in bad:
        r = httpx.get(f"{srv.url}/dashboard?{query}")
        assert r.status_code == 400, query
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", query
        if param in PARAMS:
            lo, hi, _ = PARAMS[param]
            assert f"from {lo} to {hi}" in err["message"] or "more than once" in err["message"]


def test_the_page_follows_the_metrics_rule_no_key(srv):
    """/metrics takes no API key, so the page that reads it takes none either; the API does."""
    assert httpx.get(srv.base_url + "/models").status_code == 401
    for path in ("/metrics", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert httpx.get(srv.url + path).status_code == 200, path


def test_the_contract_exports_zeros_when_every_feature_is_off(tok):
    llm = tiny_llm(tok)
    vals = values(ServerMetrics(MODEL, llm.llm_engine))
    for name in CONTRACT:
        want = 256 if name == "slo_max_num_batched_tokens" else 0  # the fixed budget without a controller
        got = [v for (n, _), v in vals.items() if n == f"minillm:{name}"]
        assert got and all(v == want for v in got), name
    text = ServerMetrics(MODEL, llm.llm_engine).render()[0].decode()
    for name in FAMILIES:                                 # the names are there either way
        assert f"# TYPE minillm:{name} " in text, name
    assert "minillm:slo_ttft_p95_seconds{" not in text    # unknown: no sample, not a fake 0
    assert "by_priority" not in text                       # fcfs: no per-priority gauges


def test_the_contract_reads_what_the_features_keep(tok):
    """Stand-ins with the contract's attributes (common37.md) for the controller and the host
    tier; the speculation counts from a real ngram-speculating engine."""
    llm = tiny_llm(tok, num_speculative_tokens=2, enable_prefix_caching=True)
    engine = llm.llm_engine
    token = tok.encode(" 7")[-1]                      # a bias makes the random model repeat it: drafts hit
    llm.generate(["7 7 7 7"], SamplingParams(max_tokens=12, temperature=0, logit_bias={token: 100.0}))
    engine.controller = SimpleNamespace(budget=96, min_budget=16, max_budget=256, queue_timeouts={0: 0.05, 2: 0.5},
                                        num_adjustments={"down": 3, "up": 1}, p95={"ttft": 0.25, "tpot": None},
                                        targets={"ttft": 0.2, "tpot": 0.05})
    engine.block_manager.host_tier = SimpleNamespace(num_blocks=64, num_used=5, stats={
        "stored_blocks": 7, "restored_blocks": 2, "evicted_blocks": 1, "idle_offloaded_blocks": 4})
    vals = values(ServerMetrics(MODEL, engine))
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert one(vals, "spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert one(vals, "spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    assert one(vals, "spec_decode_enabled") == 1
    assert one(vals, "slo_max_num_batched_tokens") == 96
    assert one(vals, "slo_queue_timeout_seconds", priority="2") == 0.5
    assert [one(vals, "slo_adjustments_total", direction=d) for d in ("down", "up")] == [3, 1]
    assert one(vals, "slo_ttft_p95_seconds") == 0.25 and one(vals, "slo_tpot_p95_target_seconds") == 0.05
    assert ("minillm:slo_tpot_p95_seconds", frozenset()) not in vals
    assert [one(vals, f"kv_offload_{k}") for k in ("blocks_in_use", "blocks_total", "stored_blocks_total",
            "restored_blocks_total", "evicted_blocks_total", "idle_offloaded_blocks_total")] == [5, 64, 7, 2, 1, 4]
    bm = engine.block_manager
    assert one(vals, "kv_cache_blocks_cached") == bm.num_evictable_blocks > 0     # the prompt's blocks
    assert one(vals, "kv_cache_blocks_free") + bm.num_evictable_blocks + bm.num_used_blocks == bm.num_blocks


def test_per_priority_gauges_count_the_queues(tok):
    llm = tiny_llm(tok, scheduling_policy="priority", priority_classes=SEED_CLASSES, max_num_seqs=1)
    engine, metrics = llm.llm_engine, None
    metrics = ServerMetrics(MODEL, engine)
    vals = values(metrics)
    for kind in ("running", "waiting"):
        assert [one(vals, f"num_requests_{kind}_by_priority", priority=str(p)) for p in (0, 1, 2)] == [0, 0, 0]
    for p in (2, 2, 1):
        engine.add_request("Hello there", SamplingParams(max_tokens=2), priority=p)
    engine.step()                                        # one seat: the priority-1 request runs
    vals = values(metrics)
    assert [one(vals, "num_requests_running_by_priority", priority=str(p)) for p in (0, 1, 2)] == [0, 1, 0]
    assert [one(vals, "num_requests_waiting_by_priority", priority=str(p)) for p in (0, 1, 2)] == [0, 0, 2]
    while engine.has_unfinished_requests():
        engine.step()


def test_a_queue_timeout_is_counted_in_its_own_counter(tok):
    """One seat, held by an unbounded class; a second request of a class that gives up after 1 ms
    is refused with 503 queue_timeout, counted once in request_queue_timeouts_total (and in
    request_aborted_total). The first holds its seat before the second is sent, so a slow machine
    cannot time out the first."""
    classes = (PriorityClass("interactive", 0), PriorityClass("batch", 1, 0.001, on_timeout="reject"))
    llm = tiny_llm(tok, scheduling_policy="priority", priority_classes=classes, max_num_seqs=1)
    with running(llm, served_model_name=MODEL) as s:
        codes = []

        def send(priority, max_tokens):
            codes.append(httpx.post(s.base_url + "/completions", timeout=60,
                                    json=completion(max_tokens=max_tokens, ignore_eos=True,
                                                    priority=priority)).status_code)
        first = threading.Thread(target=send, args=(0, 400))    # long: holds the seat
        first.start()
        deadline = time.monotonic() + 30
        while not scrape(s.url).get(("minillm:num_requests_running", frozenset())) and \
                time.monotonic() < deadline and first.is_alive():
            time.sleep(0.01)
        send(1, 4)
        first.join()
        m = scrape(s.url)
    assert sorted(codes) == [200, 503]
    assert m[("minillm:request_queue_timeouts_total", frozenset())] == 1
    assert m[("minillm:request_aborted_total", frozenset())] == 1


def test_no_browser_is_a_clear_error(monkeypatch, tmp_path):
    from minillm.lab import dashboard as page
    monkeypatch.setattr(page, "CHROMIUM", str(tmp_path / "chromium"))
    assert "chromium" in page.missing() and "apt-get install" in page.missing()
    with pytest.raises(page.BrowserMissing, match="chromium-driver"):
        page.read_page("http://127.0.0.1:9/dashboard")
