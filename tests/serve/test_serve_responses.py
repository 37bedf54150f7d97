"""The response shapes of logprobs (chat's content list, completions' four lists, echo's prompt
first) built from the engine's `CompletionOutput.logprobs` / `RequestOutput.prompt_logprobs`, and
streams whose chunks put together give the whole answer, logprobs included, never sending a
token's logprob before its text. The outputs are made here in the engine's shapes, so these
checks hold whatever engine fills them; the token bytes are checked against the tokenizer's own
decode of the whole text."""
import json
import math

import pytest

from minillm.engine.detokenizer import Detokenizer
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minillm.serve import responses
from minillm.serve.protocol import GenRequest
from minillm.serve.streaming import StreamWriter

TEXT = " Hello, 日本 world! naïve café\n\nThe end STOP and after"



def fake_logprobs(ids, k, seed=0):
    """One {id: Logprob} per position: the sampled id at rank 1 + (i + seed) % 3, and the other
    ranks up to k held by other ids; logprob -0.5 * rank."""
    out = []
    for i, t in enumerate(ids):
        rank = 1 + (i + seed) % 3
        others = iter(x for x in range(100 + 7 * i, 200 + 7 * i) if x != t)
        entry = {t: Logprob(-0.5 * rank, rank)}
        for r in range(1, k + 1):
            if r != rank:
                entry[next(others)] = Logprob(-0.5 * r, r)
        out.append(entry)
    return out


def request(kind, prompt_ids, k, stop=None, echo=None):
    params = SamplingParams(max_tokens=64, logprobs=k, stop=stop,
                            prompt_logprobs=k if echo is not None else None)
    return GenRequest(kind, "m", prompt_ids, params, True, False, 0, echo)


def output(ids, text, finish, lps, prompt_ids, prompt_lps=None):
    c = CompletionOutput(0, list(ids), finish, text, lps, None)
    return RequestOutput("r", prompt_ids, [c], finish is not None, RequestMetrics(0.0),
                         prompt_logprobs=prompt_lps)


def test_chat_logprobs_shape_bytes_and_top_list(tok):
    ids = tok.encode(TEXT)
    lps = fake_logprobs(ids, 2)
    lps[2][ids[2]] = Logprob(-math.inf, 3)                 # a masked token: -inf
    req = request("chat", [1, 2], 2)
    res = responses.response(req, "id", output(ids, TEXT, "length", lps, [1, 2]), responses.TokenText(tok))
    content = res["choices"][0]["logprobs"]["content"]
    json.dumps(res, allow_nan=False)                       # valid JSON: no infinity
    assert [e["token"] for e in content] == [tok.decode([i]) for i in ids]
    assert b"".join(bytes(e["bytes"]) for e in content) == tok.decode(ids).encode("utf-8")
    assert any("\ufffd" in e["token"] for e in content)    # a split character: bytes still right
    tt = responses.TokenText(tok)
    for i, e in enumerate(content):
        assert e["logprob"] == (-9999.0 if i == 2 else lps[i][ids[i]].logprob)
        ranked = sorted((lp.rank, t) for t, lp in lps[i].items() if lp.rank <= 2)
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([t]) for _, t in ranked]
        assert [t["logprob"] for t in e["top_logprobs"]] == [-0.5, -1.0]        # ranks 1, 2
        assert [t["bytes"] for t in e["top_logprobs"]] == [tt.bytes(t) for _, t in ranked]


