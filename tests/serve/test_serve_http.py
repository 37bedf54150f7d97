"""The black-box review's cases against a real uvicorn in a thread, over a tiny random model with
SmolLM2's tokenizer (the answers are noise; the protocol is what is checked): crafted bodies get
OpenAI error objects and the keep-alive connection survives, only JSON bodies run, 405 says what
is allowed, CORS is opt-in, tiny temperatures are clamped, a sampling failure is its own 500,
the waiting gauge counts waiting requests only, a client that leaves mid-body logs nothing, and
`/metrics` settles at 0 running, 0 waiting, 0 blocks after every test."""
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import torch

from minillm.serve import responses, running
from serve_tiny import (MODEL, assert_settled, settles, chat, completion, gauge, scrape, sse_lines,
                        tiny_llm)  # noqa: F401 (settles: an autouse fixture)



@pytest.fixture(scope="module")
def llm(tok):
    return tiny_llm(tok)


@pytest.fixture(scope="module")
def srv(llm):
    with running(llm, served_model_name=MODEL) as s:
        yield s



def post(srv, path, body=None, **kw):
    return httpx.post(srv.base_url + path, json=body, timeout=60, **kw) if body is not None \
        else httpx.post(srv.base_url + path, timeout=60, **kw)


def error_of(r, status, param=None):
    assert r.status_code == status, r.text
    r.content.decode("ascii")                         # ASCII-safe error bodies
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    return err


def test_lone_surrogates_get_error_objects_never_a_500(srv):
    raw = json.dumps(chat(), ensure_ascii=True)
    r = post(srv, "/chat/completions", content=raw.replace('"tiny"', '"\\ud800"'))
    assert error_of(r, 404, "model")["code"] == "model_not_found"
    r = post(srv, "/completions", content=json.dumps(completion("a\ud800b")))
    error_of(r, 400, "prompt")
    r = post(srv, "/chat/completions", content=json.dumps(chat("x\udc00")))
    error_of(r, 400, "messages[0].content")
    r = post(srv, "/completions", content=json.dumps(completion(stop=["\ud800"])))
    assert r.status_code == 200                       # a stop string never matched: fine


