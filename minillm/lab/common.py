"""Shared measuring plumbing: careful timing (`time_fn`; `per_token_ms`, decodes timed in
alternating rounds), a prefilled cache for timing forwards, and the committed benchmark records.

`load_results(name)` reads the JSON records in `results_dir()`: $MINILLM_RESULTS_DIR when set
(a relative path is taken from the checkout), else `benchmarks/results/` of the source checkout
that holds this package, found from the package's own files and not from the current directory.
An installed package has no checkout around it, so there `results_dir()` is None and
`load_results` returns no records and says why in a warning.

Left out on purpose: writing records. The benchmarks that write them live outside the package
(`python -m benchmarks NAME`, in the checkout's `benchmarks/`).
"""
import json
import os
import time
import warnings
from pathlib import Path

import torch

from minillm.model.kv_cache import KVCache
from minillm._paths import checkout_root, project_root

RESULTS_ENV = "MINILLM_RESULTS_DIR"


def results_dir() -> Path | None:
    """Where the benchmark records are read from (see the module docstring); None when neither
    $MINILLM_RESULTS_DIR nor a source checkout says."""
    chosen = os.environ.get(RESULTS_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        return path if path.is_absolute() else project_root() / path
    root = checkout_root()
    return root / "benchmarks" / "results" if root is not None else None


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device="cpu", warmup: int = 1, repeat: int = 3) -> float:
    """Median seconds of `fn()` after warm-up; on CUDA timed with events after a synchronize."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def per_token_ms(runs: dict, n_new: int = 16, rounds: int = 3) -> dict:
    """{name: ms per decode step} of each `runs[name](n)` (a decode of n new tokens after the same
    prompt): (t(n_new) - t(1)) / (n_new - 1), so the prompt's cost cancels, the median of `rounds`
    rounds. Each round times every run in turn, the order reversed every other round, so a slow
    spell of a shared machine falls on all of them. CPU timing (no device synchronize)."""
    if n_new < 2:
        raise ValueError(f"n_new must be >= 2, got {n_new}")

    def timed(run, n):
        t0 = time.perf_counter()
        run(n)
        return time.perf_counter() - t0

    for run in runs.values():                       # warm-up: first calls, probes, allocations
        run(2)
    samples, names = {name: [] for name in runs}, list(runs)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t_n, t_1 = timed(runs[name], n_new), timed(runs[name], 1)
            samples[name].append(1e3 * (t_n - t_1) / (n_new - 1))
    return {name: sorted(ms)[len(ms) // 2] for name, ms in samples.items()}


_default_results = results_dir          # load_results' parameter shadows the function's name


def load_results(name: str | None = None, results_dir=None) -> list[dict]:
    """Every committed record (optionally of one benchmark), for notebooks and the results table.
    No records folder (an installed package, no $MINILLM_RESULTS_DIR): [] and a warning saying so."""
    folder = Path(results_dir) if results_dir is not None else _default_results()
    if folder is None or not folder.is_dir():
        where = ("this minillm is not a source checkout" if folder is None
                 else f"{folder} is not a folder")
        warnings.warn(f"no benchmark records to read: {where}; set ${RESULTS_ENV} to a folder of "
                      f"records (a clone's benchmarks/results/)", stacklevel=2)
        return []
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return [r for r in records if name is None or r.get("benchmark") == name]


def prefilled(model, batch: int, context: int, room: int, cache_cls=None):
    """A contiguous cache holding `context` tokens in each of `batch` rows with `room` free slots
    after them, and `forward(x)`, which runs the model on new tokens x (B, n) at positions
    context..context+n-1. Each call overwrites the last one's slots, so a timing loop repeats the
    same step. -> (cache, forward)."""
    dev = model.device
    cache = (cache_cls or KVCache)(model.config, batch, context + room, dev, model.dtype)
    model(torch.ones(batch, context, dtype=torch.long, device=dev), torch.arange(context, device=dev),
          cache, logits_index=torch.tensor([context - 1]))
    positions = {}

    def forward(x):
        n = x.shape[1]
        if n not in positions:
            positions[n] = torch.arange(context, context + n, device=dev)     # (n,)
        return model(x, positions[n], cache)
    return cache, forward