def test_completion_logprobs_and_echo(tok):
    prompt = "The capital of France is"
    pids, ids = tok.encode(prompt), tok.encode(TEXT)
    lps, plps = fake_logprobs(ids, 3), [None] + fake_logprobs(tok.encode(prompt)[1:], 3, seed=1)
    tt = responses.TokenText(tok)
    res = responses.response(request("completion", pids, 3), "id",
                             output(ids, TEXT, "length", lps, pids), tt)
    lp = res["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"] == [e[i].logprob for e, i in zip(lps, ids)]
    for top, e, i in zip(lp["top_logprobs"], lps, ids):
        assert tok.decode([i]) in top and len(top) <= 4    # the sampled token and the top 3
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(ids))]
    echoed = responses.response(request("completion", pids, 3, echo=prompt), "id",
                                output(ids, TEXT, "length", lps, pids, plps), tt)
    choice = echoed["choices"][0]
    assert choice["text"] == prompt + TEXT
    lp = choice["logprobs"]
    assert lp["tokens"][:len(pids)] == [tok.decode([i]) for i in pids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(pids)] == [e[i].logprob for e, i in zip(plps[1:], pids[1:])]
    assert len(lp["tokens"]) == len(pids) + len(ids)
    assert "".join(lp["tokens"][:len(pids)]) == prompt


def _stream(tok, req, ids, lps, stop, prompt_ids, prompt_lps=None):
    """Engine-like snapshots of one completion growing a token at a time (the real Detokenizer,
    stop strings included), through StreamWriter; ([(event JSON, from the last snapshot)], the
    last snapshot)."""
    detok, writer, events, out = Detokenizer(tok, prompt_ids, stop), StreamWriter(req, "id", responses.TokenText(tok)), [], None
    for j, t in enumerate(ids, 1):
        detok.append(t)
        finish = "stop" if detok.stopped else ("length" if j == len(ids) else None)
        if finish == "length":
            detok.flush()
        out = output(ids[:j], detok.text, finish, lps[:j], prompt_ids, prompt_lps)
        events += [(json.loads(e[len("data: "):]), bool(finish)) for e in writer.events(out)]
        if finish:
            break
    return events, out


@pytest.mark.parametrize("stop", [None, ["STOP"], ["\n\n", "end STOP"]])
def test_chat_stream_logprobs_follow_their_text_and_add_up_to_the_whole(tok, stop):
    ids = tok.encode(TEXT)
    lps, req, tt = fake_logprobs(ids, 2), request("chat", [1, 2], 2, stop), responses.TokenText(tok)
    events, last = _stream(tok, req, ids, lps, stop, [1, 2])
    whole = responses.response(req, "id", last, tt)["choices"][0]
    text, sent = "", []
    for ev, final in events:
        ch = ev["choices"][0]
        text += ch["delta"].get("content") or ""
        if ch["logprobs"]:
            sent += ch["logprobs"]["content"]
        if not final:                               # never ahead of the text sent so far
            assert sum(len(e["token"]) for e in sent) <= len(text)
    assert text == whole["message"]["content"]
    assert sent == whole["logprobs"]["content"]
    if stop:
        assert stop[0] not in text
    assert events[-1][0]["choices"][0]["finish_reason"] == last.outputs[0].finish_reason
    assert len([e for e, _ in events if e["choices"][0]["logprobs"]]) > 3     # spread over chunks


def test_completion_stream_with_echo_adds_up_to_the_whole(tok):
    prompt = "The capital of France is"
    pids, ids = tok.encode(prompt), tok.encode(TEXT)
    lps, plps = fake_logprobs(ids, 1), [None] + fake_logprobs(pids[1:], 1, seed=2)
    req = request("completion", pids, 1, ["STOP"], echo=prompt)
    events, last = _stream(tok, req, ids, lps, ["STOP"], pids, plps)
    whole = responses.response(req, "id", last, responses.TokenText(tok))["choices"][0]
    text = "".join(ev["choices"][0]["text"] for ev, _ in events)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev, _ in events:
        if ev["choices"][0]["logprobs"]:
            for key in merged:
                merged[key] += ev["choices"][0]["logprobs"][key]
    assert text == whole["text"] and text.startswith(prompt)
    assert merged == whole["logprobs"]


def test_without_logprobs_the_field_is_null(tok):
    ids = tok.encode("Hi there")
    req = GenRequest("chat", "m", [1], SamplingParams(max_tokens=8), False, False, 0)
    res = responses.response(req, "id", output(ids, "Hi there", "stop", None, [1]), responses.TokenText(tok))
    assert res["choices"][0]["logprobs"] is None and "prompt_logprobs" not in res