def test_deep_nesting_is_a_400_and_the_keep_alive_connection_survives(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        r = http.post("/completions", content=b"[" * 100_000)
        assert "nested" in error_of(r, 400)["message"]
        r = http.post("/completions", content=b'{"model": "tiny", "prompt": "x", "n": 1' + b"0" * 5000 + b"}")
        error_of(r, 400)                                  # a 5000-digit integer
        ok = http.post("/completions", json=completion())
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_a_server_bug_is_an_openai_500_with_connection_close(srv, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(responses, "response", broken)
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        r = http.post("/completions", json=completion())
        assert error_of(r, 500)["type"] == "server_error"
        assert r.headers["connection"] == "close"
        monkeypatch.undo()
        assert http.post("/completions", json=completion()).status_code == 200   # a new connection


@pytest.mark.parametrize("ctype,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
    ("text/plain;charset=UTF-8", 415), ("application/json", 200),
    ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/vnd.api+json", 200), (None, 200)])
def test_only_json_bodies_run(srv, ctype, status):
    before = scrape(srv.url)[("minillm:prompt_tokens_total", frozenset())]
    headers = {"Origin": "http://evil.example"} | ({"Content-Type": ctype} if ctype else {})
    r = post(srv, "/completions", content=json.dumps(completion()).encode(), headers=headers)
    assert r.status_code == status, r.text
    after = scrape(srv.url)[("minillm:prompt_tokens_total", frozenset())]
    if status == 415:
        assert error_of(r, 415)["code"] == "unsupported_media_type" and after == before
        assert "access-control-allow-origin" not in r.headers
    else:
        assert after > before


def test_405_says_what_is_allowed(srv):
    r = httpx.get(srv.base_url + "/completions")
    error_of(r, 405)
    assert r.headers["allow"] == "POST"
    r = httpx.post(srv.base_url + "/models")
    error_of(r, 405)
    assert "GET" in r.headers["allow"]


def test_cors_is_off_unless_origins_are_allowed(srv, llm):
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(srv.base_url + "/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    with running(llm, served_model_name=MODEL, allowed_origins=["http://good.example"]) as s:
        r = httpx.options(s.base_url + "/chat/completions", headers={**pre, "Origin": "http://good.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
        r = httpx.options(s.base_url + "/chat/completions", headers=pre)
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
        r = httpx.post(s.base_url + "/chat/completions", json=chat(), headers={"Origin": "http://good.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://good.example"
        assert_settled(s.url)


@pytest.mark.parametrize("t", [1e-40, 5e-324, 0.001])
def test_tiny_temperatures_are_clamped_to_001_as_vllm(srv, t):
    body = completion(max_tokens=6, seed=3)
    r = post(srv, "/completions", {**body, "temperature": t})
    ref = post(srv, "/completions", {**body, "temperature": 0.01})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_a_sampling_failure_is_a_500_sampling_error_not_a_queue_timeout(srv, llm):
    w = llm.llm_engine.model.lm_head.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.fill_(float("nan"))                     # every logit NaN: nothing can be drawn
        r = post(srv, "/completions", completion(temperature=1.0))
        err = error_of(r, 500)
        assert err["code"] == "sampling_error" and err["type"] == "server_error"
        with httpx.stream("POST", srv.base_url + "/chat/completions", timeout=60,
                          json=chat(temperature=1.0, stream=True)) as r:
            lines = sse_lines(r)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "sampling_error"
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert post(srv, "/completions", completion(temperature=1.0)).status_code == 200


def test_the_waiting_gauge_counts_waiting_requests_only(tok):
    llm = tiny_llm(tok, max_num_seqs=2)
    with running(llm, served_model_name=MODEL) as s:
        body = completion(max_tokens=300, ignore_eos=True, stream=True)
        stop = threading.Event()

        def one():
            with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            seen = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(seen) < 5 and any(t.is_alive() for t in threads):
                m = scrape(s.url)
                running_, waiting = gauge(m, "num_requests_running"), gauge(m, "num_requests_waiting")
                assert running_ <= 2 and running_ + waiting <= 6
                # every request admitted (the loop's pending count and the engine's queue are
                # read apart, so a request the loop holds may not be in the engine yet)
                if running_ == 2 and running_ + waiting == 6 and s.server.loop.num_pending == 6:
                    seen.append(waiting)
            assert seen and set(seen) == {4.0}        # 6 in flight, 2 running: 4 waiting
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert_settled(s.url)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_that_leaves_mid_body_logs_nothing(srv):
    rec = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "minillm")]
    for lg in loggers:
        lg.addHandler(rec)
    try:
        for _ in range(5):
            with socket.create_connection((srv.host, srv.port)) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                             b'{"model": "tiny", "messages": [')
                time.sleep(0.05)
        time.sleep(0.5)
        assert post(srv, "/chat/completions", chat()).status_code == 200
    finally:
        for lg in loggers:
            lg.removeHandler(rec)
    bad = [r for r in rec.records if r.levelno >= logging.WARNING or r.exc_info]
    assert bad == [], [r.getMessage() for r in bad]


def test_metrics_are_prometheus_with_vllm_names_and_a_registry_per_server(srv, llm):
    assert post(srv, "/completions", completion()).status_code == 200
    m = scrape(srv.url)
    names = {name for name, _ in m}
    for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prompt_tokens_total", "generation_tokens_total", "request_success_total",
              "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
              "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
              "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
              "request_decode_time_seconds_bucket", "num_preemptions_total"):
        assert f"minillm:{n}" in names, n
    assert m[("minillm:request_success_total", frozenset({("finished_reason", "length")}))] >= 1
    bounds = sorted(float(dict(lab)["le"]) for name, lab in m
                    if name == "minillm:e2e_request_latency_seconds_bucket")
    assert bounds[0] <= 0.001 and bounds[-2] >= 600 and bounds[-1] == float("inf")
    with running(llm, served_model_name=MODEL) as other:      # its own counts
        assert scrape(other.url)[("minillm:prompt_tokens_total", frozenset())] == 0


def test_message_count_and_character_bounds(srv, llm):
    context = llm.llm_engine.model.config.max_seq_len
    many = {**chat(), "messages": [{"role": "user", "content": "a"}] * (context + 1)}
    assert error_of(post(srv, "/chat/completions", many), 400, "messages")["code"] == "context_length_exceeded"
    r = post(srv, "/completions", completion("x" * (context * 81 + 1)))
    assert "characters" in error_of(r, 400, "prompt")["message"]


def test_fields_refused_and_echo_over_http(srv, tok):
    tool = {"type": "function", "function": {"name": "get_weather"}}
    for body, path, param in [(completion(suffix="!"), "/completions", "suffix"),
                              (chat(tools=[tool], tool_choice="auto"), "/chat/completions", "tools"),
                              (completion(logit_bias={"x": 1}), "/completions", "logit_bias"),
                              (completion(best_of=2, stream=True), "/completions", "best_of"),
                              (chat(response_format={"type": "yaml"}), "/chat/completions", "response_format")]:
        error_of(post(srv, path, body), 400, param)
    r = post(srv, "/chat/completions", chat(tools=[tool], tool_choice="none", user="alice"))
    assert r.status_code == 200
    plain = post(srv, "/completions", completion()).json()["choices"][0]["text"]
    echoed = post(srv, "/completions", completion(echo=True)).json()["choices"][0]["text"]
    assert echoed == "The capital of France is" + plain
    with httpx.stream("POST", srv.base_url + "/completions", timeout=60,
                      json=completion(echo=True, stream=True)) as r:
        events = [json.loads(l[6:]) for l in sse_lines(r) if l != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == echoed


def test_a_4_mib_prompt_does_not_stall_a_running_stream(tok):
    """Tokenizing 4 MiB takes seconds; it runs in the parser thread, so a stream keeps flowing.
    A 64K-token context lets the prompt past the character bound, to be tokenized for real."""
    llm = tiny_llm(tok, max_seq_len=65536, num_blocks=2048)         # room for the stream
    with running(llm, served_model_name=MODEL) as s:
        times, answer, stop = [], {}, threading.Event()

        def streamer():
            body = completion(max_tokens=30000, ignore_eos=True, stream=True)
            with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    times.append(time.perf_counter())
                    if stop.is_set():
                        return
        t = threading.Thread(target=streamer)
        t.start()
        while len(times) < 20:
            time.sleep(0.01)
        start = time.perf_counter()
        big = completion("hello world " * 340_000)
        r = httpx.post(s.base_url + "/completions", json=big, timeout=300)
        end = time.perf_counter()
        time.sleep(0.5)                               # the chunks a stalled loop would send late
        stop.set()
        t.join(60)
        answer = error_of(r, 400, "prompt")
        assert answer["code"] == "context_length_exceeded" and "680001 tokens" in answer["message"]
        during = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
        assert len(during) > 10 and max(during) < 1.0, (max(during), end - start)
        assert_settled(s.url)
