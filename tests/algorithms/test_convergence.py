"""End-of-run checks: the figures agree with ArviZ's, a stuck chain is named, a healthy run is silent."""

import warnings

import arviz as az
import numpy as np
import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel
from pyro_fed.algorithms import convergence

from ..models import gaussian_regression, regression_data


def autoregression(chains, draws, dim, rho, seed=0):
    """Independent AR(1) chains x_t = rho x_(t-1) + e_t, [chains, draws, dim]."""
    rng = np.random.default_rng(seed)
    x, noise = np.zeros((chains, draws, dim)), rng.standard_normal((chains, draws, dim))
    for t in range(1, draws):
        x[:, t] = rho * x[:, t - 1] + noise[:, t]
    return x


@pytest.mark.parametrize(
    "draws",
    [
        autoregression(4, 1000, 5, 0.9),
        autoregression(4, 1000, 5, -0.3),  # antithetic: ESS above the number of draws
        autoregression(2, 101, 3, 0.99),  # an odd number of draws, strongly autocorrelated
        autoregression(3, 30, 2, 0.0) + np.arange(3)[:, None, None],  # chains at different places
        np.round(np.random.default_rng(1).standard_normal((4, 300, 2))),  # ties: discrete values
    ],
)
def test_rhat_and_ess_are_arviz_s(draws):
    # the same estimators (rank normalisation, folding, split chains, Geyer's monotone sequence): equal to
    # rounding
    dataset = az.convert_to_dataset({"x": draws})
    np.testing.assert_allclose(
        convergence.rhat(draws), az.rhat(dataset, method="rank")["x"].values, rtol=1e-10
    )
    np.testing.assert_allclose(
        convergence.ess_bulk(draws), az.ess(dataset, method="bulk")["x"].values, rtol=1e-10
    )
    np.testing.assert_allclose(
        convergence.ess_tail(draws), az.ess(dataset, method="tail")["x"].values, rtol=1e-10
    )


def test_the_check_names_the_worst_coordinates():
    healthy = autoregression(4, 1000, 3, 0.5, seed=2)
    assert convergence.check(healthy, ["a", "b", "c"]).problems == []
    # one chain stuck elsewhere on b, one coordinate that never moves
    stuck = healthy.copy()
    stuck[0, :, 1] = 0.01 * stuck[0, :, 1] + 5.0
    stuck[:, :, 2] = 1.0
    report = convergence.check(stuck, ["a", "b", "c"])
    # (rank-normalised R-hat is bounded: one of four chains wholly apart gives about 1.5)
    assert report.rhat[1] > 1.2 and report.rhat[2] == np.inf and report.rhat[0] < 1.01
    rhat, bulk, tail = report.problems
    assert rhat.startswith("R-hat above 1.01 for 2 of 3 coordinates (worst: c (inf), b (")
    assert "bulk ESS below 100 per chain (400 for 4 chains)" in bulk and "c (0)" in bulk
    assert "tail ESS" in tail and "a (" not in rhat + bulk + tail
    # too few draws to say anything
    assert convergence.check(healthy[:, :5], ["a", "b", "c"]).problems == [
        "5 draws per chain: too few to check"
    ]


def test_a_run_of_frozen_chains_warns_once_and_a_healthy_run_is_silent():
    x, y = regression_data(60)
    model = gaussian_regression(0.5)
    pyro.set_rng_seed(0)
    # draws about half an autocorrelation time apart (the automatic thinning): 0.5 effective draws each
    healthy = MCMC(FaldKernel(model, 3), num_samples=500, warmup_steps=50, num_chains=2, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning of ours
        healthy.run(x, y)
    figures = healthy.kernel.end_of_run_checks
    assert healthy.diagnostics()["end-of-run checks"] == {"chain 0": "passed", "chain 1": "passed"}
    assert figures["problems"] == [] and set(figures["r_hat"]) == {"w[0]", "w[1]", "w[2]"}
    assert all(value < 1.01 for value in figures["r_hat"].values())
    # a step a thousand times too small: the chains stay where they started
    pyro.set_rng_seed(0)
    frozen = MCMC(
        FaldKernel(model, 3, step_size=1e-6, init_strategy=pyro.infer.autoguide.init_to_sample),
        num_samples=200,
        warmup_steps=0,
        num_chains=2,
        disable_progbar=True,
    )
    with pytest.warns(UserWarning, match="end-of-run checks") as record:
        frozen.run(x, y)
    messages = [str(w.message) for w in record if "end-of-run" in str(w.message)]
    assert len(messages) == 1 and "R-hat above 1.01 for 3 of 3" in messages[0]
    assert frozen.kernel.end_of_run_checks["problems"][0].startswith("R-hat")
    assert frozen.diagnostics()["end-of-run checks"]["chain 0"][0].startswith("R-hat")


def test_coordinate_names_follow_the_sites():
    def model(x, y=None):
        pyro.sample("b", pyro.distributions.Normal(0.0, 1.0))
        pyro.sample("w", pyro.distributions.Normal(0.0, 1.0).expand([2, 2]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", pyro.distributions.Normal(0.0, 1.0), obs=pyro.subsample(y, event_dim=0))

    x, y = regression_data(10)
    kernel = FaldKernel(model, 2, step_size=0.01)
    kernel.setup(0, x, y)
    assert kernel.potential.space.coordinate_names == ["b", "w[0, 0]", "w[0, 1]", "w[1, 0]", "w[1, 1]"]
    assert torch.Size([5]) == kernel.potential.initial_flat.shape
