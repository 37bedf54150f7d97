"""`python -m benchmarks lockout` on a tiny model: the record's shape, and the step counts it
exists to show (machine-independent: a short request waits for the long prefill only when the
partial-prefill knobs are off)."""
import json

import pytest

from benchmarks import lockout
from minillm import tiny_model
from minillm.model.loading import load_tokenizer


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    tok = load_tokenizer()
    model = tiny_model(vocab_size=len(tok), seed=0, max_seq_len=4096)
    out = tmp_path_factory.mktemp("results")
    return lockout.run(quick=True, device="cpu", out_dir=str(out), long_tokens=2048,
                       model=model, tokenizer=tok, rounds=2)


def test_lockout_record_is_written_with_machine_and_units(record):
    saved = json.loads(open(record["path"]).read())
    assert saved["benchmark"] == "lockout" and "machine" in saved and "units" in saved
    assert set(saved["configs"]) == set(lockout.CONFIGS)
    for r in saved["configs"].values():
        assert len(r["rounds"]) == saved["rounds"] == 2
        assert len(r["short_ttft_steps"]) == len(r["rounds"][0]["short"]) == len(lockout.ARRIVE_AT)
        assert r["rounds"][0]["long"]["prompt_tokens"] == 2048
    assert "short requests behind a 2048-token prompt" in lockout.report(record)


def test_without_the_knobs_short_requests_wait_for_the_long_prefill(record):
    off, on = (record["configs"][k]["rounds"][0] for k in ("off", "server"))
    chunks = -(-2048 // 256)                              # the long prefill's steps, knobs off
    assert off["long"]["ttft_steps"] == chunks
    for s in off["short"]:                                # admitted only once the long one is done
        assert s["arrival_step"] + s["ttft_steps"] == chunks + 1
    assert max(s["ttft_steps"] for s in off["short"]) >= 4
    for name in ("threshold_128", "server"):
        assert record["configs"][name]["short_ttft_steps"] == [1] * 4, name
    assert on["long"]["ttft_steps"] == -(-2048 // 384)    # the server's chunk cap
