"""Tuning never blocks a user, and a table timed under noise never sticks (minillm.kernels).

A first start with no table takes a quick probe (or, on a busy machine, the untimed prior) and
says so in one line; "busy" is other work now, never the lagging load average. The full tuning
runs only when asked (and not at all on a machine already busy), records the other work measured
while it timed, and one that turned busy or unsettled is saved marked and not used. Bad cache
input (corrupt, foreign, malformed, an unwritable folder) is one line, never a traceback, never a
wrong result. The CPU counters, the route timings and the clock are faked (tests/fake_load.py):
no assertion here depends on how fast anything ran.
"""
import io
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import minillm
from minillm.kernels import cpu_tuning as ct
from minillm.kernels import tuning_cache as tc
from fake_load import fake_load

PRIOR = {"layout": "out_in", "routes": {b: "F.linear" for b in ct.BUCKETS}}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(ct, "_QUICK", {})
    fake_load(monkeypatch, others=0.2, cores=64)                # quiet, whatever the threads
    monkeypatch.setattr(ct, "UNSETTLED_OK", 1.0)
    monkeypatch.setattr(ct, "prior_plan", lambda threads: (PRIOR, "the prior (F.linear here)"))


def _ids():
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def _agrees_with_plain(model):
    """The accelerated model's logits equal the reference's (routes differ in the last bits)."""
    ref = minillm.tiny_model()
    with torch.inference_mode():
        torch.testing.assert_close(model(_ids()), ref(_ids()), atol=1e-5, rtol=1e-5)


def _fake_race(one_row_ms: dict, unsettled=()):
    calls = []

    def race(weights, rows, rounds, candidates, max_rounds=None, tol=0.1):
        calls.append(rows)
        return {r: {1: ms} for r, ms in one_row_ms.items() if r in candidates}, set(unsettled)
    return race, calls


def test_a_first_start_probes_one_row_says_so_once_and_saves_nothing(tmp_path, monkeypatch, caplog):
    race, calls = _fake_race({"F.linear": 10.0, "x@W": 5.0, "ksplit": 4.0})
    monkeypatch.setattr(ct, "race", race)
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)
    assert type(model).__name__ == "FlatTransformer" and calls and all(r == [1] for r in calls)
    for plan in model.linear_plan.values():                    # ksplit at one row, F.linear above
        assert plan["layout"] == "in_out" and plan["routes"][1] == "ksplit"
        assert {r for b, r in plan["routes"].items() if b > 1} == {"F.linear"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no tuned table yet" in lines[0] and "ksplit" in lines[0]
    assert "python -m minillm.kernels" in lines[0]
    assert not list(tmp_path.rglob("*.json"))                   # a probe is never cached on disk
    _agrees_with_plain(model)
    n = len(calls)
    again = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)   # same process: no new probe
    assert len(calls) == n and len(caplog.records) == 1
    assert again.linear_plan == model.linear_plan


def test_a_probe_whose_winner_never_settled_keeps_f_linear(tmp_path, monkeypatch):
    race, _ = _fake_race({"F.linear": 10.0, "ksplit": 4.0}, unsettled=[("ksplit", 1)])
    monkeypatch.setattr(ct, "race", race)
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)
    assert all(set(p["routes"].values()) == {"F.linear"} for p in model.linear_plan.values())


def test_a_busy_machine_times_nothing_at_first_start_and_takes_the_prior(tmp_path, monkeypatch, caplog):
    fake_load(monkeypatch, others=1.9, cores=2)
    prior = {"layout": "in_out", "routes": {b: "x@W" for b in ct.BUCKETS}}
    monkeypatch.setattr(ct, "prior_plan", lambda threads: (prior, "the routes that won on CPUs like this"))
    monkeypatch.setattr(ct, "race", lambda *a, **k: pytest.fail("timed on a busy machine"))
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)
    assert all(p == prior for p in model.linear_plan.values())       # the prior, not F.linear
    line = caplog.records[0].getMessage()
    assert len(caplog.records) == 1 and "other work used 1.90 of 2 cores" in line
    assert "won on CPUs like this" in line
    _agrees_with_plain(model)


