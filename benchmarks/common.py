"""What several benchmarks share: the Titanic logistic regression and the log-log figure of a results file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist

matplotlib.use("Agg")


def logistic_regression(x, y):
    """The README's logistic regression: ``Normal(0, 1)`` coefficients, data read through the plate."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


def save_log_log_figure(path: Path, draw: Callable, xlabel: str, ylabel: str) -> None:
    """A 6 x 4 inch figure on log-log axes: ``draw(axis)`` plots the labelled series; saved at ``path``."""
    figure, axis = plt.subplots(figsize=(6, 4))
    draw(axis)
    axis.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
