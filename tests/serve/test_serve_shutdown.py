"""SIGTERM with streams running: uvicorn stops accepting, and the streams still running when the
grace time is nearly up end with an error event and `data: [DONE]` (not a cut connection), the
process exits 0 and logs no traceback. A tiny random model in a subprocess (`serve()` installs
the signal handlers), so the streams are long and the test is quick."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_tiny import tokenizer

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from minillm.serve.app import build_app
from minillm.serve.server import serve
from serve_tiny import tiny_llm, tokenizer
llm = tiny_llm(tokenizer(), max_seq_len=8192, num_blocks=2048)
serve(build_app(llm.llm_engine, "tiny"), "127.0.0.1", 0, graceful_s=2.0, log_level="info")
"""


def _start():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parents[1]))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("serving on "):
        proc.kill()
        raise AssertionError(f"the server did not start: {line!r} {proc.stderr.read()}")
    url = line.split()[-1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url[:-3] + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("no /health")


def test_sigterm_ends_running_streams_with_an_error_event_and_done():
    tokenizer()                                          # skips without SmolLM2's tokenizer
    proc, url = _start()
    streams = [[] for _ in range(4)]
    errors = []

    def one(lines, kind):
        path, body = ("/completions", {"prompt": "Count:"}) if kind else \
            ("/chat/completions", {"messages": [{"role": "user", "content": "Count."}]})
        body.update(model="tiny", max_tokens=6000, ignore_eos=True, stream=True, temperature=0)
        try:
            with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
        except Exception as err:                         # a cut stream: the failure checked
            errors.append(repr(err))
    threads = [threading.Thread(target=one, args=(s, i % 2)) for i, s in enumerate(streams)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(map(len, streams)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stderr.read()
    assert errors == [] and rc == 0, (errors, log)
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
        assert len(lines) > 5                           # they ran a while before the signal
    for bad in ("Traceback", "CancelledError", "Cancel ", "ERROR"):
        assert bad not in log, log
    with pytest.raises(httpx.TransportError):           # nobody listens any more
        httpx.get(url[:-3] + "/health", timeout=5)
