"""The HTTP load generator (minillm.lab: loadgen, serve_client, serve_metrics, datasets; and
benchmarks.serve, serve_compare): metrics against numpy on hand-made timings, the arrival process
statistically, SSE parsing and ITL recording against a stub server,
max-concurrency, failures counted, and clear errors for bad arguments."""
import asyncio
import json
import math

import numpy as np
import pytest

from benchmarks.serve import main as serve_main
from minillm.lab.datasets import chapter_prompts, humaneval_prompts, load_prompts
from minillm.lab.loadgen import benchmark
from minillm.lab.serve_client import SSEParser, arrival_times, run_load
from minillm.lab.serve_metrics import RequestResult, parse_goodput, summarize
from serve_stub import CHUNKS, USAGE, running_stub


def _hand_made():
    # (ttft, itl gaps, output tokens); e2e = ttft + sum(gaps)
    rows = [(0.10, [0.02, 0.03, 0.05], 4), (0.30, [0.01] * 9, 10), (0.05, [], 1),
            (1.20, [0.2, 0.1], 3), (0.40, [0.04] * 5, 6)]
    results = [RequestResult(ok=True, ttft=t, itl=list(g), e2e=t + sum(g), prompt_tokens=10 + i,
                             output_tokens=n) for i, (t, g, n) in enumerate(rows)]
    results.append(RequestResult(ok=False, error="RuntimeError: HTTP 500"))
    return rows, results


def test_summary_matches_numpy_on_hand_made_timings():
    rows, results = _hand_made()
    s = summarize(results, duration_s=2.0, goodput={"ttft": 500, "tpot": 30})
    ttft = np.array([r[0] for r in rows]) * 1e3
    e2e = np.array([r[0] + sum(r[1]) for r in rows]) * 1e3
    tpot = np.array([sum(g) / (n - 1) for _, g, n in rows if n >= 2]) * 1e3
    itl = np.array([x for _, g, _ in rows for x in g]) * 1e3
    for key, ref in (("ttft_ms", ttft), ("e2e_ms", e2e), ("tpot_ms", tpot), ("itl_ms", itl)):
        assert s[key]["mean"] == pytest.approx(ref.mean())
        for stat, q in (("median", 50), ("p95", 95), ("p99", 99)):
            assert s[key][stat] == pytest.approx(np.percentile(ref, q)), (key, stat)
    assert (s["completed"], s["failed"]) == (5, 1)
    assert s["request_throughput"] == pytest.approx(5 / 2.0)
    assert s["output_throughput"] == pytest.approx(sum(r[2] for r in rows) / 2.0)
    assert s["total_token_throughput"] == pytest.approx((sum(r[2] for r in rows) + 10 * 5 + 10) / 2.0)
    # by hand: TPOT ms are 33.3, 10, (none), 150, 40; TTFT <= 500 leaves rows 0, 1, 2, 4; TPOT <= 30
    # then rejects rows 0 and 4; row 2 has one token and no TPOT to judge: goodput = 2 requests / 2 s
    assert s["goodput"] == pytest.approx(2 / 2.0)


