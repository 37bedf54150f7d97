"""The server as an evaluation client uses it: `echo: true, max_tokens: 0, logprobs: 1` scores a
text (vLLM's scoring request; lm-eval 0.4's local-completions sends max_tokens 1 and drops the
last token), with prefix caching on; top_logprobs under top_p are
the model's top tokens; a stop token's text is left out unless include_stop_str_in_output.

References: a dense forward pass of the served tiny model (fp32) and its log-softmax, tolerance
1e-4 (a batched paged forward against a dense one, in fp32); the tokenizer's own decode; vLLM's
documented answers (echo with max_tokens 0 returns the prompt's logprobs and no token)."""
import httpx
import pytest
import torch

from minillm.model.chat import encode_chat
from minillm.serve import running
from serve_tiny import MODEL, assert_settled, tiny_llm

TOL = 1e-4
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def srv(tok):
    llm = tiny_llm(tok, enable_prefix_caching=True)
    with running(llm, served_model_name=MODEL) as s:
        s.model = llm.model
        yield s


def post(srv, path: str, **body) -> httpx.Response:
    return httpx.post(srv.base_url + path, json={"model": MODEL, **body}, timeout=120)


def log_softmax_rows(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)   # (T, V)


@pytest.mark.parametrize("max_tokens", [0, 1])   # vLLM's scoring request; lm-eval 0.4's (1 token)
def test_echo_scores_the_prompt_with_prefix_caching(srv, tok, max_tokens):
    """The prompt's logprobs equal the dense forward's, with its blocks in the prefix cache."""
    ids = tok.encode(PROMPT)
    assert post(srv, "/completions", prompt=PROMPT, max_tokens=1).status_code == 200   # cached
    ref = log_softmax_rows(srv.model, ids)
    for _ in range(2):                                  # the second finds its own blocks cached
        r = post(srv, "/completions", prompt=PROMPT, echo=True, max_tokens=max_tokens, logprobs=1,
                 temperature=0)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["text"].startswith(PROMPT) and c["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL)
            best = int(ref[i - 1].argmax())
            assert lp["top_logprobs"][i][tok.decode([best])] == pytest.approx(
                ref[i - 1, best].item(), abs=TOL)
    assert_settled(srv.url)


def test_max_tokens_0_without_echo_is_a_400_naming_it(srv):
    for path, body in (("/completions", dict(prompt="Hi", max_tokens=0)),
                       ("/completions", dict(prompt="Hi", max_tokens=0, prompt_logprobs=1)),
                       ("/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=0))):
        r = post(srv, path, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_top_logprobs_under_top_k_and_top_p_are_the_models_top_tokens(srv, tok):
    """top_k 2 leaves 3 of the 5 listed alternatives outside the law: they are still the
    model's next most likely tokens, with the model's logprobs (vLLM's raw_logprobs)."""
    msgs = [{"role": "user", "content": "Name a city."}]
    r = post(srv, "/chat/completions", messages=msgs, temperature=0.7, top_k=2, top_p=0.3,
             seed=5, logprobs=True, top_logprobs=5, max_tokens=1)
    assert r.status_code == 200, r.text
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    ids = encode_chat(tok, msgs)
    top = log_softmax_rows(srv.model, ids)[-1].topk(5)
    assert [t["token"] for t in first["top_logprobs"]] == [tok.decode([i]) for i in top.indices.tolist()]
    assert [t["logprob"] for t in first["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=TOL)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with dense forwards: the reference tokens."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    return out


def test_a_stop_token_leaves_no_text_unless_asked(srv, tok):
    """vLLM: the stop token's id counts (usage) but its text is not in the answer."""
    prompt = tok.encode(PROMPT)
    ids = greedy(srv.model, prompt, 8)
    at = next(i for i in range(1, 8) if ids[i] not in ids[:i] and tok.decode(ids[i:i + 1]).strip())
    for keep in (False, True):
        r = post(srv, "/completions", prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True,
                 stop_token_ids=[ids[at]], include_stop_str_in_output=keep)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == at + 1
        assert c["text"] == tok.decode(ids[:at + 1 if keep else at])
