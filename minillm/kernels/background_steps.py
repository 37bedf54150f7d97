"""Compiled steps made while the engine serves eager: no request waits for a compile.

`CompilationConfig(background=True)` builds the engine eager and gives its runner a
`BackgroundSteps`, whose thread
1. writes the model to a job file and starts `python -m minillm.kernels.background_steps JOB` at
   nice 19, which compiles every package missing on disk (`compiled_steps.compile_package`);
2. loads the packages and checks each against eager, timing rounds only while the engine is idle
   (`StepClock`; a round during a step is timed again); saved verdicts spare the timing;
3. publishes the `CompiledSteps`, adopted at the runner's next step.
A failed child or packages that do not load leave the engine eager, with one line; an engine that
never idles stays eager unless a saved verdict decides.

Left out on purpose: handing the weights over without a file (a job file holds one copy of the
weights while the child runs), and stopping a compile that is no longer wanted (the child
finishes its packages; a later process loads them).
"""
import atexit
import os
import subprocess
import sys
import threading
import time

import torch

from minillm.kernels import compiled_steps as cs
from minillm.kernels.compiled import inductor_cache_dir, reference_twin
from minillm.kernels.tuning_cache import notice
from minillm.model.llama import Transformer

IDLE_S = 0.2          # the engine counts as idle this long after its last step ended
NICE = 19             # the child's priority: only cores nobody else wants (tests lower it)
POLL_S = 0.05


class StepClock:
    """When the engine's steps begin and end; a timing round asks it for an idle moment."""

    def __init__(self):
        self.steps, self.busy, self.ended = 0, False, time.monotonic()

    def begin(self) -> None:
        self.busy = True

    def end(self) -> None:
        self.steps, self.busy, self.ended = self.steps + 1, False, time.monotonic()

    def wait_idle(self) -> int:
        """Block until no step ran for IDLE_S; -> a token for `unchanged`."""
        while self.busy or time.monotonic() - self.ended < IDLE_S:
            time.sleep(POLL_S)
        return self.steps

    def unchanged(self, token: int) -> bool:
        """No step began since `wait_idle` gave `token`."""
        return not self.busy and self.steps == token


def _command(job: str) -> list:
    return [sys.executable, "-m", "minillm.kernels.background_steps", job, str(NICE)]


class BackgroundSteps:
    """The compiled steps of `model` for `config` on their way: once `ready()`, `steps` is the
    finished `CompiledSteps` (None if it failed) and `line` says how it ended; `wait(timeout)`
    blocks for them. `clock`: the engine's StepClock."""

    background = True

    def __init__(self, model, config, make_cache, clock: StepClock | None = None):
        self.model, self.config, self.make_cache = model, config, make_cache
        self.clock = clock or StepClock()
        self.steps = None
        self.line = ""
        self.returncode = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._work, name="minillm-compile", daemon=True)
        self._thread.start()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        """Block until ready (or `timeout` seconds); -> `steps` (None while not ready)."""
        self._done.wait(timeout)
        return self.steps

    def _work(self) -> None:
        try:
            made = cs._MADE.setdefault(self.model, {})
            steps = made.get(self.config)
            if steps is None:
                steps = self._compile()
                made[self.config] = steps
            self.steps, self.line = steps, steps.summary()
        except Exception as e:                         # never let the thread die silently
            self.line = f"compiled steps: none ({type(e).__name__}: {e}); every step eager"
        notice(self.line)
        self._done.set()

    @torch.inference_mode()
    def _compile(self) -> "cs.CompiledSteps":
        steps = cs.CompiledSteps(self.model, self.config)
        cache_dir = self.config.cache_dir or inductor_cache_dir()
        saved = steps.saved_verdicts(cache_dir) if self.config.keep == "faster" else {}
        missing = [n for n in self.config.compile_sizes
                   if not os.path.exists(steps.package_path(n, cache_dir))
                   and saved.get(n, {}).get("choice") != "eager"]
        if missing:
            self.returncode = self._run_child(steps, missing, cache_dir)
        steps.compile_missing = False                  # what the child did not write: eager
        return steps.compile(self.make_cache, gate=self.clock)

    def _run_child(self, steps, sizes: list, cache_dir: str) -> int:
        """Compile `sizes` in a child process at priority NICE; -> its exit status."""
        os.makedirs(cache_dir, exist_ok=True)
        job = os.path.join(cache_dir, f"job_{os.getpid()}_{id(self)}.pt")
        twin = reference_twin(self.model)
        torch.save({"config": self.model.config, "state": twin.state_dict(), "mode": self.config.mode,
                    "cache_dir": cache_dir, "threads": torch.get_num_threads(),
                    "paths": {n: steps.package_path(n, cache_dir) for n in sizes}}, job)
        log = open(os.path.join(cache_dir, "background_steps.log"), "a")
        try:
            child = subprocess.Popen(_command(job), stdout=log, stderr=subprocess.STDOUT)
            atexit.register(_stop, child)
            code = child.wait()
        finally:
            log.close()
            if os.path.exists(job):
                os.remove(job)
        if code != 0:
            notice(f"compiled steps: the background compile exited with status {code} "
                   f"(log: {log.name}); sizes without a package run eager")
        return code


def _stop(child) -> None:
    if child.poll() is None:
        child.terminate()


def main(job: str, nice: int = NICE) -> None:
    """The child: compile each package of the job file that is not on disk yet."""
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    spec = torch.load(job, weights_only=False)
    torch.set_num_threads(spec["threads"])
    with torch.device("meta"):
        model = Transformer(spec["config"])
    model.load_state_dict(spec["state"], assign=True, strict=True)
    body = cs._Body(model.eval()).eval()
    for n, path in sorted(spec["paths"].items()):
        if os.path.exists(path):
            continue
        print(f"compiling the engine step of {n} row(s) -> {path}", flush=True)
        ids, pos = cs.example_inputs(model.config.vocab_size, n, model.device)
        with torch.inference_mode():
            cs.compile_package(body, ids, pos, path, spec["cache_dir"], spec["mode"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else NICE)
