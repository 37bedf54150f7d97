"""Figure helpers shared by the chapters: every plot is built by a function that returns a
`Figure`, and `save_figure` writes it as <name>.png at a fixed dpi with no timestamp, so
re-running a notebook rewrites the same bytes when the data are the same.

Where figures go: running the notebooks (`make test`) or the demo must not rewrite committed
files, so by default `save_figure` writes to `build/figures/` (ignored by git) of the source
checkout that holds this package, found from the package's own files (`minillm._paths`), not from
the current directory: a notebook run from notebooks/ and a script run from anywhere write to the
same place.
An installed package (a wheel, no checkout around it) writes to build/figures/ of the current
directory instead. The committed `figures/` is written only on request:
`MINILLM_FIGURES_DIR=figures` (any folder; a relative one is taken from that same base), which is
what `make figures` sets.
"""
import os
from pathlib import Path

import matplotlib

from minillm._paths import project_root

FIGURES_ENV = "MINILLM_FIGURES_DIR"


def figures_dir() -> Path:
    """Where `save_figure` writes: $MINILLM_FIGURES_DIR if set, else <project_root()>/build/figures."""
    chosen = os.environ.get(FIGURES_ENV)
    if not chosen:
        return project_root() / "build" / "figures"
    path = Path(chosen).expanduser()
    return path if path.is_absolute() else project_root() / path


def save_figure(fig, name: str, dpi: int = 110) -> Path:
    """Write `fig` to <figures_dir()>/<name>.png and return the path."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like 'roofline', got {name!r}")
    folder = figures_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path


def use_headless_backend() -> None:
    """Scripts (demo, benchmarks) draw without a display."""
    matplotlib.use("Agg")
