"""Disaggregated prefill and decode (minillm/distributed/kv_transfer.py, minillm/serve/{kv_link,
disagg_worker,router,disaggregated}.py), against a single engine as the reference:

- a prefilled request moved between two engines in one process decodes the same greedy tokens,
  across different block sizes, and moves exactly chapter 2's KV bytes;
- through the two worker processes, concurrent prompts (one longer than a block) get a single
  LLMEngine's greedy tokens, and each request's transfer is kv_cache_bytes(cfg, S, "fp32");
- over HTTP, a streamed answer is the single engine's text; a grammar is compiled off the event
  loop (the router checks it against that compile);
- workers started apart that dial the router (`--role`) serve too; a killed prefill worker fails
  only new requests (a decoding one finishes); a killed decode worker
  ends its stream with a 503 "worker_unavailable" naming it and /health answers 503 from then
  on; no process is left after stop();
- bad input: n > 1, threads_per_engine < 1, a port in use (a ValueError naming port); over HTTP
  what the router cannot serve is a 400 naming the field.

A tiny random model of the real class keeps it fast (each worker process takes a few seconds to
start); its answers are noise, but the reference sees the same noise.
"""
import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
import torch

from minillm.analysis.kv_math import kv_cache_bytes
from minillm.engine.config import EngineConfig
from minillm.distributed.kv_transfer import can_import, export_prompt_kv, import_prefilled
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.model.config import get_config
from minillm.model.loading import tiny_model
from minillm.serve.disagg_worker import run_remote
from minillm.serve.disaggregated import check_port, running
from minillm.serve.router import DisaggregatedEngine
from minillm.serve import cli
from serve_tiny import assert_settled, tokenizer
from procs import alive

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 17, [3]]      # 40 tokens: three blocks of 16




def _drive(engine, rids) -> dict:
    outs, deadline = {}, time.monotonic() + 60
    while any(r not in outs or not outs[r].finished for r in rids) and time.monotonic() < deadline:
        for o in engine.step():
            outs[o.request_id] = o
    return outs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model, one_thread):
    return [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=64)).generate(PROMPTS, GREEDY)]


def test_smollm2_moves_46080_bytes_per_prompt_token():
    assert kv_cache_bytes(get_config("smollm2-135m"), 1, dtype="fp32") == 46_080   # 2*30*3*64*4


def test_handoff_between_two_engines_in_one_process(model, reference):
    pre = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    dec = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8))     # another block size
    rids = [pre.add_request(p, GREEDY) for p in PROMPTS]
    while pre.has_unfinished_requests():
        for out in pre.step():
            h = export_prompt_kv(pre, out.request_id)
            pre.abort_request(out.request_id)
            assert h.nbytes == kv_cache_bytes(model.config, len(h.prompt_token_ids), dtype="fp32")
            assert h.num_blocks == -(-len(h.prompt_token_ids) // 16)
            assert can_import(dec, h)
            import_prefilled(dec, h)
    assert pre.num_free_blocks == pre.num_blocks                    # every prefill block came back
    outs = _drive(dec, rids)
    assert [outs[r].token_ids for r in rids] == reference
    assert dec.num_free_blocks == dec.num_blocks


def test_chunked_prefill_and_prefix_caching_on_both_sides(model):
    """A 40-token prompt prefilled in chunks of 16; the second prompt shares 32 tokens, which the
    decode side's prefix cache already holds: they are reused, not written again."""
    prompts = [list(range(10, 50)), list(range(10, 45)) + [99, 98]]
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=64)).generate(prompts, GREEDY)]
    pre = LLMEngine(model, EngineConfig(num_blocks=64, max_num_batched_tokens=16,
                                        enable_prefix_caching=True))
    dec = LLMEngine(model, EngineConfig(num_blocks=64, enable_prefix_caching=True))
    got = []
    for p in prompts:
        rid = pre.add_request(p, GREEDY)
        while not pre.step():                        # chunks of 16 until the first token
            pass
        import_prefilled(dec, export_prompt_kv(pre, rid))
        pre.abort_request(rid)
        got.append(_drive(dec, [rid])[rid])
    assert [o.token_ids for o in got] == want
    assert [o.metrics.num_cached_tokens for o in got] == [0, 32]


def test_a_seeded_request_with_logprobs_moves_too(model):
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)
    want = LLMEngine(model, EngineConfig(num_blocks=64)).generate([PROMPTS[1]], sp)[0]
    pre, dec = LLMEngine(model, EngineConfig(num_blocks=64)), LLMEngine(model, EngineConfig(num_blocks=64, seed=5))
    rid = pre.add_request(PROMPTS[1], sp)
    pre.step()
    import_prefilled(dec, export_prompt_kv(pre, rid))
    got = _drive(dec, [rid])[rid]
    assert got.token_ids == want.token_ids                  # the seed rule, not the engine's seed
    assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob)
    assert len(got.outputs[0].logprobs) == 12
    with pytest.raises(ValueError, match="already in use"):
        rid2 = pre.add_request(PROMPTS[0], sp)
        pre.step()
        h = export_prompt_kv(pre, rid2)
        h.request_id = rid
        import_prefilled(dec, h)


@pytest.fixture(scope="module")
def disagg(model):
    engine = DisaggregatedEngine(model, None, EngineConfig(num_blocks=64))
    yield engine
    engine.shutdown()
    assert not any(alive(pid) for pid in engine.pids.values())


