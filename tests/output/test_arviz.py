"""to_inference_data: real ArviZ objects, and ArviZ's own functions on them."""

import arviz as az
import matplotlib
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS

import pyro_fed
from pyro_fed import FaldKernel

from ..models import gaussian_regression, logistic_model, regression_data, scaled_regression

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def fald_run():
    torch.set_default_dtype(torch.float64)
    x, y = regression_data(60)
    labels = (y > 0).double()
    pyro.set_rng_seed(1)
    kernel = FaldKernel(
        logistic_model,
        torch.arange(60) % 3,
        step_size=0.03,
        comm_prob=0.5,
        batch_size=8,
        gradient_mode="traced",
    )
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=50, num_chains=2, disable_progbar=True)
    mcmc.run(x, labels)
    return mcmc, x, labels


@pytest.fixture(scope="module")
def idata(fald_run):
    return pyro_fed.to_inference_data(fald_run[0], log_likelihood=True, posterior_predictive=True)


def test_groups_and_shapes(idata, fald_run):
    mcmc, x, labels = fald_run
    assert isinstance(idata, az.InferenceData)
    assert set(idata.groups()) == {
        "posterior",
        "sample_stats",
        "log_likelihood",
        "observed_data",
        "posterior_predictive",
    }
    assert idata.posterior["w"].shape == (2, 200, 3)
    np.testing.assert_array_equal(
        idata.posterior["w"].values, mcmc.get_samples(group_by_chain=True)["w"].numpy()
    )
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "data")
    assert idata.log_likelihood["y"].shape == (2, 200, 60)
    assert idata.posterior_predictive["y"].shape == (2, 200, 60)
    np.testing.assert_array_equal(idata.observed_data["y"].values, labels.numpy())


def test_sample_stats(idata, fald_run):
    stats = idata.sample_stats
    assert {"diverging", "communicated", "uploaded_bits", "dispersion"} <= set(stats.data_vars)
    assert stats["diverging"].dtype == bool and stats["communicated"].dtype == bool
    bits = stats["uploaded_bits"].values
    assert (np.diff(bits, axis=1) >= 0).all()  # cumulative
    # a bit count grows exactly on communication rounds: 3 clients x 3 floats x 32 bits
    np.testing.assert_array_equal(np.diff(bits, axis=1), 3 * 3 * 32 * stats["communicated"].values[:, 1:])


def test_log_likelihood_is_the_models(idata, fald_run):
    _, x, labels = fald_run
    w = torch.as_tensor(idata.posterior["w"].values[0, :5])
    expected = torch.distributions.Bernoulli(logits=w @ x.T).log_prob(labels)
    np.testing.assert_allclose(idata.log_likelihood["y"].values[0, :5], expected.numpy(), rtol=1e-10)


def test_arviz_functions(idata):
    summary = az.summary(idata)
    assert list(summary.index) == ["w[0]", "w[1]", "w[2]"]
    assert np.isfinite(summary["r_hat"]).all()
    hdi = az.hdi(idata)
    assert hdi["w"].shape == (3, 2)
    assert (hdi["w"].values[:, 0] < hdi["w"].values[:, 1]).all()
    loo = az.loo(idata)
    assert np.isfinite(loo.elpd_loo) and loo.n_data_points == 60
    axes = az.plot_ppc(idata, num_pp_samples=20)
    assert axes is not None


def test_constrained_sites_and_from_pyro():
    x, y = regression_data(30)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(
        scaled_regression, torch.arange(30) % 3, step_size=3e-3, batch_size=5, gradient_mode="traced"
    )
    mcmc = MCMC(kernel, num_samples=50, warmup_steps=20, disable_progbar=True)
    mcmc.run(x, y)
    data = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    assert (data.posterior["sigma"].values > 0).all()  # mapped back through the HalfNormal's transform
    # replicates of a Normal likelihood: real-valued, and spread around the observations
    replicates = data.posterior_predictive["y"].values
    assert replicates.shape == (1, 50, 30) and len(np.unique(replicates)) == replicates.size
    # Pyro's own converter works too, since diagnostics carry "divergences"
    assert az.from_pyro(mcmc).sample_stats["diverging"].shape == (1, 50)


def test_pyro_reference_run_converts_with_the_same_groups():
    # the reference of a federated run: NUTS on the pooled data, whose model reads its data through
    # pyro.subsample (arviz.from_pyro cannot vectorise such a model and leaves log_likelihood out)
    x, y = regression_data(20)
    pyro.set_rng_seed(0)
    kernel = NUTS(gaussian_regression(0.5))
    mcmc = MCMC(kernel, num_samples=15, warmup_steps=10, num_chains=2, disable_progbar=True)
    mcmc.run(x, y)
    data = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    w = mcmc.get_samples(group_by_chain=True)["w"]
    # the pointwise log-likelihood, by hand: log N(y_j; x_j w, 0.5^2) for every draw
    expected = dist.Normal(w @ x.T, 0.5).log_prob(y)
    np.testing.assert_allclose(data.log_likelihood["y"].values, expected.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(data.observed_data["y"].values, y.numpy())
    assert data.posterior_predictive["y"].shape == (2, 15, 20)
    diverging = np.zeros((2, 15), dtype=bool)
    for c in range(2):
        diverging[c, mcmc.diagnostics()["divergences"][f"chain {c}"]] = True
    np.testing.assert_array_equal(data.sample_stats["diverging"].values, diverging)
    assert np.isfinite(az.loo(data).elpd_loo)


def test_rejects_kernels_without_a_model():
    x, y = regression_data(20)

    def potential_fn(params):
        return params["w"].square().sum() / 2

    kernel = NUTS(potential_fn=potential_fn)
    mcmc = MCMC(kernel, num_samples=3, warmup_steps=2, initial_params={"w": torch.zeros(3)})
    mcmc.run(x, y)
    with pytest.raises(TypeError, match="without a model. Use arviz.from_pyro"):
        pyro_fed.to_inference_data(mcmc)


def run_kernel(model, args, **options):
    pyro.set_rng_seed(2)
    kernel = FaldKernel(model, 3, step_size=1e-4, batch_size=5, gradient_mode="traced", **options)
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=5, disable_progbar=True)
    mcmc.run(*args)
    return mcmc


def test_dims_follow_the_plate_and_log_likelihood_is_unscaled():
    # two measurements per datum, the data plate the rightmost batch dimension: y is [2, N]
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0], dim=-1) as idx, pyro.plate("repeats", 2, dim=-2):
            with pyro.poutine.scale(scale=3.0):  # weighs the likelihood; not part of ArviZ's log-likelihood
                pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=y[:, idx])

    x, _ = regression_data(30)
    y = torch.stack([x.sum(-1), x.sum(-1) + 0.1])
    mcmc = run_kernel(model, (x, y), plate="data")
    idata = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    assert idata.observed_data["y"].dims == ("y_dim_0", "data")
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "y_dim_0", "data")
    assert idata.posterior_predictive["y"].dims == ("chain", "draw", "y_dim_0", "data")
    w = torch.as_tensor(idata.posterior["w"].values[0, -1])
    expected = dist.Normal(x @ w, 1.0).log_prob(y)  # plain log_prob, no factor 3
    torch.testing.assert_close(torch.as_tensor(idata.log_likelihood["y"].values[0, -1]), expected)
