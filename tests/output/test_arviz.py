"""to_inference_data: real ArviZ objects, and ArviZ's own functions on them."""

import warnings

import arviz as az
import matplotlib
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import MCMC, NUTS
from pyro.infer.reparam import LocScaleReparam

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


def regression_tutorial(africa, rugged, log_gdp=None):
    """The shape of Pyro's "Bayesian regression" tutorial, as written for NUTS: scalar coefficients, the
    mean at full size before the plate (which Predictive can vectorise over draws)."""
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b_a = pyro.sample("bA", dist.Normal(0.0, 1.0))
    b_r = pyro.sample("bR", dist.Normal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
    mean = a + b_a * africa + b_r * rugged
    with pyro.plate("data", len(rugged)):
        pyro.sample("obs", dist.Normal(mean, sigma), obs=log_gdp)


def test_az_from_pyro_carries_the_log_likelihood_of_a_model_it_can_vectorise_and_az_loo_runs():
    g = torch.Generator().manual_seed(0)
    africa = (torch.rand(60, generator=g) < 0.3).double()
    rugged = 3 * torch.rand(60, generator=g).double()
    log_gdp = 9 - 1.5 * africa - 0.2 * rugged + 0.5 * torch.randn(60, generator=g).double()
    pyro.set_rng_seed(0)
    mcmc = MCMC(FaldKernel(regression_tutorial, 3), num_samples=100, warmup_steps=50, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run: the end-of-run checks' notice is not what is tested
        mcmc.run(africa, rugged, log_gdp)
    converted = az.from_pyro(mcmc)
    ours = pyro_fed.to_inference_data(mcmc, log_likelihood=True)
    # ArviZ's own vectorised evaluation of the model at the draws: the log-likelihood pyro_fed computes
    np.testing.assert_allclose(
        converted.log_likelihood["obs"].values, ours.log_likelihood["obs"].values, rtol=1e-10
    )
    loo = az.loo(converted)
    assert np.isfinite(loo.elpd_loo) and loo.n_data_points == 60


def test_the_posterior_holds_the_deterministic_sites_and_the_reparametrised_ones():
    # a pyro.deterministic outside the plate and the effects LocScaleReparam computes from the sampled
    # a_decentered, at every draw, as NumPyro's samples hold them (a deterministic in the plate is per datum:
    # not a posterior quantity)
    def model(group, y):
        scale = pyro.sample("scale", dist.HalfNormal(2.0))
        with pyro.plate("groups", 3):
            a = pyro.sample("a", dist.Normal(1.0, scale))
        pyro.deterministic("spread", a.max() - a.min())
        with pyro.plate("data", len(y)) as idx:
            pyro.deterministic("fitted", a[group[idx]])
            pyro.sample("y", dist.Normal(a[group[idx]], 1.0), obs=y[idx])

    reparametrised = poutine.reparam(model, config={"a": LocScaleReparam(centered=0.0)})
    group = torch.arange(12) % 3
    y = group.double() + torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(reparametrised, 3, step_size=0.01, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=5, num_chains=2, disable_progbar=True)
    mcmc.run(group, y)
    posterior = pyro_fed.to_inference_data(mcmc).posterior
    assert set(posterior.data_vars) == {"scale", "a_decentered", "a", "spread"}
    a = 1.0 + posterior["scale"].values[..., None] * posterior["a_decentered"].values
    np.testing.assert_allclose(posterior["a"].values, a, rtol=1e-12)
    np.testing.assert_allclose(posterior["spread"].values, a.max(-1) - a.min(-1), rtol=1e-12)


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


@pytest.mark.parametrize("num_samples", [1, 3])
def test_a_short_run_converts_with_a_warning_naming_its_draws(num_samples):
    # Pyro's mcmc.diagnostics() asserts 4 draws per chain (split R-hat): a short run still converts
    x, y = regression_data(20)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(logistic_model, 2, step_size=0.03, batch_size=5, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=3, num_chains=2, disable_progbar=True)
    mcmc.run(x, (y > 0).double())
    with pytest.warns(UserWarning, match=f"{num_samples} draws? per chain: converted, but split R-hat"):
        data = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    assert data.posterior["w"].shape == (2, num_samples, 3)
    assert data.sample_stats["uploaded_bits"].shape == (2, num_samples)
    assert data.log_likelihood["y"].shape == data.posterior_predictive["y"].shape == (2, num_samples, 20)


def test_a_short_pyro_reference_run_converts():
    x, y = regression_data(10)
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(gaussian_regression(0.5)), num_samples=3, warmup_steps=2, disable_progbar=True)
    mcmc.run(x, y)
    with pytest.warns(UserWarning, match="3 draws per chain"):
        data = pyro_fed.to_inference_data(mcmc)
    assert data.sample_stats["diverging"].shape == data.log_likelihood["y"].shape[:2] == (1, 3)


def test_a_long_enough_run_converts_without_the_warning(fald_run):
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pyro_fed.to_inference_data(fald_run[0], log_likelihood=False)
    assert not [r for r in record if "draws per chain" in str(r.message)]


def test_the_kernel_or_another_object_is_refused_saying_what_to_pass(fald_run):
    mcmc = fald_run[0]
    usage = (
        "to_inference_data takes the pyro.infer.MCMC object that ran the kernel (mcmc = MCMC(kernel, ...); "
        "mcmc.run(...); to_inference_data(mcmc)); got "
    )
    cases = [
        (mcmc.kernel, "the kernel itself, a FaldKernel."),
        (NUTS(logistic_model), "the kernel itself, a NUTS."),
        (mcmc.get_samples(), "a dict (draws by site? arviz.from_dict converts those)."),
        (logistic_model, "a function, 'logistic_model' (the model? build a kernel and an MCMC from it)."),
        (az.from_dict({"w": np.zeros((1, 4))}), "an InferenceData, which is already ArviZ data."),
        (None, "a NoneType."),
    ]
    for wrong, said in cases:
        with pytest.raises(TypeError) as error:
            pyro_fed.to_inference_data(wrong)
        assert str(error.value) == usage + said


def test_an_mcmc_object_that_has_not_run_is_refused(fald_run):
    mcmc = fald_run[0]
    # a kernel that has run elsewhere, in an MCMC object not run yet
    for kernel in (mcmc.kernel, FaldKernel(logistic_model)):
        unrun = MCMC(kernel, num_samples=5, warmup_steps=2, disable_progbar=True)
        with pytest.raises(ValueError, match=r"has not run: call mcmc.run\(\*model_args\) first"):
            pyro_fed.to_inference_data(unrun)


def factor_likelihood(with_sample_site):
    """A regression whose likelihood in the plate is a pyro.factor (its normalised log-density), beside an
    observed sample site or alone."""

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            if with_sample_site:
                pyro.sample("z", dist.Normal(x[idx, 0] * w[0], 1.0), obs=y[idx] - 1)
            pyro.factor("f", dist.Normal(x[idx] @ w, 0.5).log_prob(y[idx]))

    return model


def test_factor_sites_left_out_of_the_posterior_predictive_with_a_warning():
    x, y = regression_data(20)
    mcmc = run_kernel(factor_likelihood(True), (x, y))
    with pytest.warns(UserWarning, match="the pyro.factor site 'f' of the plate 'data' left out") as record:
        data = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    assert "replicates of 'z' only" in str(next(r for r in record if "pyro.factor" in str(r.message)).message)
    assert list(data.posterior_predictive.data_vars) == ["z"]
    assert data.posterior_predictive["z"].shape == (1, 20, 20)
    assert list(data.observed_data.data_vars) == ["z"]  # a factor observes nothing
    # the factor's pointwise log-likelihood is its value, by hand
    w = torch.as_tensor(data.posterior["w"].values[0])
    np.testing.assert_allclose(
        data.log_likelihood["f"].values[0], dist.Normal(w @ x.T, 0.5).log_prob(y).numpy(), rtol=1e-10
    )
    assert data.log_likelihood["f"].dims == ("chain", "draw", "data")
    assert np.isfinite(az.loo(data, var_name="f").elpd_loo)


def test_a_likelihood_of_factors_only_refuses_the_posterior_predictive_and_gives_the_log_likelihood():
    x, y = regression_data(20)
    mcmc = run_kernel(factor_likelihood(False), (x, y))
    with pytest.raises(ValueError, match="posterior_predictive=True needs observed sample sites") as error:
        pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
    assert "pyro.factor only ('f')" in str(error.value) and "posterior_predictive=False" in str(error.value)
    data = pyro_fed.to_inference_data(mcmc)
    assert data.log_likelihood["f"].shape == (1, 20, 20)
    assert "observed_data" not in data.groups()


def test_four_chains_two_likelihood_sites_a_masked_one_and_an_event_dimension():
    # what a new user tries: every group on 4 chains, two likelihoods (one with obs_mask, NaN where
    # missing), a multivariate observation
    x, y = regression_data(20)
    observed = torch.arange(20) % 4 != 0
    counts = torch.poisson(torch.exp(0.3 * x[:, 0]), generator=torch.Generator().manual_seed(0))
    pairs = torch.stack([y, -y], -1)

    def model(x, y, counts, pairs):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            mean = x[idx] @ w
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y[idx].nan_to_num(), obs_mask=observed[idx])
            pyro.sample("c", dist.Poisson(torch.exp(0.3 * x[idx, 0])), obs=counts[idx])
            pyro.sample(
                "p", dist.MultivariateNormal(torch.stack([mean, -mean], -1), torch.eye(2)), obs=pairs[idx]
            )

    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, 2, step_size=1e-3, batch_size=5, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=10, warmup_steps=5, num_chains=4, disable_progbar=True)
    mcmc.run(x, torch.where(observed, y, torch.nan), counts, pairs)
    data = pyro_fed.to_inference_data(mcmc, log_likelihood=True, posterior_predictive=True)
    assert data.posterior["w"].shape == (4, 10, 3)
    likelihood, replicates, seen = data.log_likelihood, data.posterior_predictive, data.observed_data
    assert (
        set(likelihood.data_vars)
        == set(replicates.data_vars)
        == set(seen.data_vars)
        == {"y_observed", "c", "p"}
    )
    # the masked site: only its 15 observed data, indexed by their positions
    assert likelihood["y_observed"].dims == ("chain", "draw", "y_observed_data")
    np.testing.assert_array_equal(likelihood["y_observed_data"].values, np.flatnonzero(observed.numpy()))
    assert replicates["y_observed"].shape == (4, 10, 15) and seen["y_observed"].shape == (15,)
    np.testing.assert_array_equal(seen["y_observed"].values, y[observed].numpy())
    assert likelihood["c"].shape == replicates["c"].shape == (4, 10, 20)
    # the event dimension: one log-density per datum, replicates with the observation's shape
    assert likelihood["p"].dims == ("chain", "draw", "data") and likelihood["p"].shape == (4, 10, 20)
    assert replicates["p"].dims == ("chain", "draw", "data", "p_dim_1") and replicates["p"].shape == (
        4,
        10,
        20,
        2,
    )
    w = torch.as_tensor(data.posterior["w"].values[3, -1])
    expected = dist.MultivariateNormal(torch.stack([x @ w, -(x @ w)], -1), torch.eye(2)).log_prob(pairs)
    np.testing.assert_allclose(likelihood["p"].values[3, -1], expected.numpy(), rtol=1e-10)
    for name in ("y_observed", "c", "p"):
        assert np.isfinite(az.loo(data, var_name=name).elpd_loo)
