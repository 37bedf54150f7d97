"""save_figure: running notebooks and the demo must not rewrite the committed figures/.

By default figures go to build/figures/ of the project holding the current directory; the
committed folder is written only when MINILLM_FIGURES_DIR asks for it (`make figures`)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from minillm.viz.plotting import FIGURES_ENV, figures_dir, project_root, save_figure


@pytest.fixture
def fig():
    f, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    yield f
    plt.close(f)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fake checkout (pyproject.toml, committed figures/, notebooks/) entered from notebooks/,
    where nbval starts the kernels."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "figures").mkdir()
    (tmp_path / "notebooks").mkdir()
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


def test_outside_a_project_the_current_directory_is_used(tmp_path, monkeypatch):
    if any((d / m).exists() for d in tmp_path.parents for m in ("pyproject.toml", ".git")):
        pytest.skip("the temporary folder lies inside a project")
    monkeypatch.chdir(tmp_path)                         # e.g. an installed package run from ~
    monkeypatch.delenv(FIGURES_ENV, raising=False)
    assert project_root() == tmp_path
    assert figures_dir() == tmp_path / "build" / "figures"


def test_same_figure_same_bytes(project, fig):
    first = save_figure(fig, "again").read_bytes()
    assert save_figure(fig, "again").read_bytes() == first       # no timestamp in the file


@pytest.mark.parametrize("bad", ["", "a/b", "x.png"])
def test_bad_names_are_rejected(bad, fig):
    with pytest.raises(ValueError, match="bare file stem"):
        save_figure(fig, bad)
