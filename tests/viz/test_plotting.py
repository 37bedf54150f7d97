"""save_figure: running notebooks and the demo must not rewrite the committed figures/.

By default figures go to build/figures/ of the checkout holding the package, wherever the current
directory is (an installed package: of the current directory); the committed folder is written
only when MINILLM_FIGURES_DIR asks for it (`make figures`)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from minillm import _paths
from minillm._paths import checkout_root, project_root
from minillm.viz.plotting import FIGURES_ENV, figures_dir, save_figure


@pytest.fixture
def fig():
    f, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    yield f
    plt.close(f)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fake checkout (pyproject.toml, the package, committed figures/, notebooks/) holding the
    package, entered from notebooks/, where nbval starts the kernels."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for folder in ("minillm", "figures", "notebooks"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(_paths, "PACKAGE_DIR", tmp_path / "minillm")
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.delenv(FIGURES_ENV, raising=False)
    return tmp_path


def test_default_goes_to_build_not_to_committed_figures(project, fig):
    path = save_figure(fig, "demo")
    assert path == project / "build" / "figures" / "demo.png"
    assert path.read_bytes().startswith(b"\x89PNG")
    assert list((project / "figures").iterdir()) == []


def test_env_var_folder_is_used(project, fig, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.setenv(FIGURES_ENV, str(elsewhere))
    assert save_figure(fig, "demo") == elsewhere / "demo.png"
    assert (elsewhere / "demo.png").is_file()
    assert not (project / "build").exists() and list((project / "figures").iterdir()) == []


def test_relative_env_var_is_taken_from_the_project_root(project, fig, monkeypatch):
    monkeypatch.setenv(FIGURES_ENV, "figures")          # what `make figures` means
    assert save_figure(fig, "demo") == project / "figures" / "demo.png"
    assert not (project / "notebooks" / "figures").exists()


def test_the_checkout_holding_the_package_wins_over_the_cwd(project, fig, tmp_path_factory, monkeypatch):
    other = tmp_path_factory.mktemp("other_project")
    (other / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    monkeypatch.chdir(other)                            # a script run from another project
    assert checkout_root() == project
    assert save_figure(fig, "demo") == project / "build" / "figures" / "demo.png"
    assert not (other / "build").exists()


def test_an_installed_package_uses_the_current_directory(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / "minillm").mkdir(parents=True)              # no pyproject.toml above it
    monkeypatch.setattr(_paths, "PACKAGE_DIR", site / "minillm")
    monkeypatch.chdir(tmp_path)                         # e.g. an installed package run from ~
    monkeypatch.delenv(FIGURES_ENV, raising=False)
    assert checkout_root() is None and project_root() == tmp_path
    assert figures_dir() == tmp_path / "build" / "figures"


def test_same_figure_same_bytes(project, fig):
    first = save_figure(fig, "again").read_bytes()
    assert save_figure(fig, "again").read_bytes() == first       # no timestamp in the file


@pytest.mark.parametrize("bad", ["", "a/b", "x.png"])
def test_bad_names_are_rejected(bad, fig):
    with pytest.raises(ValueError, match="bare file stem"):
        save_figure(fig, bad)