def test_two_processes_give_the_single_engines_greedy_tokens(disagg, model, reference):
    rids = [disagg.add_request(p, GREEDY) for p in PROMPTS]       # all in flight at once
    outs = _drive(disagg, rids)
    assert [outs[r].token_ids for r in rids] == reference
    assert all(outs[r].finish_reason == "length" and outs[r].error is None for r in rids)
    for r, p in zip(rids, PROMPTS):
        t = disagg.transfers[r]
        assert t["bytes"] == kv_cache_bytes(model.config, len(p), dtype="fp32")
        assert t["blocks"] == -(-len(p) // 16)
        m = outs[r].metrics
        assert m.first_token_time <= m.finish_time and len(m.token_times) == GREEDY.max_tokens
    assert len(disagg.pids) == 2 and os.getpid() not in disagg.pids.values()


def test_bad_input_is_refused_at_the_router(disagg, model):
    with pytest.raises(ValueError, match="n and best_of must be 1"):
        disagg.add_request([1, 2], SamplingParams(n=2, temperature=0.5))
    with pytest.raises(ValueError, match="vocab_size"):
        disagg.add_request([10**6], GREEDY)
    with pytest.raises(ValueError, match="threads_per_engine"):
        DisaggregatedEngine(model, None, threads_per_engine=0)
    assert not disagg.has_unfinished_requests()


def test_cli_flags_are_checked(capsys):
    for argv, said in ((["--role", "prefill"], "needs --disaggregated"),
                       (["--disaggregated", "--threads-per-engine", "0"], "--threads-per-engine must be >= 1"),
                       (["--disaggregated", "--router-address", "nohost"], "HOST:PORT")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert said in capsys.readouterr().err


def test_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} .*in use"):
            check_port("127.0.0.1", port)
    with pytest.raises(ValueError, match="port must be"):
        check_port("127.0.0.1", 70000)


def _remote_worker(role: str, port: int, model) -> None:
    """A worker started apart from the router (what `serve --role prefill` runs), dialing in."""
    run_remote(role, ("127.0.0.1", port), {"model": model, "tokenizer": None,
                                           "config": EngineConfig(num_blocks=64), "threads": 1},
               b"test")


def test_remote_workers_and_a_killed_prefill_worker_fails_new_requests_only(model):
    ctx, procs = torch.multiprocessing.get_context("spawn"), []

    def launch(address):
        for role in ("decode", "prefill"):
            procs.append(ctx.Process(target=_remote_worker, args=(role, address[1], model),
                                     daemon=True))
            procs[-1].start()
    engine = DisaggregatedEngine(model, None, EngineConfig(num_blocks=64), listen=("127.0.0.1", 0),
                                 authkey=b"test", on_listen=launch)
    try:
        assert sorted(engine.pids.values()) == sorted(p.pid for p in procs)
        long = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400,
                                                             ignore_eos=True))
        outs, deadline = {}, time.monotonic() + 60
        while long not in engine.transfers and time.monotonic() < deadline:   # then it decodes
            outs.update({o.request_id: o for o in engine.step()})
        os.kill(engine.pids["prefill"], signal.SIGKILL)
        late = engine.add_request(PROMPTS[1], GREEDY)
        outs.update(_drive(engine, [long, late]))
        assert outs[long].finish_reason == "length" and len(outs[long].token_ids) == 400
        assert outs[late].finish_reason == "abort"
        assert outs[late].error.startswith("worker unavailable") and "prefill worker" in outs[late].error
        assert "prefill worker" in engine.dead                 # what the server's /health reads
    finally:
        engine.shutdown()
        for p in procs:
            p.join(10)
    assert not any(p.is_alive() for p in procs)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_http_streams_the_single_engines_text_and_a_dead_decoder_is_a_503(tok, monkeypatch):
    from minillm.engine import structured
    real, on_loop = structured._grammar_text, []

    def watched(name, text):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(name, text)
    monkeypatch.setattr(structured, "_grammar_text", watched)
    torch.manual_seed(0)
    m = tiny_model(vocab_size=len(tok))
    prompt = "The capital of France is"
    want = LLMEngine(m, EngineConfig(num_blocks=64), tokenizer=tok).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with running(m, tok, num_blocks=64, max_num_batched_tokens=256, graceful_s=0.5) as srv:
        pids = srv.pids
        url = srv.base_url + "/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            chunks = _sse(r)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == want
        choice = [f"yes-{os.getpid()}", "no"]                     # new: not in the grammar cache
        r = httpx.post(url, json={**body, "guided_choice": choice}, timeout=60)
        assert r.json()["choices"][0]["text"] in choice and on_loop == [False], (r.text, on_loop)
        assert_settled(srv.url)                      # 0 running, 0 waiting, 0 decode blocks in use
        for extra, param in (({"n": 2}, "n"), ({"best_of": 2}, "best_of"), ({"priority": 1}, "priority"),
                             ({"echo": True, "logprobs": 1}, "echo"),
                             ({"prompt_logprobs": 1}, "prompt_logprobs")):
            r = httpx.post(url, json={**body, **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        with httpx.stream("POST", url, json={**body, "max_tokens": 500, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))        # decoding now
            os.kill(pids["decode"], signal.SIGKILL)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["error"]["code"] == "worker_unavailable"
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "worker_unavailable" and "decode worker" in err["message"]
        health = httpx.get(srv.url + "/health", timeout=60)
        assert health.status_code == 503 and "decode worker" in health.text, health.text
    assert not any(alive(pid) for pid in pids.values())
