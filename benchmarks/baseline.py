"""The engine of another commit, timed beside this one in the same run on this machine.

Issue 13 asks to halve the engine's own cost per decode step, measured on a many-layer tiny model
(`python -m benchmarks overhead`). "Halve" compares with the engine as it was when the issue was filed
(`ISSUE_BASE`), and numbers from another day on a shared machine cannot be compared: the same
step can take 4.5 ms in one run and 7 ms in the next. So `compare` exports the package as it was
at a commit (`git archive`, into a temporary folder) and starts two processes, one on that tree
and one on this checkout, each holding a decoding `LLMEngine` per batch size (1, 8, 32) over the
same tiny model (30 layers, d_model 64), the same ragged prompts and the same thread count. They
take turns, a few steps each, for many rounds: only one runs at a time, and a slow spell of the
machine falls on both alike, so their ratio holds where the absolute numbers do not.

The probe uses only public names that both package layouts have (`tiny_model`, `LLMEngine`,
`EngineConfig`, `SamplingParams`, and `flatten` where it exists: what `load_model` runs on a CPU).
Needs git and this repository's history (a clone has it; an installed wheel does not): anything
else is a clear error, never a wrong number.

    python -m benchmarks.baseline [COMMIT]    # default: ISSUE_BASE
"""
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import minillm
from minillm._validate import check_int

ISSUE_BASE = "bc85599"            # the code issue 13 measured (2026-11-29)
# The engine both processes time, and `python -m benchmarks overhead` too: batch sizes, the
# shortest prompt (the others up to 7 tokens more) and the block size.
BATCHES = (1, 8, 32)
PROMPT_LEN = 8
BLOCK_SIZE = 16

# Run as `python -c PROBE ARGS_JSON` with the tree to time first on sys.path. It builds one
# decoding engine per batch size, says which package it imported, then for every line "B" on
# stdin times `steps` steps of the engine at batch B and answers their ms as one JSON line.
# It must run on old package layouts too, so it cannot call `overhead.decoding_engine`: it builds
# the same engine (prompt length and block size come from the constants above, in ARGS).
PROBE = r"""
import json, sys, time
import torch
args = json.loads(sys.argv[1])
import minillm
try:                                            # the package by concept
    from minillm.engine.llm_engine import EngineConfig, LLMEngine
    from minillm.engine.sampling_params import SamplingParams
    from minillm.model.loading import tiny_model
except ImportError:                             # the flat package of earlier commits
    from minillm.engine import EngineConfig, LLMEngine
    from minillm.sequence import SamplingParams
    from minillm.loading import tiny_model
try:
    from minillm.kernels.flat_forward import flatten
except ImportError:
    flatten = None
torch.set_num_threads(args["threads"])
torch.set_grad_enabled(False)
model = tiny_model(vocab_size=256, n_layer=args["n_layer"])
if flatten is not None:
    flatten(model)                              # what load_model's models run on a CPU
engines, plen, P, total = {}, args["prompt_len"], args["block_size"], args["total_steps"]
for B in args["batches"]:
    per_seq = -(-(plen + 8 + total + 1) // P)
    engine = LLMEngine(model, EngineConfig(block_size=P, num_blocks=B * per_seq, max_num_seqs=B,
                                           max_num_batched_tokens=B * (plen + 8)))
    params = SamplingParams(max_tokens=total + 1, ignore_eos=True)
    for i in range(B):
        engine.add_request([(7 * i + j) % 256 for j in range(plen + i % 8)], params)
    engine.step()                               # the prefill of every prompt
    engines[B] = engine
print(json.dumps({"package": minillm.__file__}), flush=True)
for line in sys.stdin:
    engine, times = engines[int(line)], []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
    print(json.dumps(times), flush=True)
"""


def repo_root() -> Path:
    """The git checkout this package was imported from (RuntimeError if it is not in one)."""
    here = Path(minillm.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, text=True,
                             capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"benchmarks.baseline needs git: {e}") from None
    if out.returncode != 0 or not (Path(out.stdout.strip()) / "minillm").is_dir():
        raise RuntimeError(f"benchmarks.baseline needs the minillm git checkout; {here} is not in one")
    return Path(out.stdout.strip())


