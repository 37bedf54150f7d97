"""The black-box review's request-level cases that passed then, kept as tests so they keep passing:
types and ranges, messages and prompts, bodies and transports, seeded determinism, auth and
priorities. A tiny random model with SmolLM2's tokenizer (context 512); the review's own numbers
(context 8192, n <= 32) become this model's. Fields, crafted bodies, 415/405/CORS, metrics,
shutdown and the 4 MiB prompt are in test_serve_http.py, test_serve_fields.py and
test_serve_shutdown.py; the 64-stream burst with the real model is in test_serve.py."""
import gzip
import json
import socket
import threading

import httpx
import pytest

from minillm.serve import running
from serve_tiny import MODEL, assert_settled, settles, chat, completion, sse_lines, tiny_llm  # noqa: F401 (settles: an autouse fixture)

CONTEXT = 512



@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok, max_seq_len=CONTEXT), served_model_name=MODEL) as s:
        yield s



def send(srv, body, path=None, **kw):
    raw = body.encode() if isinstance(body, str) else body               # a raw body: by its text
    is_chat = "prompt" not in body if isinstance(body, dict) else b'"messages"' in raw
    path = path or ("/chat/completions" if is_chat else "/completions")
    kw = {"content": body} if isinstance(body, (bytes, str)) else {"json": body, **kw}
    return httpx.post(srv.base_url + path, timeout=120, **kw)


