"""The background tuner (minillm/kernels/background.py): one per table, it times only while
nothing else runs, gives the cores back the moment other work starts (and times that shape again
later), saves a quiet table that later processes use, and gives up without saving when no quiet
moment comes. The front door starts it on a first start and says so in one line. CPU counters and
route timings are faked (tests/fake_load.py); the model is a tiny one saved as an HF folder."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import minillm
from fake_load import fake_load
from minillm.kernels import background as bg
from minillm.kernels import cpu_tuning as ct
from minillm.kernels.route_timing import Interrupted
from minillm.kernels.tuning_cache import tuner_lock
from minillm.model.hf_convert import to_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")    # run_background(…, 1) sets one thread

TABLE = {"F.linear": {str(b): 9.0 for b in ct.BUCKETS}, "x@W": {str(b): 1.0 for b in ct.BUCKETS}}


@pytest.fixture
def folder(tmp_path):
    to_hf_model(minillm.tiny_model(vocab_size=64)).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture(autouse=True)
def no_nice(monkeypatch):
    monkeypatch.setattr(bg.os, "nice", lambda n: 0)          # the test process keeps its priority


def test_a_quiet_machine_gets_a_table_later_processes_use(tmp_path, folder, monkeypatch):
    fake_load(monkeypatch, others=0.05, cores=2)
    timed = []
    monkeypatch.setattr(bg, "_time_shape", lambda ws, interrupt: timed.append(len(ws)) or (TABLE, 0, 4))
    said = bg.run_background(folder, 1, cache_dir=tmp_path / "k", deadline_s=30)
    assert said.startswith("saved the tuned table") and timed
    assert not tuner_lock(ct.cache_key(), tmp_path / "k").exists()          # the lock is let go
    data = json.loads(ct.cache_path(tmp_path / "k").read_text())
    assert data["busy"] is None
    monkeypatch.setattr(ct, "race", lambda *a, **k: pytest.fail("a later process probed"))
    model = ct.accelerate(minillm.tiny_model(vocab_size=64), cache_dir=tmp_path / "k")
    assert model.linear_plan_source == "tuned"
    assert {p["routes"][1] for p in model.linear_plan.values()} == {"x@W"}


def test_other_work_interrupts_a_shape_which_is_timed_again(tmp_path, folder, monkeypatch):
    fake_load(monkeypatch, others=0.05, cores=2)
    tries = []

    def time_shape(ws, interrupt):
        tries.append(1)
        if len(tries) == 1:
            raise Interrupted                     # other work began during the first shape
        return TABLE, 0, 4
    monkeypatch.setattr(bg, "_time_shape", time_shape)
    said = bg.run_background(folder, 1, cache_dir=tmp_path, deadline_s=30)
    model = minillm.tiny_model(vocab_size=64)
    assert said.startswith("saved") and len(tries) == len(ct.linears(model)) + 1


def test_the_lookout_says_stop_when_other_work_starts(monkeypatch):
    load = fake_load(monkeypatch, others=0.05, cores=2)
    look = bg._Lookout()
    assert not look()                              # too soon to tell: keep going
    time.sleep(bg.CHECK_S * 1.2)
    assert not look()                              # quiet
    load["others"] = 1.0
    time.sleep(bg.CHECK_S * 1.2)
    assert look()                                  # a core's worth of other work: stop


def test_no_quiet_moment_saves_nothing(tmp_path, folder, monkeypatch):
    fake_load(monkeypatch, others=1.5, cores=2)
    monkeypatch.setattr(bg, "_time_shape", lambda *a, **k: pytest.fail("timed on a busy machine"))
    said = bg.run_background(folder, 1, cache_dir=tmp_path, deadline_s=0.2)
    assert said.startswith("no quiet moment") and not list(tmp_path.glob("*.json"))


def test_a_shape_that_never_settles_saves_nothing(tmp_path, folder, monkeypatch):
    fake_load(monkeypatch, others=0.0, cores=2)
    monkeypatch.setattr(bg, "_time_shape", lambda ws, interrupt: (TABLE, 4, 4))
    said = bg.run_background(folder, 1, cache_dir=tmp_path, deadline_s=30)
    assert "never settled" in said and not list(tmp_path.glob("*.json"))


def test_one_tuner_per_table_and_a_stale_lock_is_taken_over(tmp_path, folder, monkeypatch):
    fake_load(monkeypatch, others=0.0, cores=2)
    monkeypatch.setattr(bg, "_time_shape", lambda ws, interrupt: (TABLE, 0, 4))
    lock = tuner_lock(ct.cache_key(), tmp_path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(f"{sleeper.pid}\n")
        assert bg.run_background(folder, 1, cache_dir=tmp_path).startswith("another background tuner")
        assert bg.running_pid(tmp_path) == sleeper.pid
        monkeypatch.setenv(bg.ENV, "1")
        pid, said = bg.start_background_tuning(folder, 1, cache_dir=tmp_path)   # starts no second one
        assert pid == sleeper.pid and "already" in said
    finally:
        sleeper.kill()
        sleeper.wait()
    lock.write_text(f"{sleeper.pid}\n")                       # its process is gone now
    assert bg.run_background(folder, 1, cache_dir=tmp_path, deadline_s=30).startswith("saved")


def test_switched_off_it_starts_nothing(monkeypatch, folder):
    monkeypatch.setenv(bg.ENV, "0")
    assert bg.start_background_tuning(folder) == (None, f"background tuning is off ({bg.ENV}=0)")


def test_the_front_door_starts_it_on_a_first_start_and_says_so(tmp_path, folder, monkeypatch):
    from minillm import llm
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ct, "_QUICK", {})
    fake_load(monkeypatch, others=0.0, cores=2)
    monkeypatch.setattr(ct, "race", lambda *a, **k: ({"F.linear": {1: 2.0}, "x@W": {1: 1.0}}, set()))
    started = []
    monkeypatch.setattr(llm, "start_background_tuning",
                        lambda name: started.append(name) or (4242, "a background tuner (pid 4242) times"))
    model, _ = llm.load_model(folder, device="cpu")
    assert started == [folder]
    line = llm.routes_summary(model)
    assert "probe at 1 row chose x@W" in line and "pid 4242" in line and "python -m minillm.kernels" in line
    model, _ = llm.load_model(folder, device="cpu", kernels="x@W")     # pinned: nothing to tune
    assert started == [folder] and llm.routes_summary(model) == "CPU matmul routes: pinned x@W"
    plain, _ = llm.load_model(folder, device="cpu", kernels="plain")
    assert "none" in llm.routes_summary(plain)


def test_the_real_child_starts_holds_its_lock_and_leaves_on_its_deadline(tmp_path, folder, monkeypatch):
    """The command the front door runs, for real: it takes the lock, and on a deadline too short
    for any quiet moment it lets the lock go and saves nothing."""
    monkeypatch.setenv(bg.ENV, "1")
    env = {**os.environ, "MINILLM_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "minillm.kernels", "--background", "--model", str(folder),
                          "--threads", "1", "--cache-dir", str(tmp_path / "k"), "--deadline-s", "0.5"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith(("no quiet moment", "saved"))
    assert not list((tmp_path / "k").glob("*.tuning"))
    bad = subprocess.run([sys.executable, "-m", "minillm.kernels", "--background", "--deadline-s", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--deadline-s must be > 0" in bad.stderr
