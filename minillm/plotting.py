"""Figure helpers shared by the chapters: every plot is built by a function that returns a
`Figure`, and `save_figure` writes it to `figures/<name>.png` at a fixed dpi with no timestamp,
so re-running a notebook rewrites the same bytes when the data are the same."""
from pathlib import Path

import matplotlib

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURES = REPO_ROOT / "figures"


def save_figure(fig, name: str, dpi: int = 110) -> Path:
    """Write `fig` to figures/<name>.png (path from the repo root) and return the path."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like 'roofline', got {name!r}")
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path


def use_headless_backend() -> None:
    """Scripts (demo, benchmarks) draw without a display."""
    matplotlib.use("Agg")