def test_the_busy_rule_ignores_a_process_that_just_finished(tmp_path, monkeypatch):
    """The 1-minute load average still counts a build (or the last chapter) that ended a few
    seconds ago; the counters over the last moment do not. A first start then probes."""
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 3.0, 1.0))   # high: work that has ended
    fake_load(monkeypatch, others=0.05, cores=2)                     # nothing runs now
    race, calls = _fake_race({"F.linear": 10.0, "x@W": 5.0})
    monkeypatch.setattr(ct, "race", race)
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)
    assert calls and all(p["routes"][1] == "x@W" for p in model.linear_plan.values())
    assert model.linear_plan_source.startswith("quick: no tuned table yet; a ")


def test_a_quiet_full_tuning_records_its_load_and_is_used(tmp_path, monkeypatch):
    fake_load(monkeypatch, others=1.4, cores=64)
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path, tune=True)
    data = json.loads(ct.cache_path(tmp_path).read_text())
    assert data["busy"] is None and data["load"]["others"] == 1.4 and data["load"]["cores"] == 64
    assert model.linear_plan_source == "tuned"
    assert ct.read_table(model, tmp_path)[0] is not None
    _agrees_with_plain(model)


def test_a_machine_busy_before_a_full_tuning_times_nothing(tmp_path, monkeypatch, caplog):
    """Its table would be saved marked busy and never used: minutes for nothing. A quiet table
    already cached stays (retune included), and the first quiet tuning times everything."""
    load = fake_load(monkeypatch, others=2.0, cores=2)       # + a timing thread > 2 cores + slack
    monkeypatch.setattr(ct, "_time_shape", lambda *a, **k: pytest.fail("timed on a busy machine"))
    monkeypatch.setattr(ct, "race", lambda *a, **k: pytest.fail("timed on a busy machine"))
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    for retune in (False, True):
        model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path, tune=True, retune=retune)
        assert not list(tmp_path.rglob("*.json"))                 # nothing timed, nothing saved
        assert all(set(p["routes"].values()) == {"F.linear"} for p in model.linear_plan.values())
        _agrees_with_plain(model)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("not timing" in line and "other work used 2.00 of 2 cores" in line for line in lines) == 2
    table = {"F.linear": {str(b): 9.0 for b in ct.BUCKETS}, "x@W": {str(b): 1.0 for b in ct.BUCKETS}}
    load["others"] = 0.2
    monkeypatch.setattr(ct, "_time_shape", lambda *a, **k: (table, 0, 4))
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path, tune=True)
    assert model.linear_plan_source == "tuned"
    load["others"] = 2.0
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path, retune=True)   # kept, not overwritten
    assert model.linear_plan_source == "tuned"
    assert json.loads(ct.cache_path(tmp_path).read_text())["busy"] is None


@pytest.mark.parametrize("load,cores,bad,reason", [(1.8, 2, 0, "other work used 1.80 of 2 cores"),
                                                   (0.1, 64, 3, "12 of 16 winning times never settled")])
def test_a_noisy_full_tuning_is_saved_marked_and_not_used(tmp_path, monkeypatch, caplog, load, cores,
                                                          bad, reason):
    now = fake_load(monkeypatch, others=0.1, cores=cores)     # busy only once the timing has begun
    monkeypatch.setattr(ct, "UNSETTLED_OK", 0.25)
    table = {"F.linear": {str(b): 9.0 for b in ct.BUCKETS}, "x@W": {str(b): 1.0 for b in ct.BUCKETS}}

    def timed_under_load(*a, **k):
        now["others"] = load
        return table, bad, 4
    monkeypatch.setattr(ct, "_time_shape", timed_under_load)
    monkeypatch.setattr(ct, "race", lambda *a, **k: ({"F.linear": {1: 1.0}}, set()))
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path, tune=True)
    data = json.loads(ct.cache_path(tmp_path).read_text())
    assert reason in data["busy"] and data["load"]["others"] == load
    assert model.linear_plan_source.startswith("quick: the tuned table was timed on a busy machine")
    assert all(p["routes"][2] == "F.linear" for p in model.linear_plan.values())   # not x@W
    assert any("busy" in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)
    timed = []
    monkeypatch.setattr(ct, "_time_shape", lambda *a, **k: timed.append(1) or (table, 0, 4))
    fake_load(monkeypatch, others=0.1, cores=64)
    ct.tune(model, cache_dir=tmp_path)                       # the next tuning times it all again
    assert len(timed) == len(ct.linears(model))
    assert json.loads(ct.cache_path(tmp_path).read_text())["busy"] is None


