"""Chapter 8's server over loopback, with the official openai client and raw HTTP: streams equal the
whole answers, usage equals the tokenizer's counts, clients that leave free their blocks, bad
input is a 4xx with OpenAI's error object while everyone else keeps being served."""
import asyncio
import time

import httpx
import openai
import pytest

from minillm import LLM, SamplingParams
from minillm.model.chat import encode_chat
from minillm.serve import running
from serve_tiny import scrape

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
QUESTIONS = ["Translate 'thank you' into Japanese.", "How do you say 'good morning' in Chinese?",
             "Write the French word for coffee with its accent.", "Say hello in Russian.",
             "What is the capital of France?", "Write a haiku about the sea.",
             "Give three tips for a first marathon.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def llm():
    """16 sequences at a time: the 32 concurrent streams below are twice what one batch holds."""
    return LLM(MODEL, max_num_seqs=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def srv(llm):
    with running(llm, api_key=None) as s:
        yield s


def _msgs(q):
    return [{"role": "user", "content": q}]


def _wait_idle(srv, timeout_s=30.0):
    """Until the engine holds no request and every block is back in the pool."""
    eng = srv.server.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not eng.has_unfinished_requests() and eng.num_free_blocks == eng.num_blocks \
                and srv.server.loop.num_pending == 0:
            return True
        time.sleep(0.05)
    return False


def test_32_concurrent_streams_equal_the_whole_answers_and_count_usage_as_the_tokenizer(srv, llm):
    """Twice max_num_seqs: half the streams wait in the queue while the other half decode."""
    tok = llm.get_tokenizer()
    assert llm.llm_engine.config.max_num_seqs == 16
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    qs = [QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)) for i in range(32)]

    async def one(q):
        stream = await client.chat.completions.create(
            model=MODEL, messages=_msgs(q), max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        parts, usage, reasons = [], None, []
        async for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                reasons.append(ch.choices[0].finish_reason)
            else:
                usage = ch.usage
        return parts, usage, reasons

    async def main():
        try:
            return await asyncio.gather(*(one(q) for q in qs))
        finally:
            await client.close()

    streamed = asyncio.run(main())
    whole = llm.chat([_msgs(q) for q in qs], SamplingParams(max_tokens=12), use_tqdm=False)
    multibyte = 0
    for q, (parts, usage, reasons), ref in zip(qs, streamed, whole):
        text = ref.outputs[0].text
        assert "".join(parts) == text
        # no chunk ends inside a character: the replacement character shows only where the
        # whole answer has it too (a length cut in the middle of a character)
        assert all("\ufffd" not in p for p in parts[:-2])
        multibyte += any(ord(c) > 127 for c in text)
        assert usage.prompt_tokens == len(encode_chat(tok, _msgs(q)))
        assert usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert reasons[-1] == ref.outputs[0].finish_reason and set(reasons[:-1]) == {None}
    assert multibyte >= 8                        # the test did see multi-byte UTF-8
    assert _wait_idle(srv)


def test_the_whole_answer_and_the_completions_endpoint(srv, llm):
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=_msgs(QUESTIONS[4]), max_tokens=10,
                                       temperature=0)
    ref = llm.chat(_msgs(QUESTIONS[4]), SamplingParams(max_tokens=10), use_tqdm=False)[0]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    ref = llm.generate("The capital of France is", SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert c.object == "text_completion" and c.choices[0].text == ref.outputs[0].text
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_stop_strings_and_n_stream_as_the_whole_answer(srv):
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    kw = dict(model=MODEL, messages=_msgs(QUESTIONS[6]), max_tokens=40, temperature=0.8, seed=7,
              n=2, stop=["\n", "marathon"])
    whole = client.chat.completions.create(**kw)
    parts = {0: [], 1: []}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            parts[c.index].append(c.delta.content or "")
    for choice in whole.choices:
        text = "".join(parts[choice.index])
        assert text == choice.message.content
        assert "\n" not in text and "marathon" not in text


def test_a_client_that_leaves_mid_stream_frees_its_blocks(srv):
    assert _wait_idle(srv)
    aborted = srv.server.metrics.value("request_aborted_total")
    body = {"model": MODEL, "messages": _msgs(QUESTIONS[5]), "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break                        # hang up with ~390 tokens still to go
    assert _wait_idle(srv)
    assert srv.server.metrics.value("request_aborted_total") == aborted + 1
    # and a non-streamed request whose client times out
    with httpx.Client(timeout=0.5) as http:
        with pytest.raises(httpx.TimeoutException):
            http.post(srv.base_url + "/chat/completions", json={**body, "stream": False})
    assert _wait_idle(srv)
    assert srv.server.metrics.value("request_aborted_total") == aborted + 2


BAD = [  # (body or raw bytes, expected status, param or None)
    (b"{not json", 400, None),
    ({"model": "gpt-4", "messages": _msgs("hi")}, 404, "model"),
    ({"messages": _msgs("hi")}, 400, "model"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": _msgs("hi"), "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": _msgs("hi"), "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": _msgs("hi"), "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "messages": _msgs("hi"), "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": _msgs("hi"), "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "messages": _msgs("hi"), "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": _msgs("hi"), "n": 0}, 400, "n"),
    ({"model": MODEL, "messages": _msgs("hi"), "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": _msgs("hi"), "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "messages": _msgs("hi"), "seed": 1.5}, 400, "seed"),
    ({"model": MODEL, "prompt": [5] * 9000}, 400, None),             # beyond the 8192 context
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ([1, 2, 3], 400, None),
    ({"model": MODEL, "messages": _msgs("hi"), "priority": 1}, 400, None),  # fcfs serves at 0
    ({"model": MODEL, "messages": _msgs("hi"), "priority": "high"}, 400, "priority"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(srv, body, status, param):
    path = "/completions" if isinstance(body, dict) and "prompt" in body else "/chat/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.base_url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(srv.base_url + "/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": _msgs("hi"), "max_tokens": 2})
    assert ok.status_code == 200


def test_oversized_bodies_unknown_routes_and_methods(srv):
    big = {"model": MODEL, "messages": _msgs("x" * (5 * 2**20))}
    r = httpx.post(srv.base_url + "/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and "error" in r.json()
    assert httpx.get(srv.base_url + "/nothing").json()["error"]
    assert httpx.get(srv.base_url + "/chat/completions").status_code == 405
    assert httpx.get(srv.url + "/health").text == "ok"


def test_metrics_count_what_was_served(llm):
    with running(llm, served_model_name="m") as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        usages = [client.chat.completions.create(model="m", messages=_msgs(q), max_tokens=5,
                                                 temperature=0).usage for q in QUESTIONS[:3]]
        values = scrape(s.url)

    def one(name, **labels):
        return values[(f"minillm:{name}", frozenset(labels.items()))]
    assert one("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert one("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert sum(v for (name, _), v in values.items() if name == "minillm:request_success_total") == 3
    assert one("time_to_first_token_seconds_count") == 3
    assert one("e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert one("request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert one("kv_cache_blocks_in_use") == 0 and one("num_requests_waiting") == 0


def test_api_key_and_a_full_queue(llm):
    with running(llm, api_key="s3cret", max_pending=1) as s:
        body = {"model": MODEL, "messages": _msgs("hi"), "max_tokens": 2}
        url = s.base_url + "/chat/completions"
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json=body, headers=auth).status_code == 200
        long = {**body, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60, headers=auth) as http:
            with http.stream("POST", url, json=long) as r:
                next(r.iter_lines())            # the long request is in flight
                busy = http.post(url, json=body)
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
                assert busy.json()["error"]["code"] == "overloaded"
        assert _wait_idle(s)
        assert httpx.post(url, json=body, headers=auth).status_code == 200


def test_priorities_reach_the_engine_and_a_queue_timeout_is_a_503(smollm2):
    from minillm.engine.policies.priority import PriorityClass
    model, tok = smollm2
    classes = (PriorityClass("interactive", 0), PriorityClass("batch", 2, 1e-6, "reject"))
    strict = LLM(model, tok, scheduling_policy="priority", priority_classes=classes)
    with running(strict, served_model_name=MODEL) as s:
        url = s.base_url + "/chat/completions"
        body = {"model": MODEL, "messages": _msgs("hi"), "max_tokens": 2}
        assert httpx.post(url, json={**body, "priority": 0}, timeout=60).status_code == 200
        r = httpx.post(url, json={**body, "priority": 1}, timeout=60)   # names no class
        assert r.status_code == 400 and "allowed" in r.json()["error"]["message"]
        r = httpx.post(url, json={**body, "priority": 2}, timeout=60)   # waits > 1 us: refused
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
        assert "queue timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", url, json={**body, "priority": 2, "stream": True}, timeout=60) as r:
            lines = [l for l in r.iter_lines() if l]
        assert lines[-1] == "data: [DONE]" and "queue_timeout" in lines[-2]
        assert _wait_idle(s)


def test_json_mode_and_json_schema_answers_parse_and_validate(srv):
    """response_format through the official client: the content is what the grammar produced,
    JSON that parses (json_object) and validates against its schema (json_schema), streamed too."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    msgs = _msgs("Give the largest city of France and its population as JSON.")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_object"}) if c.choices]
    assert "".join(parts) == r.choices[0].message.content
    assert _wait_idle(srv)