def test_goodput_targets_parse_and_reject():
    assert parse_goodput(["ttft:500", "e2e:2000"]) == {"ttft": 500.0, "e2e": 2000.0}
    assert parse_goodput("tpot:50") == {"tpot": 50.0}
    for bad in (["ttft"], ["latency:5"], ["ttft:abc"], ["ttft:-1"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_gamma_cv(burstiness):
    rate, n = 5.0, 20000
    t = np.array(arrival_times(n, rate, burstiness, seed=3))
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    # the mean of 20k gamma gaps has a relative standard error of cv/sqrt(n) <= 1.5%: 6 sigma
    cv = 1 / math.sqrt(burstiness)
    assert gaps.mean() == pytest.approx(1 / rate, rel=6 * cv / math.sqrt(n))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert arrival_times(50, rate, burstiness, seed=3) == list(t[:50])          # seeded
    assert arrival_times(50, rate, burstiness, seed=4) != list(t[:50])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, math.inf) == [0.0] * 7


def test_sse_parser_joins_data_lines_and_skips_comments():
    p, got = SSEParser(), []
    for line in [": keep-alive", "", "data: a", "data:b", "event: x", "", "data: [DONE]"]:
        got.append(p.feed(line))
    assert [g for g in got if g is not None] == ["a\nb"]
    assert p.flush() == "[DONE]" and p.flush() is None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_text_itl_and_usage_from_stub(endpoint):
    with running_stub() as (stub, url):
        run = benchmark(url, "stub", dataset="chapters", num_prompts=3, endpoint=endpoint,
                        max_tokens=16, ignore_eos=True)
    assert run.summary["failed"] == 0
    for r in run.results:
        assert r.text == "".join(CHUNKS)                    # the split "\u00e9" arrives whole
        assert len(r.itl) == len(CHUNKS) - 1                 # one gap between consecutive text chunks
        assert all(g >= 0 for g in r.itl) and r.ttft > 0
        assert r.e2e >= r.ttft + sum(r.itl) - 1e-9
        assert (r.output_tokens, r.prompt_tokens) == (USAGE["completion_tokens"], USAGE["prompt_tokens"])
    body = stub.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["model"] == "stub"
    assert ("messages" in body) == (endpoint == "chat")


def test_max_concurrency_is_honoured():
    with running_stub(delay_s=0.02) as (stub, url):
        run = benchmark(url, "stub", num_prompts=8, max_concurrency=2)
    assert run.summary["completed"] == 8
    assert stub.peak == 2


def test_a_failing_request_is_counted_not_fatal():
    prompts = ["hi", "FAIL", "BREAK", "there"]
    with running_stub() as (_, url):
        results, duration = asyncio.run(run_load(url, "stub", prompts, max_tokens=8))
        bad = asyncio.run(run_load("http://127.0.0.1:9/v1", "stub", ["x"], max_tokens=8, timeout_s=5))
    assert [r.ok for r in results] == [True, False, True, True]
    assert "HTTP 500" in results[1].error
    assert results[2].text == CHUNKS[0] and results[2].output_tokens == 1   # no usage: chunks counted
    assert not bad[0][0].ok and bad[0][0].error
    s = summarize(results, duration)
    assert (s["completed"], s["failed"]) == (3, 1)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(3, 0)
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(3, -1.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(run_load("http://127.0.0.1:9/v1", "m", ["x"], max_concurrency=0))
    with pytest.raises(ValueError, match="endpoint"):
        asyncio.run(run_load("http://127.0.0.1:9/v1", "m", ["x"], endpoint="embeddings"))
    with pytest.raises(ValueError, match="dataset"):
        load_prompts("sharegpt", 4)
    with pytest.raises(SystemExit, match="max_concurrency"):
        serve_main(["--model", "m", "--max-concurrency", "0", "--no-record"])
    with pytest.raises(SystemExit):
        serve_main(["--model", "m", "--request-rate", "0"])


def test_datasets_ship_in_packages():
    he = humaneval_prompts()
    assert len(he) == 164 and he[0].startswith("from typing import List")
    assert len(set(chapter_prompts())) == len(chapter_prompts()) >= 10
    a = load_prompts("humaneval", 200, seed=1)
    assert len(a) == 200 and set(a) == set(he) and a == load_prompts("humaneval", 200, seed=1)
    assert load_prompts("humaneval", 5, seed=2) != a[:5]


def test_cli_writes_a_strict_json_record_and_figure(tmp_path, capsys):
    from benchmarks.__main__ import main as bench_main
    from minillm.viz.plotting import use_headless_backend
    use_headless_backend()
    with running_stub() as (_, url):
        bench_main(["serve", "--base-url", url, "--model", "stub", "--num-prompts", "3",
                    "--request-rate", "50", "--goodput", "ttft:10000", "--label", "stub server",
                    "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Output token throughput" in out and "Request goodput" in out
    record = json.loads((tmp_path / "serve_stub-server_cpu.json").read_text(),
                        parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert record["label"] == "stub server" and record["summary"]["completed"] == 3
    assert record["config"]["request_rate"] == 50 and "machine" in record
    assert (tmp_path / "serve_stub-server_cpu.png").is_file()


_HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_waits_for_health_and_frees_the_port(tmp_path):
    import socket
    import sys
    from benchmarks.server_process import free_port, server_process
    port = free_port()
    argv = [sys.executable, "-c", _HEALTH_SERVER, str(port)]
    with server_process(argv, f"http://127.0.0.1:{port}/health", tmp_path / "log", timeout_s=30) as (proc, _):
        assert proc.poll() is None
    assert proc.poll() is not None                                      # stopped
    with socket.socket() as s:          # the port is free again (REUSEADDR: TIME_WAIT is no listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        with server_process([sys.executable, "-c", "raise SystemExit(3)"], "http://127.0.0.1:9/health",
                            tmp_path / "log2", timeout_s=30):
            pass


def test_compare_targets_from_hand_made_runs():
    from benchmarks.serve_compare import server_command, targets
    def s(tok_s, ttft_p99):
        return {"summary": {"output_throughput": tok_s, "ttft_ms": {"p99": ttft_p99}}}
    sweeps = {"minillm": {"runs": [s(120, 900), s(30, 100), s(60, 200)]},
              "transformers": {"runs": [s(60, 1500), s(30, 150), s(55, 400)]}}
    t = targets(sweeps, (0.25, 0.5))
    assert t["output_tok_s_ratio_at_saturation"] == pytest.approx(2.0) and t["output_tok_s_ratio_met"]
    assert t["ttft_p99_ms_at_half_saturation"] == {"minillm": 200, "transformers": 400} and t["ttft_p99_met"]
    with pytest.raises(ValueError, match="server must be one of"):
        server_command("vllm", 1, "cpu", None)


def test_save_hf_folder_round_trips_through_transformers(tmp_path):
    import torch
    from transformers import LlamaForCausalLM
    from benchmarks.hf_folder import save_hf_folder
    from minillm.model.loading import tiny_model
    model = tiny_model(vocab_size=128, seed=5)
    folder = save_hf_folder(tmp_path / "hf", model=model)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits[0]                                              # (T, V)
        got = model(ids, torch.arange(12))                                    # (B, T, V)
    torch.testing.assert_close(got.reshape(12, 128), want, rtol=1e-4, atol=1e-4)


def test_sweep_offers_fractions_of_the_saturation_rate():
    from minillm.lab.loadgen import sweep, sweep_table
    with running_stub(delay_s=0.002) as (_, url):
        rows = sweep(url, "stub", fractions=(1.0, 0.5), num_prompts=4, max_tokens=8)
    sat = rows[-1]["summary"]["request_throughput"]
    assert math.isinf(rows[-1]["offered_rate"])
    assert [r["offered_rate"] for r in rows[:-1]] == pytest.approx([0.5 * sat, sat])
    assert all(r["summary"]["completed"] == 4 for r in rows)
    assert len(sweep_table(rows).splitlines()) == 4
    with pytest.raises(ValueError, match="fractions"):
        sweep(url, "stub", fractions=(0,))


def test_server_children_inherit_the_thread_policy(monkeypatch):
    import torch
    from benchmarks.server_process import child_env
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    env = child_env()
    assert env["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    assert env["MKL_NUM_THREADS"] == "3"                   # a setting already there is kept