@pytest.mark.parametrize("content,why", [
    ("{not json", "unreadable"),
    ('{"key": {"cpu": "another CPU"}, "shapes": {}}', "another machine"),
    ("KEY_WITH_BAD_SHAPES", "malformed"),
])
def test_a_bad_cache_file_is_one_line_and_a_right_answer(tmp_path, monkeypatch, caplog, content, why):
    monkeypatch.setattr(ct, "race", lambda *a, **k: ({"F.linear": {1: 1.0}}, set()))
    path = ct.cache_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "KEY_WITH_BAD_SHAPES":
        content = json.dumps({"key": ct.cache_key(), "shapes": {"64x64x2": {"x@W": "fast"}}})
    path.write_text(content)
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    _agrees_with_plain(model)


def test_an_unwritable_cache_folder_is_one_line_and_the_table_lives_in_memory(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    folder = blocker / "kernels"                              # mkdir fails under a file
    model = ct.accelerate(minillm.tiny_model(), cache_dir=folder, tune=True, retune=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cannot write the tuning cache" in lines[0]
    assert model.linear_plan_source == "tuned"                # this process's copy
    _agrees_with_plain(model)
    tc._MEMORY.pop(ct.cache_path(folder), None)


def test_a_notice_prints_only_to_a_terminal_nobody_logs_for(monkeypatch):
    class Term(io.StringIO):
        def isatty(self):
            return True
    for stream, shown in ((Term(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.setattr(tc.log, "hasHandlers", lambda: False)
        tc.notice("one line")
        assert (stream.getvalue() == "minillm: one line\n") is shown


def test_the_front_door_accelerates_and_the_loader_does_not(tmp_path, monkeypatch):
    from minillm.model import loading
    from minillm.model.hf_convert import to_hf_model
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ct, "race", lambda *a, **k: ({"F.linear": {1: 1.0}}, set()))
    to_hf_model(minillm.tiny_model(vocab_size=64)).save_pretrained(tmp_path / "m")
    ref, _ = loading.load_model(tmp_path / "m", device="cpu")
    assert type(ref) is minillm.Transformer
    assert {type(m) for m in ref.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    fast, _ = minillm.load_model(tmp_path / "m", device="cpu")
    assert type(fast).__name__ == "FlatTransformer"
    plain, _ = minillm.load_model(tmp_path / "m", device="cpu", kernels="plain")
    assert type(plain) is minillm.Transformer
    with pytest.raises(ValueError, match="kernels must be"):
        minillm.load_model(tmp_path / "m", kernels="fastest")


@pytest.mark.parametrize("module", ["minillm.kernels", "minillm.kernels.cpu_tuning"])
def test_the_tuning_command_answers_help(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--retune" in out.stdout, out.stderr


def test_the_probe_stops_at_its_time_budget(tmp_path, monkeypatch, caplog):
    now = [0.0]
    race, calls = _fake_race({"F.linear": 10.0, "ksplit": 4.0})

    def slow_race(*a, **k):
        now[0] += 3.0                                          # each weight shape: 3 s
        return race(*a, **k)
    monkeypatch.setattr(ct, "race", slow_race)
    monkeypatch.setattr(ct.time, "perf_counter", lambda: now[0])
    caplog.set_level(logging.INFO, logger="minillm.kernels")
    model = ct.accelerate(minillm.tiny_model(), cache_dir=tmp_path)   # 4 weight shapes
    assert len(calls) == 2                                     # 0 s, 3 s: timed; 6 s: past 5 s
    firsts = [p["routes"][1] for p in model.linear_plan.values()]
    assert firsts == ["ksplit", "ksplit", "F.linear", "F.linear"]
    assert "2 weight shapes unsettled or past the time budget took the prior" in caplog.records[0].getMessage()
    _agrees_with_plain(model)
