"""`python -m minillm serve` as a reader starts it: it answers the openai client, binds loopback by
default, and SIGINT / SIGTERM stop it cleanly (exit 0, the port free again) even mid-stream. It
binds before it loads anything, so a port in use is one line and a non-zero exit, no traceback
and no model load."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import minillm


def test_a_port_in_use_is_one_line_and_no_model_load(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "MINILLM_CACHE": str(tmp_path)}       # a load would have to convert
        out = subprocess.run([sys.executable, "-m", "minillm", "serve", "--port", str(port)],
                             capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"minillm serve: cannot listen on 127.0.0.1:{port}: "
                                               f"Address already in use"], out.stderr
    assert out.stdout == "" and not any(tmp_path.iterdir())    # nothing loaded, nothing cached


@pytest.mark.slow
def test_dummy_weights_serve_the_smollm2_shape():
    from minillm.serve.cli import build_llm, parser
    llm = build_llm(parser().parse_args(["--load-format", "dummy", "--device", "cpu",
                                         "--max-num-seqs", "2"]))
    assert llm.model.config == minillm.get_config("smollm2-135m")
    assert llm.model_name == "smollm2-135m"
    out = llm.generate([[1, 2, 3]], minillm.SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def _launch(*flags):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", "0",
                             "--max-num-seqs", "4", "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _ready(proc) -> str:
    """The URL once the server answers /health (it prints "serving on URL" when bound)."""
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("serving on "):
            url = line.split()[-1]
            break
        assert time.monotonic() < deadline, "the server did not start"
    else:
        raise AssertionError(f"the server exited: {proc.wait()}")
    while time.monotonic() < deadline:              # the socket is bound; wait for the app
        try:
            if httpx.get(url[:-3] + "/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("no /health")


SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.fixture(scope="module")
def servers():
    """One server per signal, both started at once (their imports and model loads overlap), each
    stopped by its own test. A 1 s grace: the stream below is still mid-way when the drain ends it
    (the default 5 s only waits longer). Nothing is left running after the module."""
    procs = {sig: _launch("--api-key", "k", "--graceful-shutdown-s", "1") for sig in SIGNALS}
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
            proc.stdout.close()
        assert all(proc.poll() is not None for proc in procs.values())


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_the_cli_serves_the_openai_client_and_stops_cleanly_on_a_signal(servers, sig):
    proc = servers[sig]
    try:
        url = _ready(proc)
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.completion_tokens >= 1
        stream = client.chat.completions.create(model="smollm2-135m", max_tokens=500, stream=True,
                                                extra_body={"ignore_eos": True},
                                                messages=[{"role": "user", "content": "Count."}])
        next(iter(stream))                              # a stream in flight
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(ConnectionRefusedError):         # nobody listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with socket.socket() as s:                          # and a new server may bind it at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_engine_flags_reach_the_engine_config():
    from minillm.engine.config import EngineConfig
    from minillm.serve.cli import engine_options, parser
    args = parser().parse_args(["--attention-backend", "flash_decoding", "--max-num-seqs", "3",
                                "--kv-cache-dtype", "int8"])
    opts = engine_options(args)
    assert opts["attention_backend"] == "flash_decoding" and opts["max_num_seqs"] == 3
    assert EngineConfig(**opts).attention_backend == "flash_decoding"
    bad = engine_options(parser().parse_args(["--attention-backend", "fast"]))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(**bad)
    args = parser().parse_args(["--compilation-config", '{"compile_sizes": [1, 2, 4]}'])
    assert EngineConfig(**engine_options(args)).compilation_config.compile_sizes == (1, 2, 4)
    bad = engine_options(parser().parse_args(["--compilation-config", '{"compile_sizes": [4, 2]}']))
    with pytest.raises(ValueError, match="compilation_config.compile_sizes must be strictly"):
        EngineConfig(**bad)


def test_allowed_origins_take_vllms_json_list_or_commas():
    from minillm.serve.cli import parser
    assert parser().parse_args([]).allowed_origins is None             # CORS off by default
    args = parser().parse_args(["--allowed-origins", '["http://a.example", "http://b.example"]'])
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    args = parser().parse_args(["--allowed-origins", "http://a.example, http://b.example"])
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    with pytest.raises(SystemExit):
        parser().parse_args(["--allowed-origins", '["http://a.example", 3]'])


def test_a_missing_heads_file_is_one_line_naming_the_flag(capsys):
    from minillm.serve import cli
    spec = '{"method": "medusa", "num_speculative_tokens": 3, "model": "/nonexistent/heads.pt"}'
    with pytest.raises(SystemExit) as info:
        cli.main(["--speculative-config", spec, "--load-format", "dummy", "--device", "cpu",
                  "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-config" in err and "/nonexistent/heads.pt" in err, err


def _budget_moves(llm, finished_per_s: float, seconds: float = 40.0) -> int:
    """Drive the engine's SLO controller on a clock: TPOT samples far over target arrive at
    `finished_per_s`, decisions are ticked every 0.1 s; how many times the budget went down."""
    ctl, t, due = llm.llm_engine.controller, 0.0, 0.0
    while t < seconds:
        if t >= due:
            ctl.record("tpot", t, 1.0)
            due += 1 / finished_per_s
        ctl.tick(t)
        t = round(t + 0.1, 1)
    return ctl.num_adjustments["down"]


def test_the_slo_controller_says_at_startup_what_load_its_interval_needs(tok):
    """The startup line's threshold is the controller's: below it the controller never moves
    (the review's case: 0.5 s on a slow CPU), above it it does."""
    from minillm.serve.cli import slo_notice
    from serve_tiny import tiny_llm
    line = slo_notice(tiny_llm(tok, slo_tpot_p95_ms=1, slo_interval_s=0.5).llm_engine)
    assert "every 0.5 s" in line and "--slo-interval-s must exceed 0.8 / R s" in line, line
    need = float(line.rsplit("R >= ", 1)[1].rstrip(")"))
    assert need == 1.6
    assert _budget_moves(tiny_llm(tok, slo_tpot_p95_ms=1, slo_interval_s=0.5), 0.8 * need) == 0
    assert _budget_moves(tiny_llm(tok, slo_tpot_p95_ms=1, slo_interval_s=0.5), 1.25 * need) > 0
    assert _budget_moves(tiny_llm(tok, slo_tpot_p95_ms=1, slo_interval_s=2.0), 0.8 * need) > 0
    assert slo_notice(tiny_llm(tok).llm_engine) is None                # no targets: no controller


def test_logprobs_mode_is_a_flag_and_a_bad_one_is_one_line(capsys):
    """--logprobs-mode reaches EngineConfig (vLLM's default raw_logprobs without it); a bad value
    is refused before any weights load, one line naming logprobs_mode, exit status 2."""
    from minillm.engine.config import EngineConfig
    from minillm.serve.cli import engine_options, main, parser
    opts = engine_options(parser().parse_args(["--logprobs-mode", "processed_logprobs"]))
    assert EngineConfig(**opts).logprobs_mode == "processed_logprobs"
    assert EngineConfig(**engine_options(parser().parse_args([]))).logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit) as info:
        main(["--logprobs-mode", "raw", "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "logprobs_mode" in err[-1] and "raw_logprobs" in err[-1] and "Traceback" not in "".join(err)
