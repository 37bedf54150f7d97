"""Where the package's own checkout is: the base of the data paths that are not package data
(committed benchmark records, figures written by the notebooks and the demo).

A source checkout holds the package in minillm/ beside its pyproject.toml (an editable install, or
a clone on PYTHONPATH); an installed wheel sits in site-packages, which holds no pyproject.toml.
The paths come from this file's location, never from the current directory, so a notebook run
from notebooks/ and a script run from anywhere find the same checkout.
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent          # minillm/


def checkout_root() -> Path | None:
    """The source checkout holding this package, or None for an installed package."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def project_root() -> Path:
    """`checkout_root()`, else the current directory: the base of relative data paths."""
    return checkout_root() or Path.cwd()
