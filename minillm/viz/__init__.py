"""Figures and widgets for the notebooks: each plot function takes data and returns a Figure;
`plotting.save_figure` writes it. The core never imports this package. matplotlib and ipywidgets
come with the `viz` extra (`pip install "minillm[viz]"`); without it this import says so."""
try:
    import matplotlib  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"minillm.viz needs {e.name}, which comes with the 'viz' extra: "
                              f"pip install \"minillm[viz]\"", name=e.name) from e
