"""Chapter 6's new theory helper and figures: accepted_law against brute-force enumeration, and the
benchmark figure names what each prediction is computed from."""
from itertools import product

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from minillm.analysis.spec_theory import accepted_law
from minillm.lab.common import load_results
from minillm.viz.spec import plot_accepted_histogram, plot_spec_benchmark


@pytest.mark.parametrize("a,k", [(0.3, 1), (0.8, 4), (0.95, 6), (0.0, 3), (1.0, 3)])
def test_accepted_law_is_leading_accepts_of_k_coins(a, k):
    want = torch.zeros(k + 1, dtype=torch.float64)
    for coins in product([0, 1], repeat=k):            # every accept/reject pattern of K drafts
        n = next((i for i, c in enumerate(coins) if not c), k)
        want[n] += a ** sum(coins) * (1 - a) ** (k - sum(coins))
    assert torch.allclose(accepted_law(a, k), want, atol=1e-12)


def test_accepted_law_bad_input():
    with pytest.raises(ValueError):
        accepted_law(1.5, 3)
    with pytest.raises(ValueError):
        accepted_law(0.5, -1)


def test_benchmark_figure_labels_its_predictions():
    records = load_results("spec")
    if not records:
        pytest.skip("no committed spec record")
    fig = plot_spec_benchmark(records[0])
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert "predicted from alpha, c, v" in labels and "predicted from the steps run, c, v" in labels
    assert "predicted" not in labels                    # no unlabelled prediction


def test_histogram_figure():
    fig = plot_accepted_histogram({"x": [0, 8, 8, 1]}, {"x": accepted_law(0.8, 8).tolist()}, 8)
    assert len(fig.axes) == 1
    plt.close(fig)
