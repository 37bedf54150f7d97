"""One range per SamplingParams field, the same at both doors: for each boundary value (just
inside and just outside each bound, wrong types), `SamplingParams(**{field: value})` raises iff
the HTTP server answers 400 naming that field as `param`, and a value both accept reaches the
engine as the same SamplingParams. The REFUSED column is the spec the ranges follow: OpenAI's
for OpenAI's fields (4 stop strings, penalties [-2, 2], logit_bias [-100, 100]) but temperature
([0, 100]), vLLM's for its extras (top_k -1 or >= 1, repetition_penalty > 0,
20 logprobs).
Limits of the engine (n within max_num_seqs, token ids within the vocabulary, max_tokens within
the context) are not field ranges and stay inside them here."""
import json

import httpx
import pytest

from minillm import SamplingParams
from minillm.engine.sampling_params import SamplingParamError, SamplingParamTypeError
from minillm.serve import running
from minillm.serve.protocol import parse_request
from serve_tiny import MODEL, assert_settled, tiny_llm

BASE = {"max_tokens": 2, "temperature": 0}      # given at both doors (HTTP's temperature default is 1)
NAN, INF = float("nan"), float("inf")
R, OK = True, False                             # refused, accepted
TABLE = {  # field -> [(value as JSON carries it, refused?)]
    "temperature": [(0, OK), (2, OK), (2.0000001, OK), (100, OK), (100.001, R), (1e308, R), (-1e-9, R), (0.005, OK), (NAN, R), (INF, R),
                    (10**400, R), ("hot", R), (True, R)],
    "top_p": [(1, OK), (1e-9, OK), (0, R), (1.0000001, R), (-1, R), (NAN, R), ("1", R)],
    "top_k": [(-1, OK), (1, OK), (10**6, OK), (0, R), (-2, R), (2.5, R), (True, R)],
    "max_tokens": [(1, OK), (2, OK), (0, R), (-1, R), (1.5, R), ("2", R), (True, R)],
    "seed": [(0, OK), (-5, OK), (2**70, OK), (1.5, R), ("abc", R), (True, R)],
    "stop_token_ids": [([], OK), ([5, 7], OK), ([0], OK), ([-1], R), ([1.5], R), ([True], R),
                       ("5", R), (5, R)],
    "ignore_eos": [(True, OK), (False, OK), (1, R), ("yes", R)],
    "n": [(1, OK), (2, OK), (0, R), (-1, R), (1.5, R), (True, R), ("2", R)],
    "stop": [("x", OK), ([], OK), (["a", "b", "c", "d"], OK), (["a", "b", "c", "d", "e"], R),
             ([""], R), ("", R), ([1], R), (5, R)],
    "presence_penalty": [(-2, OK), (2, OK), (-2.0001, R), (2.0001, R), ("x", R), (NAN, R)],
    "frequency_penalty": [(-2, OK), (2, OK), (-2.0001, R), (2.0001, R), (True, R), (INF, R)],
    "repetition_penalty": [(1, OK), (1e-9, OK), (2, OK), (2.5, OK), (1e30, OK), (0, R), (-1, R),
                           (INF, R), (NAN, R), (10**400, R), ("1", R)],
    "min_p": [(0, OK), (1, OK), (-0.01, R), (1.01, R), ("0", R)],
    "logit_bias": [({5: 100}, OK), ({5: -100}, OK), ({5: 0.5}, OK), ({5: 100.5}, R),
                   ({5: -101}, R), ({5: "x"}, R), ({5: True}, R), ({5: NAN}, R)],
    "min_tokens": [(0, OK), (2, OK), (3, R), (-1, R), (1.5, R), (True, R)],      # max_tokens 2
    "bad_words": [([], OK), (["Paris"], OK), ([""], R), ("Paris", R), ([1], R)],
    "logprobs": [(0, OK), (20, OK), (21, R), (-1, R), (1.5, R), (True, R)],
    "prompt_logprobs": [(0, OK), (20, OK), (21, R), (-1, R), ("1", R)],
    "best_of": [(1, OK), (2, OK), (8, OK), (0, R), (1.5, R), (True, R)],          # n 1
    "include_stop_str_in_output": [(True, OK), (False, OK), (1, R), ("yes", R)],
}
NOT_IN_TABLE = {"structured_outputs"}           # a StructuredOutputsParams, built from HTTP shapes
CASES = [(f, v, r) for f, rows in TABLE.items() for v, r in rows]


def http_value(field, value):
    """The body's spelling: JSON object keys are strings."""
    return {str(k): b for k, b in value.items()} if field == "logit_bias" else value


@pytest.fixture(scope="module")
def srv(tok):
    with running(tiny_llm(tok), served_model_name=MODEL) as s:
        yield s


def test_the_table_holds_every_field():
    assert set(TABLE) | NOT_IN_TABLE == set(SamplingParams.__dataclass_fields__)


@pytest.mark.parametrize("field,value,refused", CASES, ids=[f"{f}={v!r}"[:40] for f, v, _ in CASES])
def test_one_range_per_field_at_both_doors(srv, tok, field, value, refused):
    try:
        local = SamplingParams(**{**BASE, field: value})
        local_refused = False
    except SamplingParamError as err:
        assert err.field == field and field in str(err)
        local_refused = True
    body = {"model": MODEL, "prompt": "The capital of France is", **BASE,
            field: http_value(field, value)}
    r = httpx.post(srv.base_url + "/completions", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})      # NaN and Infinity too
    assert local_refused == refused, f"SamplingParams: {field}={value!r}"
    if refused:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    else:
        assert r.status_code == 200, r.text
        got = parse_request(body, "completion", MODEL, tok, context=512, vocab_size=len(tok),
                            pool_tokens=2048, max_n=8).params
        assert got == (local if field != "temperature" or not 0 < value < 0.01 else
                       SamplingParams(**{**BASE, "temperature": 0.01}))    # vLLM's clamp
    assert_settled(srv.url)


def test_a_wrong_type_is_a_type_error_that_names_the_field():
    with pytest.raises(SamplingParamTypeError, match="top_k") as info:
        SamplingParams(top_k=2.5)
    assert isinstance(info.value, TypeError) and info.value.field == "top_k"
    with pytest.raises(SamplingParamError, match=r"repetition_penalty must be a real number > 0"):
        SamplingParams(repetition_penalty=0)


def test_chat_names_the_field_as_its_body_spells_it(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **BASE,
            "logprobs": True, "top_logprobs": 21}
    r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    body = {**body, "top_logprobs": 1, "max_tokens": None, "max_completion_tokens": 0}
    r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
