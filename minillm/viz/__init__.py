"""Figures and widgets for the notebooks: each plot function takes data and returns a Figure;
`plotting.save_figure` writes it. The core never imports this package."""
