"""What a chapter may use of the compiled steps (lab/compiled_here.py): never a compile.

A tiny model and a temporary package folder: with no packages the helper says how to build them
and returns None, with every package's file present it returns the config, and in neither case
does anything load or compile (the compiler's entry points raise if called). Without packages
`step_times` reads the committed record of this thread count. Timing decides nothing here.
"""
import json
import math

import pytest
import torch

from minillm import EngineConfig, LLMEngine, tiny_model
from minillm.kernels import compiled_steps as cs
from minillm.lab import compiled_here as ch
from minillm.lab.common import RESULTS_ENV

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0, dtype=torch.float64)


@pytest.fixture
def no_compiler(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the helper must not load or compile a package")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", refuse)
    monkeypatch.setattr(cs.CompiledSteps, "compile", refuse)


def _touch_packages(model, folder, sizes):
    steps = cs.CompiledSteps(model, cs.CompilationConfig(compile_sizes=SIZES, cache_dir=str(folder)))
    for n in sizes:
        open(steps.package_path(n, str(folder)), "wb").close()


def test_missing_packages_give_none_and_the_command(model, tmp_path, no_compiler):
    said = []
    assert ch.built_config(model, SIZES, say=said.append, cache_dir=str(tmp_path)) is None
    assert len(said) == 1 and ch.BUILD in said[0] and "1, 2, 4" in said[0]
    assert list(tmp_path.iterdir()) == []                   # nothing written either


def test_some_packages_are_not_enough(model, tmp_path, no_compiler):
    _touch_packages(model, tmp_path, (1, 4))
    cc = cs.CompilationConfig(compile_sizes=SIZES, cache_dir=str(tmp_path))
    assert ch.missing_sizes(model, cc) == [2]
    said = []
    assert ch.built_config(model, SIZES, say=said.append, cache_dir=str(tmp_path)) is None
    assert "(sizes 2 missing)" in said[0]


def test_every_package_on_disk_gives_the_config(model, tmp_path, no_compiler):
    _touch_packages(model, tmp_path, SIZES)
    said = []
    cc = ch.built_config(model, SIZES, say=said.append, keep="agreeing", cache_dir=str(tmp_path))
    assert said == [] and cc.compile_sizes == SIZES and cc.keep == "agreeing"
    assert cc.cache_dir == str(tmp_path)
    other = tiny_model(vocab_size=64, seed=1, dtype=torch.float64)    # other weights, other names
    assert ch.missing_sizes(other, cc) == list(SIZES)


def test_build_command_names_the_thread_count():
    assert ch.build_command(1) == ch.BUILD
    assert ch.build_command(2).endswith("--threads 2")


def test_step_times_read_the_record_of_this_thread_count(model, tmp_path, monkeypatch, no_compiler):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    monkeypatch.setattr(ch, "inductor_cache_dir", lambda: str(tmp_path / "none"))
    assert ch.step_times(model, SIZES, say=lambda s: None) is None        # no record at all
    threads = torch.get_num_threads()
    rows = [{"n": n, "eager_ms": 10.0 * (1 + n / 4), "compiled_ms": 6.0 * (1 + n / 2)} for n in SIZES]
    for t, date in ((threads, "2026-01-01 00:00 UTC"), (threads + 1, "2026-02-01 00:00 UTC")):
        rec = {"benchmark": "compiled_steps", "sizes": rows,
               "machine": {"cpu": "Test CPU", "torch_threads": t, "date": date}}
        (tmp_path / f"compiled_steps_{t}.json").write_text(json.dumps(rec))
    said = []
    got = ch.step_times(model, SIZES, say=said.append)
    assert len(said) == 1 and ch.BUILD in said[0]
    assert got.eager == {1: 12.5, 2: 15.0, 4: 20.0} and got.compiled == {1: 9.0, 2: 12.0, 4: 18.0}
    assert f"{threads} thread" in got.origin and "2026-01-01" in got.origin
    assert got.ratio(3, compiled=True) == 2.0 and got.ratio(2, compiled=False) == 1.2
    with pytest.raises(ValueError, match="sizes go up to 4"):
        got.ratio(5, compiled=True)
    with pytest.raises(ValueError, match="must include 1"):
        ch.step_times(model, (2, 4))


def test_engine_decode_reads_the_record_without_packages(model, tmp_path, monkeypatch, no_compiler):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    monkeypatch.setattr(ch, "inductor_cache_dir", lambda: str(tmp_path / "none"))
    assert ch.engine_decode(model, (1, 8), say=lambda s: None) is None
    decode = {f"batch{b}": {"eager_ms_per_step": 10.0 * b, "compiled_ms_per_step": 5.0 * b,
                            "transformers_ms_per_step": 20.0 * b, "compiled_over_eager": 2.0}
              for b in (1, 8)}
    rec = {"benchmark": "compiled_steps", "sizes": [], "decode": decode,
           "machine": {"cpu": "Test CPU", "torch_threads": torch.get_num_threads()}}
    (tmp_path / "compiled_steps_cpu.json").write_text(json.dumps(rec))
    said = []
    ms, origin = ch.engine_decode(model, (1, 8), say=said.append)
    assert ms == {b: {"eager": 10.0 * b, "compiled": 5.0 * b, "transformers": 20.0 * b} for b in (1, 8)}
    assert "Test CPU" in origin and len(said) == 1 and ch.BUILD in said[0]


def test_padded_costs_charge_the_size_that_holds_n():
    want = {1: 1.0, 2: 1.5, **{n: 3.0 for n in range(3, 9)}}
    assert ch.padded_costs({1: 1.0, 2: 1.5, 8: 3.0}, 8) == want
    with pytest.raises(ValueError):
        ch.padded_costs({1: 1.0, 2: 1.5}, 3)


def test_engine_decode_ms_times_every_engine(model):
    engines = {k: LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=2))
               for k in ("a", "b")}
    ms = ch.engine_decode_ms(engines, [[1, 2, 3], [4, 5, 6]], n_new=3, rounds=2)
    assert set(ms) == {"a", "b"} and all(math.isfinite(v) for v in ms.values())
    with pytest.raises(ValueError):
        ch.engine_decode_ms(engines, [[1, 2]], n_new=1)
