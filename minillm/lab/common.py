"""Shared benchmark plumbing: machine metadata, careful timing, and the JSON results ledger.

Every benchmark writes `<results_dir()>/<name>_<device-tag>.json` holding the machine it ran
on, the git commit, and its figures with units, so the README and the notebooks can quote
numbers together with the hardware they came from. `results_dir()` is $MINILLM_RESULTS_DIR when
set, else `benchmarks/results/` of the project holding the current directory (the committed
ledger; `make bench` writes there on request); nothing is written beside the installed package.
"""
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from minillm.kernels.cpu_kernels import cpu_name
from minillm.model.loading import default_device
from minillm.viz.plotting import project_root

RESULTS_ENV = "MINILLM_RESULTS_DIR"


def results_dir() -> Path:
    """Where benchmark records are written and read by default (see the module docstring)."""
    chosen = os.environ.get(RESULTS_ENV)
    if not chosen:
        return project_root() / "benchmarks" / "results"
    path = Path(chosen).expanduser()
    return path if path.is_absolute() else project_root() / path


def __getattr__(name):          # RESULTS_DIR: the name of earlier versions, resolved when read
    if name == "RESULTS_DIR":
        return results_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def git_commit() -> str:
    """Short hash of HEAD, with "+dirty" when minillm/ has uncommitted changes (the code measured
    is then not the commit named)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, text=True, capture_output=True,
                              timeout=5).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "minillm") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(device=None) -> dict:
    """What the numbers were measured on."""
    device = torch.device(device) if device is not None else default_device()
    info = {"device": device.type, "cpu": cpu_name(), "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info["device_name"] = info["cpu"]
    return info


def device_tag(device) -> str:
    """'cpu' or a short GPU name like 'h200', used in result file names."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for known in ("h200", "h100", "a100", "l4", "a10", "t4"):
        if known in name:
            return known
    return "cuda"


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


def write_result(name: str, payload: dict, device="cpu", out_dir=None) -> Path:
    """Write payload + machine metadata to <out_dir>/<name>_<device-tag>.json; return the path."""
    out = Path(out_dir) if out_dir is not None else results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{device_tag(device)}.json"
    record = {"benchmark": name, "machine": machine_info(device), **payload}
    path.write_text(json.dumps(record, indent=1, default=float) + "\n")
    return path


def save_figure_beside(fig, record_path, stem: str) -> Path:
    """Write `fig` as <stem>_<device-tag>.png next to a record written by `write_result`."""
    record_path = Path(record_path)
    path = record_path.parent / f"{stem}_{record_path.stem.rsplit('_', 1)[1]}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    return path


_default_results = results_dir          # load_results' parameter shadows the function's name


def load_results(name: str | None = None, results_dir=None) -> list[dict]:
    """Every committed result (optionally of one benchmark), for notebooks and the README table."""
    folder = Path(results_dir) if results_dir is not None else _default_results()
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return [r for r in records if name is None or r.get("benchmark") == name]


def prefilled(model, batch: int, context: int, room: int, cache_cls=None):
    """A contiguous cache holding `context` tokens in each of `batch` rows with `room` free slots
    after them, and `forward(x)`, which runs the model on new tokens x (B, n) at positions
    context..context+n-1. Each call overwrites the last one's slots, so a timing loop repeats the
    same step. -> (cache, forward)."""
    from minillm.model.kv_cache import KVCache
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

