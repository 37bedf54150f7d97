"""Smoke tests of the benchmark suite (`python -m benchmarks`): dispatcher, JSON records, results
table, the GPU run script.

No timing assertions: these check that the suite runs and that its records say what ran where.
The roofline benchmark runs through the dispatcher on a tiny model (load_model patched); decode,
serving and spec take minutes even with --quick on a 2-core CPU, so `bench all` is checked with
every run() stubbed (the lead's `bench all --quick` run covers the real ones).
"""
import importlib
import json
from pathlib import Path

import pytest
import torch

from benchmarks import __main__ as bench
from benchmarks.gpu_run import STEPS, import_results, parse_args
from benchmarks.gpu_run import main as gpu_run_main
from benchmarks.results_table import END, START, get_metric, ledger_for, results_table, update_table
from minillm import get_config, tiny_model

MACHINE_KEYS = {"device", "device_name", "cpu", "torch", "python", "git_commit", "date"}
NO_UNITS_YET = {"roofline", "serving", "spec"}      # committed records written before "units"


def test_bench_all_runs_every_benchmark_once_with_the_arguments(monkeypatch, capsys, tmp_path):
    """`bench all`: every listed module's run() is called once, in order, with the command line's
    quick / device / out_dir, and its own report() prints the record when it has one."""
    calls = []
    for name, path in bench.BENCHMARKS.items():
        module = importlib.import_module(path)
        monkeypatch.setattr(module, "run", lambda _name=name, **kw: calls.append((_name, kw)) or
                            {"benchmark": _name, "machine": {}})
        if hasattr(module, "report"):
            monkeypatch.setattr(module, "report", lambda r: f"report of {r['benchmark']}")
    bench.main(["all", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert calls == [(n, dict(quick=True, device="cpu", out_dir=str(tmp_path)))
                     for n in bench.BENCHMARKS]
    text = capsys.readouterr().out
    for name, path in bench.BENCHMARKS.items():
        has_report = hasattr(importlib.import_module(path), "report")
        assert (f"report of {name}" in text) == has_report and f"[{name}] done" in text
    with pytest.raises(SystemExit):
        bench.main(["nope"])


@pytest.fixture(scope="module")
def roofline_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    mp = pytest.MonkeyPatch()
    import minillm.model.loading
    mp.setattr(minillm.model.loading, "load_model", lambda *a, device=None, dtype=torch.float32, **k:
               (tiny_model(vocab_size=512, device=device), None))
    torch.set_num_threads(1)
    try:
        bench.main(["roofline", "--quick", "--device", "cpu", "--out", str(out)])
    finally:
        mp.undo()
    files = sorted(out.glob("*.json"))
    assert [f.name for f in files] == ["roofline_cpu.json"]
    return json.loads(files[0].read_text())


def test_dispatcher_quick_writes_machine_metadata(roofline_record):
    r = roofline_record
    assert r["benchmark"] == "roofline" and r["quick"] is True
    assert MACHINE_KEYS <= set(r["machine"]) and r["machine"]["device"] == "cpu"
    assert r["decode"]["model"] == "tiny" and len(r["decode"]["measured_s"]) == 3


def _numeric_keys(record, skip=("machine", "units")) -> set[str]:
    """Keys whose values are numbers or lists of numbers, anywhere in a record."""
    keys = set()
    for k, v in record.items():
        if k in skip or isinstance(v, bool):
            continue
        if isinstance(v, dict):
            keys |= _numeric_keys(v) if k != "peak_flops" else {k}
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            keys |= set().union(*(_numeric_keys(x) for x in v))
        elif isinstance(v, (int, float)) or (isinstance(v, list) and v and
                                             all(isinstance(x, (int, float)) for x in v)):
            keys.add(k)
    return keys


def test_roofline_record_names_the_unit_of_every_number(roofline_record):
    units = roofline_record["units"]
    breakdown = set(roofline_record["decode_breakdown_b1"])   # one unit for the whole table
    assert _numeric_keys(roofline_record) - breakdown <= set(units)


def test_committed_ledger_records_say_where_they_ran():
    from benchmarks.results_table import load_ledger
    for r in load_ledger():
        assert MACHINE_KEYS <= set(r["machine"]), r["_source"]
        if r["benchmark"] not in NO_UNITS_YET:
            assert "units" in r, r["_source"]


def _record(bench_name, device, name, commit, **payload):
    return {"benchmark": bench_name, **payload,
            "machine": {"device": device, "device_name": name, "git_commit": commit,
                        "date": "2026-11-29 08:00 UTC"}}


LEDGER = [
    _record("decode", "cuda", "NVIDIA H200", "abc1234", quick=False,
            weights="random (real SmolLM2-135M architecture)",
            batch1={"minillm_tok_per_s": 123.456, "speedup_vs_transformers": 1.5}),
    _record("decode", "cpu", "AMD EPYC", "def5678", quick=True,
            batch1={"minillm_tok_per_s": 20.04, "speedup_vs_transformers": 0.9},
            batch1_fraction_of_floor=0.456),
    _record("roofline", "cpu", "AMD EPYC", "def5678", hardware={"mem_bandwidth": 4.71e9},
            decode={"measured_s": [0.01234, 0.02]}),
]


def test_results_table_on_a_synthetic_ledger():
    lines = results_table(LEDGER).splitlines()
    assert lines[0] == "| benchmark | metric | value | device | date | commit |"
    body = lines[2:]
    assert body[0] == "| decode | decode, batch 1 | 20 tok/s (quick) | AMD EPYC | 2026-11-29 | def5678 |"
    assert body[1] == ("| decode | decode, batch 1 | 123 tok/s (random weights) | NVIDIA H200 | "
                       "2026-11-29 | abc1234 |")
    assert "| 1.5 x (random weights) | NVIDIA H200" in body[3]
    assert "| 45.6 % (quick) |" in body[4]
    assert body[5].startswith("| roofline | memory bandwidth (measured) | 4.71 GB/s |")
    assert "| 12.3 ms |" in body[6] and len(body) == 7         # metrics not recorded: no row
    assert "no results" in results_table([])
    with pytest.raises(TypeError, match="records"):
        results_table({"benchmark": "decode"})


def test_get_metric_walks_dicts_and_lists():
    r = LEDGER[2]
    assert get_metric(r, "decode.measured_s.1") == 0.02
    assert get_metric(r, "decode.measured_s.5") is None and get_metric(r, "nope.x") is None


def test_update_table_rewrites_only_between_markers(tmp_path):
    ledger = tmp_path / "results"
    ledger.mkdir()
    for r in LEDGER:
        (ledger / f"{r['benchmark']}_{r['machine']['device']}.json").write_text(json.dumps(r))
    page = tmp_path / "results.md"
    stale = f"# title\n\n{START}\nold table\n{END}\n\nafter\n"
    page.write_text(stale)
    assert update_table(page, ledger, check=True) is True and page.read_text() == stale
    assert update_table(page, ledger) is True
    text = page.read_text()
    assert text.startswith(f"# title\n\n{START}\n| benchmark |") and text.endswith(f"{END}\n\nafter\n")
    assert "old table" not in text and "123 tok/s" in text
    assert update_table(page, ledger) is False                   # idempotent
    assert update_table(page, ledger, check=True) is False
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="results:start"):
        update_table(page, ledger)
    rows = ledger_for("decode", "batch1.minillm_tok_per_s", ledger)
    assert {(e["device"], e["value"]) for e in rows} == {("cpu", 20.04), ("cuda", 123.456)}
    assert any("decode_cuda.json" in e["label"] and "random weights" in e["label"] for e in rows)


def test_results_check_exits_1_on_a_stale_table_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from benchmarks.results_table import main as results_main
    monkeypatch.setenv("MINILLM_RESULTS_DIR", str(tmp_path / "no-records"))
    page = tmp_path / "results.md"
    page.write_text(f"{START}\nold\n{END}\n")
    assert results_main(["--check", str(page)]) == 1 and "out of date" in capsys.readouterr().out
    assert page.read_text() == f"{START}\nold\n{END}\n"
    assert results_main([str(page)]) == 0 and "no results committed yet" in page.read_text()
    capsys.readouterr()
    assert results_main(["--check", str(page)]) == 0 and "up to date" in capsys.readouterr().out


def test_bench_model_random_weights_fallback(monkeypatch):
    from benchmarks.gpu_model import RANDOM_WEIGHTS, bench_model
    monkeypatch.setenv("MINILLM_RANDOM_WEIGHTS", "1")
    monkeypatch.setenv("MINILLM_TOKENIZER", "/nonexistent")
    m1, tok, weights = bench_model("cpu")
    m2, _, _ = bench_model("cpu")
    assert weights == RANDOM_WEIGHTS and tok is None and m1.dtype == torch.float32
    assert m1.config == get_config("smollm2-135m")
    assert torch.equal(m1.layers[3].mlp.down_proj.weight, m2.layers[3].mlp.down_proj.weight)
    with pytest.raises(TypeError, match="dtype"):
        bench_model("cpu", torch.int8)


def test_gpu_run_arguments():
    a = parse_args(["--out", "x", "--device", "cpu", "--quick"])
    assert a.steps == STEPS and a.quick and a.device == "cpu"
    assert parse_args(["--out", "x", "--only", "tests,decode"]).steps == ["tests", "decode"]
    for bad in (["--out", "x", "--only", "nope"], ["--out", "x", "--device", "tpu"], ["--device", "cpu"],
                ["--out", "x", "--import-from", "y"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the benchmark really runs")
def test_cuda_graphs_benchmark_skips_without_cuda(tmp_path):
    from benchmarks import cuda_graphs
    assert "CUDA" in cuda_graphs.run(True, "cpu", tmp_path)["skipped"]
    assert list(tmp_path.iterdir()) == []


def test_gpu_run_dry_run_on_cpu(tmp_path):
    summary = gpu_run_main(["--out", str(tmp_path), "--device", "cpu", "--quick",
                            "--only", "cuda_graphs"])
    assert summary["steps"]["cuda_graphs"]["status"] == "skipped"
    assert "CUDA" in summary["steps"]["cuda_graphs"]["last_line"]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {"summary.json", "gpu_run.log"} and len(files) <= 8


def test_import_results_copies_records_and_figures(tmp_path):
    import tarfile
    run, dest = tmp_path / "run", tmp_path / "results"
    run.mkdir()
    with pytest.raises(ValueError, match="summary.json"):
        import_results(run, dest)
    (run / "summary.json").write_text("{}")
    (tmp_path / "decode_h200.json").write_text(json.dumps(LEDGER[0]))
    (tmp_path / "roofline_h200.png").write_bytes(b"png")
    with tarfile.open(run / "results.tar", "w") as tar:
        tar.add(tmp_path / "decode_h200.json", arcname="decode_h200.json")
        tar.add(tmp_path / "roofline_h200.png", arcname="roofline_h200.png")
    assert sorted(import_results(run, dest)) == ["decode_h200.json", "roofline_h200.png"]
    assert json.loads((dest / "decode_h200.json").read_text()) == LEDGER[0]
    assert (dest / "roofline_h200.png").read_bytes() == b"png" and not (dest / "summary.json").exists()


def test_quick_decode_record_splits_the_batch1_step_into_matmuls_and_the_rest(tmp_path, monkeypatch):
    """bench decode, quick, on the tiny model: batch 1's rounds time the step's matmuls alone
    beside the step and the floor, and the record's shares are those times' ratios."""
    from benchmarks import decode
    from minillm.lab.forward_cost import least_forward_ratio
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))       # the tuning table
    monkeypatch.setattr(decode, "_equal_length_prompts", lambda tok, n: [[1, 2, 3, 4, 5]] * n)
    r = decode.run(quick=True, model=tiny_model(n_layer=2), tok=None, out_dir=tmp_path)
    for name in ("stored_once", "with_copies"):
        part = r[name]
        b1 = part["batch1"]
        assert b1["matmuls_ms_per_step"] > 0 and b1["floor_ms_per_step"] > 0
        # the record keeps 3 decimals: on a loaded machine the share is small (0.011) and its
        # rounding alone is over 1%, so the check allows half a unit of the last decimal too
        assert part["batch1_matmuls_fraction_of_floor"] == pytest.approx(
            b1["floor_ms_per_step"] / b1["matmuls_ms_per_step"], rel=1e-2, abs=5e-4)
        assert "matmuls_ms_per_step" not in part["batch8"]
    assert r["batch1_matmuls_fraction_of_floor"] == r["stored_once"]["batch1_matmuls_fraction_of_floor"]
    assert "matmuls_ms_per_step" in r["units"] and (tmp_path / "decode_cpu.json").exists()
    for part in (r["stored_once"], r["with_copies"]):
        assert set(part["forward_cost"]["matmuls"]) == set(part["forward_cost"]["auto"]) == {"1", "2", "4"}
        assert part["least_forward_ratio"] == least_forward_ratio(part["forward_cost"])
    assert decode.report(r).count("its matmuls alone") == 4
    assert [row["n"] for row in r["verify_cost"]["rows"]] == [1, 2, 4]
    assert "int8_least" in r["stored_once"]["verify_cost"]["rows"][0]
    assert decode.report(r).count("verify cost") == 2


def test_quick_compiled_steps_record_on_a_tiny_model(tmp_path, one_thread, monkeypatch):
    """bench compiled_steps, quick, on a one-layer tiny model with inductor's default mode: one
    row per size whose ratios are its times' ratios, the roofline's ratio from the same cost
    model, the kept sizes those the default rule calls faster, decode at batch 1 and 8."""
    from benchmarks import compiled_steps as bench
    from minillm.analysis.roofline import Hardware
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))       # inductor's caches too
    monkeypatch.setattr(bench, "_equal_length_prompts", lambda tok, n: [[1, 2, 3, 4, 5]] * n)
    model = tiny_model(vocab_size=128, n_layer=1)
    r = bench.run(quick=True, device="cpu", out_dir=tmp_path, model=model, mode="default",
                  sizes=(1, 8))
    rows = {x["n"]: x for x in r["sizes"]}
    assert list(rows) == [1, 8] and rows[1]["eager_ratio"] == rows[1]["roofline_ratio"] == 1.0
    for x in rows.values():
        assert x["tokens_equal"] and x["compile_s"] > 0
        assert x["eager_ratio"] == pytest.approx(x["eager_ms"] / rows[1]["eager_ms"], rel=1e-2, abs=2e-3)
        assert x["speedup"] == pytest.approx(x["eager_ms"] / x["compiled_ms"], rel=1e-2, abs=2e-3)
    hw = Hardware(r["hardware"]["name"], {"fp32": r["hardware"]["peak_flops"]},
                  r["hardware"]["mem_bandwidth"], 1.0)
    assert rows[8]["roofline_ratio"] == pytest.approx(bench._step_roofline(model.config, hw, (1, 8))[8],
                                                      abs=1e-3)
    assert set(r["decode"]) == {"batch1", "batch8"} and r["compile_s_cached"] is None   # SmolLM2 only
    for d in r["decode"].values():
        assert d["compiled_over_eager"] == pytest.approx(d["eager_ms_per_step"] / d["compiled_ms_per_step"],
                                                         rel=1e-2, abs=2e-3)
    assert "kept" in r["kept_summary"] or "none kept" in r["kept_summary"]
    assert "batch8: eager" in bench.report(r) and (tmp_path / "compiled_steps_cpu.json").exists()


def test_quick_compile_record_on_a_tiny_model(tmp_path, one_thread):
    """bench compile, quick, on the tiny model: one timing per row count, the choice each made,
    compile seconds apart from step times, and the report's line per row count. Inductor's
    default mode: max-autotune's kernel search (the benchmark's default, minutes on a cold cache)
    is covered by tests/kernels/test_compiled.py; here only the record's plumbing is under test."""
    from benchmarks import compile as compile_bench
    r = compile_bench.run(quick=True, device="cpu", out_dir=tmp_path,
                          model=tiny_model(vocab_size=128, n_layer=1), mode="default")
    assert [t["rows"] for t in r["timings"]] == [1, 9] and set(r["choice"]) == {"1", "9"}
    assert r["mode"] == "default"
    for t in r["timings"]:
        assert t["choice"] == r["choice"][str(t["rows"])] and t["compile_s"] > 0
        assert t["speedup"] == pytest.approx(t["eager_ms"] / t["compiled_ms"], rel=1e-2)
    text = compile_bench.report(r)
    assert "decode step" in text and "verify of 9" in text and (tmp_path / "compile_cpu.json").exists()
    assert compile_bench.run(device="meta")["skipped"]