def text_of(r):
    c = r.json()["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


RAW = lambda s: json.dumps(chat(), ensure_ascii=True)[:-1] + ", " + s + "}"   # noqa: E731
CASES = [  # (id, body, status, param)
    ("n=0", chat(n=0), 400, "n"), ("n=1000", chat(n=1000), 400, "n"), ("n='2'", chat(n="2"), 400, "n"),
    ("max_tokens=0", chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens=1e9", chat(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens=1.5", chat(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens=true", chat(max_tokens=True), 400, "max_tokens"),
    ("temperature=NaN", RAW('"temperature": NaN').replace('"temperature": 0, ', ""), 400, "temperature"),
    ("temperature=Infinity", RAW('"temperature": Infinity').replace('"temperature": 0, ', ""), 400, "temperature"),
    ("temperature=-Infinity", RAW('"temperature": -Infinity').replace('"temperature": 0, ', ""), 400, "temperature"),
    ("temperature=1e308", chat(temperature=1e308), 400, "temperature"),
    ("top_p=0", chat(top_p=0), 400, "top_p"), ("top_p=1.0000001", chat(top_p=1.0000001), 400, "top_p"),
    ("top_p=-1", chat(top_p=-1), 400, "top_p"),
    ("top_k=0", chat(top_k=0), 400, "top_k"), ("top_k=-2", chat(top_k=-2), 400, "top_k"),
    ("top_k=1e9", chat(top_k=10**9, temperature=0.7), 200, None),
    ("seed=-5", chat(seed=-5, temperature=0.8), 200, None),
    ("seed=2**70", chat(seed=2**70, temperature=0.8), 200, None),
    ("seed='abc'", chat(seed="abc"), 400, "seed"),
    ("stop='Paris'", completion(stop="Paris"), 200, None),
    ("stop=1000 strings", completion(stop=[f"s{i}" for i in range(1000)]), 400, "stop"),
    ("stop=['']", completion(stop=[""]), 400, "stop"),
    ("role wizard", {**chat(), "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("role developer", {**chat(), "messages": [{"role": "developer", "content": "hi"}]}, 400, "messages[0].role"),
    ("content parts", {**chat(), "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, 200, None),
    ("user content null", {**chat(), "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("assistant content null", {**chat(), "messages": [{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": None}]}, 400, "messages[1].content"),
    ("image_url part", {**chat(), "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}, 400, "messages[0].content"),
    ("system only", {**chat(), "messages": [{"role": "system", "content": "Be brief."}]}, 200, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("prompt token ids", completion([504, 3458, 282]), 200, None),
    ("prompt 2 strings", completion(["a", "b"]), 400, "prompt"),
    ("prompt 2 id lists", completion([[1, 2], [3, 4]]), 400, "prompt"),
    ("prompt 1 string", completion(["The capital of France is"]), 200, None),
    ("empty prompt", completion(""), 400, "prompt"),
    ("token id = vocab", completion([49152]), 400, "prompt"),
    ("token id negative", completion([-1]), 400, "prompt"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "caf\xe9"}', 400, None),
    ("gzip body", gzip.compress(json.dumps(completion()).encode()), 400, None),
    ("nested extra field", {**completion(), "extra": json.loads("[" * 20 + "]" * 20)}, 200, None),
    ("stream_options without stream", chat(stream_options={"include_usage": True}), 200, None),
    ("priority=3 on fcfs", chat(priority=3), 400, None),
    ("prompt = context ids", completion([5] * CONTEXT), 400, "prompt"),
    ("prompt + max_tokens 1 over", completion([5] * (CONTEXT - 31), max_tokens=32), 400, "max_tokens"),
]


@pytest.mark.parametrize("body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_review_case(srv, body, status, param):
    r = send(srv, body)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param


def test_equal_answers(srv):
    ref = text_of(send(srv, chat(max_tokens=8)))
    assert text_of(send(srv, chat(max_tokens=8, temperature=-0.0))) == ref
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]}
    assert text_of(send(srv, {**chat(max_tokens=8), **parts})) == ref
    plain = text_of(send(srv, completion(max_tokens=8)))
    assert text_of(send(srv, completion(["The capital of France is"], max_tokens=8))) == plain
    assert text_of(send(srv, completion(max_tokens=8, stop=["x" * 100_000]))) == plain
    with httpx.stream("POST", srv.base_url + "/completions", timeout=60,
                      json=completion(max_tokens=8, stop=["x" * 100_000], stream=True)) as r:
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1]) == plain
    r = send(srv, completion([5] * (CONTEXT - 32), max_tokens=32, ignore_eos=True))
    assert r.json()["usage"]["total_tokens"] == CONTEXT and r.json()["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_alone_in_a_burst_streamed_and_with_n(srv):
    body = completion(max_tokens=10, temperature=0.8, seed=11)
    alone = [text_of(send(srv, body)) for _ in range(2)]
    assert alone[0] == alone[1]
    results = [None] * 8

    def one(i):
        results[i] = text_of(send(srv, body if i % 2 else completion(max_tokens=10, temperature=0.8, seed=100 + i)))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[i] == alone[0] for i in range(1, 8, 2))
    with httpx.stream("POST", srv.base_url + "/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = sse_lines(r)
    assert "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1]) == alone[0]
    two = [[c["text"] for c in send(srv, {**body, "n": 2}).json()["choices"]] for _ in range(2)]
    assert two[0] == two[1] and len(two[0]) == 2


def test_bodies_and_transports(srv):
    body = json.dumps(completion()).encode()
    exact = body[:-1] + b" " * (4 * 2**20 - len(body)) + b"}"
    assert send(srv, exact).status_code == 200                     # exactly 4 MiB
    r = send(srv, exact + b" ")
    assert r.status_code == 413 and r.json()["error"]
    assert httpx.post(srv.base_url + "/completions", content=iter([body[:10], body[10:]])).status_code == 200
    r = httpx.post(srv.base_url + "/completions", timeout=60, content=iter([exact, b" "]))   # chunked
    assert r.status_code == 413 and r.json()["error"]
    r = httpx.get(srv.base_url + "/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(srv.base_url + "/completions", json=completion(), headers={"X-Big": "a" * 70_000})
    assert r.status_code in (200, 400, 431)
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:        # one keep-alive socket
        assert [http.post("/completions", json=completion(max_tokens=1)).status_code
                for _ in range(30)] == [200] * 30
    for stream in (False, True):                                         # HTTP/1.0
        data = json.dumps(completion(stream=stream)).encode()
        with socket.create_connection((srv.host, srv.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            raw = b""
            while chunk := sock.recv(65536):                             # the server closes
                raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
        assert rest.rstrip().endswith(b"data: [DONE]") if stream else json.loads(rest)["choices"]


def test_auth(tok):
    with running(tiny_llm(tok), served_model_name=MODEL, api_key="k3y") as s:
        url = s.base_url + "/completions"
        for headers, params in [({}, {}), ({"Authorization": "Bearer nope"}, {}),
                                ({"Authorization": "k3y"}, {}), ({"Authorization": "Bearer  k3y"}, {}),
                                ({}, {"api_key": "k3y"}), ({"X-API-Key": "k3y"}, {}),
                                ({"Authorization": "Basic azN5Og=="}, {}), ({"Authorization": "bearer k3y"}, {})]:
            r = httpx.post(url, json=completion(), headers=headers, params=params)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = {"Authorization": "Bearer k3y"}
        assert httpx.post(url, json=completion(), headers=ok).status_code == 200
        assert httpx.post(s.base_url + "/chat/completions", json=chat()).status_code == 401
        assert httpx.get(s.base_url + "/models").status_code == 401
        assert httpx.get(s.base_url + "/models", headers=ok).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.base_url + "/nothing").status_code in (401, 404)
        big = json.dumps(completion("x" * (4 * 2**20 - 200)))
        assert httpx.post(url, content=big, timeout=60).status_code == 401
        assert_settled(s.url)


def test_priorities(tok):
    with running(tiny_llm(tok, scheduling_policy="priority"), served_model_name=MODEL) as s:
        for prio, ok in [(-5, {200}), (1e30, {200, 400}), (2**63, {200, 400}), ("high", {400}),
                         (1.5, {400}), (True, {400}), (None, {200})]:
            r = send(s, completion(priority=prio))
            assert r.status_code in ok, (prio, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "priority"
        assert_settled(s.url)
