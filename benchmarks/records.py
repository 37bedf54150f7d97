"""Where benchmark records go, and what each one says about the machine it ran on.

Every benchmark writes `<results_dir()>/<name>_<device-tag>.json` holding the machine it ran
on, the git commit, and its figures with units, so the results table and the notebooks can quote
numbers together with the hardware they came from. `results_dir()` is $MINILLM_RESULTS_DIR when
set (a relative path is taken from the checkout), else `benchmarks/results/` beside this package:
the committed records, which `make bench` rewrites on request. The chapters read them through
`minillm.lab.common.load_results`.

Left out on purpose: history (the latest run of a benchmark on a device overwrites its file).
"""
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from minillm.kernels.cpu_kernels import cpu_name
from minillm.lab.common import RESULTS_ENV
from minillm.model.loading import default_device

REPO_ROOT = Path(__file__).resolve().parents[1]      # the checkout: benchmarks/ sits at its top


def results_dir() -> Path:
    """Where records are written by default (see the module docstring)."""
    chosen = os.environ.get(RESULTS_ENV)
    if not chosen:
        return REPO_ROOT / "benchmarks" / "results"
    path = Path(chosen).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def git_commit() -> str:
    """Short hash of HEAD, with "+dirty" when minillm/ has uncommitted changes (the code measured
    is then not the commit named)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, text=True, capture_output=True,
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
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
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
