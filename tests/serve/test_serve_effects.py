"""The fields the server honours do what they say, end to end over HTTP on a tiny random model:
logprobs (chat and completions, echo's prompt logprobs, streamed as whole) equal the engine's own
outputs for the same SamplingParams (the engine is checked against transformers in
test_logprobs.py) and, greedy, the log-softmax of a dense forward pass written here; logit_bias
forces its token; frequency and presence penalties follow OpenAI's formula run here by hand;
guided_choice and guided_regex answers are what the grammar allows; a grammar whose language is
empty is a 400 naming its field (or, found only after a token, a 500 sampling_error: never a
"stop"); a grammar compiles off the event loop (a plain request is answered while a compile is
held); best_of returns n choices."""
import asyncio
import json
import re
import secrets
import threading

import httpx
import pytest
import torch

from minillm import SamplingParams
from minillm.serve import running
from serve_tiny import MODEL, assert_settled, chat, completion, sse_lines, tiny_llm



@pytest.fixture(scope="module")
def ref(tok):
    """An engine of its own with the same weights (tiny_model is seeded), for reference answers."""
    return tiny_llm(tok)


@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(autouse=True)
def _settles(srv):
    yield
    assert_settled(srv.url)


def post(srv, path, body):
    r = httpx.post(srv.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def dense_logprobs(model, ids) -> torch.Tensor:
    """log-softmax of a plain forward pass over the whole sequence: (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).float()[0], -1)


def test_chat_logprobs_are_the_engines_and_the_dense_log_softmax(srv, ref, tok):
    body = chat("Tell me a story.", max_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True)
    got = post(srv, "/chat/completions", body)["choices"][0]["logprobs"]["content"]
    want = ref.chat([body["messages"]], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True),
                    use_tqdm=False)[0]
    c = want.outputs[0]
    assert [e["token"] for e in got] == [tok.decode([t]) for t in c.token_ids]
    for e, t, entry in zip(got, c.token_ids, c.logprobs):
        assert e["logprob"] == pytest.approx(entry[t].logprob, abs=1e-6)
        ranked = sorted((lp.rank, i) for i, lp in entry.items() if lp.rank <= 3)
        assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([i]) for _, i in ranked]
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(
            [entry[i].logprob for _, i in ranked], abs=1e-6)
    dense = dense_logprobs(ref.llm_engine.model, want.prompt_token_ids + c.token_ids)
    p = len(want.prompt_token_ids)
    for j, (e, t) in enumerate(zip(got, c.token_ids)):           # greedy: rank 1, log-softmax
        assert e["logprob"] == pytest.approx(float(dense[p + j - 1, t]), abs=1e-4)
        assert e["top_logprobs"][0]["token"] == e["token"]


def test_completion_logprobs_with_echo_hold_the_prompts(srv, ref, tok):
    prompt = "The capital of France is"
    res = post(srv, "/completions", completion(prompt, max_tokens=5, logprobs=2, echo=True))
    lp, text = res["choices"][0]["logprobs"], res["choices"][0]["text"]
    ids = tok.encode(prompt)
    out = ref.generate([ids], SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert text == prompt + out.outputs[0].text
    assert len(lp["tokens"]) == len(ids) + 5 and lp["token_logprobs"][0] is None
    dense = dense_logprobs(ref.llm_engine.model, ids + out.outputs[0].token_ids)
    for j, t in enumerate(ids[1:] + out.outputs[0].token_ids, 1):
        assert lp["token_logprobs"][j] == pytest.approx(float(dense[j - 1, t]), abs=1e-4)
        assert len(lp["top_logprobs"][j]) in (2, 3)           # the top 2 and the token taken
    assert lp["text_offset"][len(ids)] == len(prompt)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_logprobs_are_the_whole_answers(srv, kind):
    path, body = ("/chat/completions", chat("Count to ten.", max_tokens=12, logprobs=True,
                                            top_logprobs=2, stop=["ing"])) if kind == "chat" else \
        ("/completions", completion(max_tokens=12, logprobs=1, stop=[" the"]))
    whole = post(srv, path, body)["choices"][0]["logprobs"]
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(l[6:]) for l in sse_lines(r) if l != "data: [DONE]"]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    if kind == "chat":
        assert [x for p in parts for x in p["content"]] == whole["content"]
    else:
        assert {k: [x for p in parts for x in p[k]] for k in whole} == whole


def test_logit_bias_forces_its_token(srv, tok):
    target = tok.encode(" Paris")[0]
    res = post(srv, "/completions", completion(max_tokens=4, logprobs=0, ignore_eos=True,
                                               logit_bias={str(target): 100}))
    assert res["choices"][0]["logprobs"]["tokens"] == [tok.decode([target])] * 4


def test_penalties_follow_openais_formula(srv, ref, tok):
    """Greedy with frequency and presence penalties = argmax of logits - f * count - p * [count > 0],
    counting the output so far (OpenAI's formula), decoded by a dense loop here."""
    ids = tok.encode("one one one one one one")
    f, p = 1.5, 0.5
    res = post(srv, "/completions", {**completion(ids, max_tokens=8, logprobs=0, ignore_eos=True),
                                     "frequency_penalty": f, "presence_penalty": p})
    out = []
    for _ in range(8):
        with torch.no_grad():
            logits = ref.llm_engine.model(torch.tensor([ids + out])).float()[0, -1]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float() \
            if out else torch.zeros_like(logits)
        out.append(int((logits - f * counts - p * (counts > 0).float()).argmax()))
    assert res["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in out]
    plain = post(srv, "/completions", completion(ids, max_tokens=8, ignore_eos=True))
    assert len(set(out)) > 1 or plain["choices"][0]["text"] != res["choices"][0]["text"]


def test_guided_choice_and_regex_answers_are_what_the_grammar_allows(srv):
    for seed in range(3):
        r = post(srv, "/chat/completions", chat(guided_choice=["red", "green", "blue"], max_tokens=8,
                                                temperature=1.0, seed=seed))
        assert r["choices"][0]["message"]["content"] in ("red", "green", "blue")
        r = post(srv, "/completions", completion(max_tokens=8, temperature=1.0, seed=seed,
                                                 structured_outputs={"regex": "[0-9]{3}-[a-c]"}))
        assert re.fullmatch("[0-9]{3}-[a-c]", r["choices"][0]["text"]), r["choices"][0]["text"]
        assert r["choices"][0]["finish_reason"] == "stop"


def test_a_bad_grammar_is_a_400_naming_its_field(srv):
    r = httpx.post(srv.base_url + "/chat/completions", timeout=60,
                   json=chat(guided_grammar="start: ((("))
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text


EMPTY = [("guided_grammar", "start: a\na: a"),              # no finite string derives from a
         ("guided_regex", "[^\\x00-\\U0010FFFF]")]            # a character that is none


@pytest.mark.parametrize("field,grammar", EMPTY)
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_whose_language_is_empty_is_a_400_naming_its_field(srv, field, grammar, stream):
    r = httpx.post(srv.base_url + "/completions", timeout=60,
                   json=completion(stream=stream, **{field: grammar}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "matches no string" in r.json()["error"]["message"]


def test_a_grammar_that_dies_after_a_token_is_a_sampling_failure_not_a_stop(srv):
    """llguidance allows "a", then finds that nothing can follow: no string is in the language,
    so no answer may end "stop" (the mask it gives then allows only EOS)."""
    r = httpx.post(srv.base_url + "/completions", timeout=60,
                   json=completion(guided_grammar='start: "a" x\nx: x'))
    assert r.status_code == 500 and r.json()["error"]["code"] == "sampling_error", r.text


def test_a_grammar_compiles_off_the_event_loop(srv, monkeypatch):
    """The compile is held until a plain request has been answered: on the event loop it would
    hold that request too (the plain request's timeout then fails the test)."""
    from minillm.engine import structured
    real, held, entered, on_loop = structured._grammar_text, threading.Event(), threading.Event(), []

    def slow(name, text):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        entered.set()
        held.wait(60)
        return real(name, text)
    monkeypatch.setattr(structured, "_grammar_text", slow)
    regex = f"[0-9]{{2}}-{secrets.token_hex(4)}"          # new: not in the grammar cache
    answers = {}
    guided = threading.Thread(target=lambda: answers.update(guided=httpx.post(
        srv.base_url + "/completions", json=completion(guided_regex=regex, max_tokens=12),
        timeout=120)))
    guided.start()
    try:
        assert entered.wait(60)
        plain = httpx.post(srv.base_url + "/completions", json=completion(), timeout=20)
        assert plain.status_code == 200 and "guided" not in answers
    finally:
        held.set()
        guided.join(120)
    assert answers["guided"].status_code == 200, answers["guided"].text
    assert re.fullmatch(regex, answers["guided"].json()["choices"][0]["text"])
    assert on_loop == [False]                           # compiled once, in a worker thread


def test_best_of_returns_the_n_best(srv):
    r = post(srv, "/completions", completion(max_tokens=4, temperature=1.0, seed=1, n=2, best_of=4))
    assert [c["index"] for c in r["choices"]] == [0, 1]
