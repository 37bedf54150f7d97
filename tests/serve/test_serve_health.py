"""`/health` says whether the engine can still step, as a load balancer needs it (vLLM answers 503
on a dead engine): a tiny model served with tensor_parallel_size=2 answers 200, then its worker
is killed; whether the death is met by a running stream's step or found by the probe while
idle, /health answers 503, every later request gets a 503 "engine_dead" at once, and the death
is logged once (not a traceback per request). The disaggregated router's lost worker is in
test_disaggregated.py.
"""
import json
import logging
import os
import signal
import time

import httpx
import pytest

from minillm.serve import running
from procs import alive
from serve_tiny import MODEL, completion, tiny_llm


def _health(srv, want: int, timeout_s: float = 30.0) -> httpx.Response:
    """/health once it answers `want` (a killed process takes a moment to be reaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(srv.url + "/health", timeout=30)
        if r.status_code == want or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


@pytest.mark.parametrize("met_by", ["a stream", "the probe"])
def test_a_dead_tensor_parallel_worker_makes_health_503_and_is_logged_once(tok, caplog, met_by):
    llm = tiny_llm(tok, tensor_parallel_size=2)
    pids = llm.llm_engine.runner.pids
    try:
        with running(llm, served_model_name=MODEL) as srv:
            url = srv.base_url + "/completions"
            assert httpx.get(srv.url + "/health", timeout=30).text == "ok"
            assert httpx.post(url, json=completion(), timeout=60).status_code == 200
            with caplog.at_level(logging.ERROR, logger="minillm.serve"):
                if met_by == "a stream":               # the step fails: the stream's error event
                    body = completion(max_tokens=400, ignore_eos=True, stream=True)
                    with httpx.stream("POST", url, json=body, timeout=60) as r:
                        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
                        next(lines)
                        os.kill(pids[0], signal.SIGKILL)
                        last = json.loads(list(lines)[-1][6:])
                    assert last["error"]["code"] == "engine_error" and "WorkerDied" in str(last)
                else:
                    os.kill(pids[0], signal.SIGKILL)
                r = _health(srv, 503)
                assert r.status_code == 503 and "rank 1" in r.text, r.text
                for _ in range(2):
                    r = httpx.post(url, json=completion(), timeout=60)
                    assert r.status_code == 503, r.text
                    assert r.json()["error"]["code"] == "engine_dead"
            said = [rec for rec in caplog.records if rec.name == "minillm.serve"]
            assert len(said) == 1 and "dead" in said[0].getMessage(), [r.getMessage() for r in said]
            assert said[0].exc_info is None                      # a line, not a traceback
    finally:
        llm.shutdown()
    assert not any(alive(pid) for pid in pids)