def export(commit: str, dest: Path) -> str:
    """Write the `minillm/` folder as it was at `commit` under dest; return the full hash.
    ValueError if `commit` names no commit of this repository or its tree has no package."""
    if not isinstance(commit, str) or not commit or commit.startswith("-"):
        raise ValueError(f"commit must name a commit of this repository, got {commit!r}")
    root = repo_root()
    rev = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                         cwd=root, text=True, capture_output=True, timeout=10)
    if rev.returncode != 0:
        raise ValueError(f"commit must name a commit of this repository, got {commit!r} "
                         f"(a shallow clone may lack it)")
    full = rev.stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", full, "minillm"], cwd=root,
                         capture_output=True, timeout=120)
    if tar.returncode != 0:
        raise ValueError(f"commit {commit!r} has no minillm/ package: "
                         f"{tar.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
        tf.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return full


class Probe:
    """A fresh process holding decoding engines of the package under `tree`, timed on request."""

    def __init__(self, tree: Path, threads: int, batches, steps: int, total_steps: int):
        args = json.dumps({"threads": threads, "batches": list(batches), "steps": steps,
                           "total_steps": total_steps, "n_layer": 30, "prompt_len": PROMPT_LEN,
                           "block_size": BLOCK_SIZE})
        path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path)
        self.tree, self.err = tree, tempfile.TemporaryFile("w+")   # a file: a pipe could fill
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, args], cwd=tree, env=env,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err)
        package = json.loads(self._line())["package"]
        if Path(package).resolve().parent != (tree / "minillm").resolve():
            self.close()
            raise RuntimeError(f"the probe imported {package}, not the package under {tree}")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self.err.seek(0)
            err = self.err.read()
            raise RuntimeError(f"the probe on {self.tree} failed:\n{err[-2000:]}")
        return line

    def times(self, batch: int) -> list:
        """ms of each of `steps` engine steps at `batch`."""
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.err.close()


def compare(commit: str = ISSUE_BASE, rounds: int = 20, threads: int = 1, batches=None,
            steps: int = 5, warmup_rounds: int = 2) -> dict:
    """Engine ms per decode step of the package at `commit` and of this checkout: two processes,
    each holding one decoding engine per batch size, take turns (`rounds` rounds of `steps`
    steps at every batch size, after `warmup_rounds` untimed ones); medians over all timed
    steps and their ratio (`baseline_over_current` > 1: this engine is faster)."""
    check_int("rounds", rounds, 1)
    check_int("threads", threads, 1)
    check_int("steps", steps, 1)
    check_int("warmup_rounds", warmup_rounds, 0)
    if batches is None:
        batches = BATCHES                                      # the overhead benchmark's sizes
    batches = tuple(batches)
    if not batches:
        raise ValueError("batches must list at least one batch size")
    for b in batches:
        check_int("batches", b, 1, 256)
    here = repo_root()
    total = (rounds + warmup_rounds) * steps
    samples = {"baseline": {b: [] for b in batches}, "current": {b: [] for b in batches}}
    with tempfile.TemporaryDirectory(prefix="minillm-baseline-") as tmp:
        full = export(commit, Path(tmp))
        probes = {}
        try:
            for name, tree in (("baseline", Path(tmp)), ("current", here)):
                probes[name] = Probe(tree, threads, batches, steps, total)
            for r in range(warmup_rounds + rounds):
                for b in batches:
                    for name, p in probes.items():        # in turn: a slow spell hits both
                        t = p.times(b)
                        if r >= warmup_rounds:
                            samples[name][b] += t
        finally:
            for p in probes.values():
                p.close()
    med = {name: {f"batch{b}": round(statistics.median(v), 3) for b, v in s.items()}
           for name, s in samples.items()}
    return {"commit": full[:7], "rounds": rounds, "steps_per_round": steps, "threads": threads,
            "baseline_engine_ms": med["baseline"], "current_engine_ms": med["current"],
            "baseline_over_current": {k: round(med["baseline"][k] / med["current"][k], 2)
                                      for k in med["current"]}}


def report(r: dict) -> str:
    return "\n".join(
        [f"engine step of {r['commit']} vs this checkout (tiny 30-layer model, {r['threads']} "
         f"thread(s), medians of {r['rounds']} x {r['steps_per_round']} steps taken in turn):"]
        + [f"  {k}: {r['baseline_engine_ms'][k]:.2f} ms -> {r['current_engine_ms'][k]:.2f} ms "
           f"({r['baseline_over_current'][k]:.2f}x)" for k in r["current_engine_ms"]])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(f"usage: python -m benchmarks.baseline [COMMIT]   (default {ISSUE_BASE}: the "
              f"engine issue 13 measured)", file=sys.stderr)
        return 2
    try:
        print(report(compare(argv[0] if argv else ISSUE_BASE)))
    except (ValueError, RuntimeError) as e:
        print(f"benchmarks.baseline: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
