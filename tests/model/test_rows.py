"""Models written for NUTS (data read at full size) run unchanged: each client's potential is the model run on
its rows of the data arguments, the same potential and the same draws as the model written with
``pyro.subsample``; data that cannot be split are refused before the warm-up, by site, plate and fix."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, Predictive
from pyro.nn import PyroModule, PyroSample

from pyro_fed import (
    DglmcKernel,
    DulaKernel,
    FaldKernel,
    FsgldKernel,
    PsgldKernel,
    QlsdKernel,
    SgldKernel,
    SvrgLdKernel,
    VrFaldKernel,
    consensus,
    to_inference_data,
)
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.model.rows import DataRows

from ..models import logistic_data, logistic_model, logistic_model_for_nuts, regression_data

NUM_CLIENTS = 3


def run(model, kernel_class, args, kwargs=None, num_samples=20, warmup_steps=20, **options):
    # the centralised baselines (SGLD, SVRG-LD) take no clients
    clients = () if kernel_class in (SgldKernel, SvrgLdKernel) else (NUM_CLIENTS,)
    mcmc = MCMC(
        kernel_class(model, *clients, **options),
        num_samples=num_samples,
        warmup_steps=warmup_steps,
        num_chains=2,
        disable_progbar=True,
    )
    pyro.set_rng_seed(0)
    with warnings.catch_warnings():  # short runs: the end-of-run checks' notices are not what is tested
        warnings.simplefilter("ignore")
        mcmc.run(*args, **(kwargs or {}))
    return mcmc


KERNELS = {
    "FALD": (FaldKernel, {}),
    "VR-FALD*": (VrFaldKernel, {}),
    "QLSD": (QlsdKernel, {}),
    "QLSD++ automatic levels": (QlsdKernel, {"control_variate": "svrg", "quantization_levels": "auto"}),
    "D-ULA": (DulaKernel, {}),
    "SGLD": (SgldKernel, {}),
    "SVRG-LD": (SvrgLdKernel, {}),
    "pSGLD": (PsgldKernel, {}),
    "FSGLD": (FsgldKernel, {}),
    "DG-LMC": (DglmcKernel, {}),
}


@pytest.mark.parametrize("name", KERNELS)
def test_a_model_written_for_nuts_gives_the_draws_of_its_subsample_form(name):
    kernel_class, options = KERNELS[name]
    data = logistic_data(num_data=30)
    expected = run(logistic_model, kernel_class, data, **options)
    got = run(logistic_model_for_nuts, kernel_class, data, **options)
    assert got.kernel.potential.sites.rows is not None and expected.kernel.potential.sites.rows is None
    # the same operations on the same rows: the same bits
    assert torch.equal(got.get_samples()["w"], expected.get_samples()["w"])


# ------------------------------------------------------------------ the shapes NUTS users write
def poisson_for_nuts(x, counts=None):
    """An optional observation, the rate at full size."""
    a = pyro.sample("a", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    rate = torch.exp(a + x @ b)
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Poisson(rate), obs=counts)


def poisson_by_subsample(x, counts=None):
    a = pyro.sample("a", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        rate = torch.exp(a + pyro.subsample(x, event_dim=1) @ b)
        return pyro.sample("obs", dist.Poisson(rate), obs=pyro.subsample(counts, event_dim=0))


def plate_of_a_given_size(x, y, num_data):
    """A plate declared at a size passed to the model (which scales a client's rows by ``N / n``)."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", num_data):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def plate_indices(x, y):
    """The logits at full size, read by the plate's indices (as some of Pyro's examples do)."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", len(x)) as idx:
        pyro.sample("y", dist.Bernoulli(logits=logits[idx]), obs=y[idx])


def keyword_covariates(*, first, second, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", len(first)):
        pyro.sample("y", dist.Bernoulli(logits=w[0] * first + w[1] * second), obs=y)


def dict_of_data(data):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([data["x"].shape[1]]).to_event(1))
    with pyro.plate("data", len(data["y"])):
        pyro.sample("y", dist.Bernoulli(logits=data["x"] @ w), obs=data["y"])


class Network(PyroModule):
    """A PyroModule network, as Pyro's Bayesian-regression tutorial writes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](dim, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, dim]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        logits = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def network_by_subsample(x, y=None):
    """:class:`Network`'s model written with ``pyro.subsample``."""
    weight = pyro.sample("linear.weight", dist.Normal(0.0, 1.0).expand([1, x.shape[1]]).to_event(2))
    bias = pyro.sample("linear.bias", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        logits = (pyro.subsample(x, event_dim=1) @ weight.T + bias).squeeze(-1)
        return pyro.sample("y", dist.Bernoulli(logits=logits), obs=pyro.subsample(y, event_dim=0))


@pytest.fixture(scope="module")
def data():
    x, y = logistic_data(num_data=24, dim=2)
    counts = torch.poisson(torch.exp(0.3 + x @ torch.tensor([0.5, -0.3])), generator=torch.Generator())
    return x, y, counts


def potentials(model, args, kwargs=None):
    pot = FederatedPotential(model, args, kwargs, clients=NUM_CLIENTS)
    points = torch.randn(4, NUM_CLIENTS, pot.dim, generator=torch.Generator().manual_seed(1))
    return pot, pot.client_grads(points, pot.full_batches), pot.total_potentials(points[:, 0])


SHAPES = {
    "optional obs, rate at full size": (
        lambda x, y, c: (poisson_for_nuts, (x,), {"counts": c}),
        lambda x, y, c: (poisson_by_subsample, (x,), {"counts": c}),
    ),
    "plate of a size given to the model": (
        lambda x, y, c: (plate_of_a_given_size, (x, y, len(x)), {}),
        lambda x, y, c: (logistic_model, (x, y), {}),
    ),
    "plate indices reading a full-size mean": (
        lambda x, y, c: (plate_indices, (x, y), {}),
        lambda x, y, c: (logistic_model, (x, y), {}),
    ),
    "a PyroModule network": (
        lambda x, y, c: (Network(2), (x, y), {}),
        lambda x, y, c: (network_by_subsample, (x, y), {}),
    ),
    "covariates as keyword arguments": (
        lambda x, y, c: (keyword_covariates, (), {"first": x[:, 0], "second": x[:, 1], "y": y}),
        lambda x, y, c: (logistic_model, (x, y), {}),
    ),
    "data in a dict": (
        lambda x, y, c: (dict_of_data, ({"x": x, "y": y},), {}),
        lambda x, y, c: (logistic_model, (x, y), {}),
    ),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_nuts_users_write_has_the_potential_of_the_subsample_form(data, shape):
    written, reference = (make(*data) for make in SHAPES[shape])
    _, grads, values = potentials(*written)
    _, expected_grads, expected_values = potentials(*reference)
    # the same sums of the same terms, up to the order of a matrix product's reductions
    torch.testing.assert_close(grads, expected_grads, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(values, expected_values, rtol=1e-12, atol=1e-12)


def masked_by_subsample(x, y, observed):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", len(y)):
        mean = pyro.subsample(x, event_dim=1) @ w
        observed = pyro.subsample(observed, event_dim=0)
        pyro.sample("y", dist.Normal(mean, 1.0), obs=pyro.subsample(y, event_dim=0), obs_mask=observed)


def transposed_features(features_by_row, y, observed):
    """The features laid out [p, N] (a data point per column), an obs_mask argument."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([features_by_row.shape[0]]).to_event(1))
    mean = w @ features_by_row
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mean, 1.0), obs=y, obs_mask=observed)


def factor_likelihood(x, y, observed):
    """The likelihood as a factor in the plate, masked by hand."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    mean = x @ w
    with pyro.plate("data", len(y)):
        pyro.factor("y", torch.where(observed, dist.Normal(mean, 1.0).log_prob(y), 0.0))


@pytest.mark.parametrize("model", [transposed_features, factor_likelihood])
def test_data_along_another_axis_masks_and_factors_read_by_rows(model):
    x, y = regression_data(30)
    observed = torch.rand(30, generator=torch.Generator().manual_seed(3)) > 0.2
    args = (x.T.contiguous(), y, observed) if model is transposed_features else (x, y, observed)
    pot, grads, values = potentials(model, args)
    _, expected_grads, expected_values = potentials(masked_by_subsample, (x, y, observed))
    assert len(pot.sites.rows.names) == 3
    torch.testing.assert_close(grads, expected_grads, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(values, expected_values, rtol=1e-12, atol=1e-12)


def test_the_data_arguments_are_those_with_a_row_per_datum():
    x, y = regression_data(10)
    rows = DataRows(logistic_model_for_nuts, (x, y), {"scale": torch.ones(3), "size": 10}, num_data=10)
    assert rows.names == ["x", "y"]
    args, kwargs = rows.select((x, y), {"scale": torch.ones(3)}, torch.tensor([4, 1]))
    assert torch.equal(args[0], x[[4, 1]]) and torch.equal(args[1], y[[4, 1]])
    nested = DataRows(dict_of_data, ({"x": x, "y": y, "n": 10},), {}, num_data=10)
    assert nested.names == ["data['x']", "data['y']"]
    data = {"x": x, "y": y}
    (selected,), _ = nested.select((data,), {}, torch.tensor([0]))
    assert selected["y"].shape == (1,) and data["y"].shape == (10,)  # the user's dict is not modified


def schools_by_subsample(y, sigma):
    """Eight schools, non-centred: an effect per school (data point), indexed by the plate."""
    effect = pyro.sample("effect", dist.Normal(0.0, 1.0).expand([y.shape[0]]).to_event(1))
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("data", y.shape[0]) as school:
        theta = mu + tau * effect[school]
        pyro.sample(
            "y", dist.Normal(theta, pyro.subsample(sigma, event_dim=0)), obs=pyro.subsample(y, event_dim=0)
        )


def schools_for_nuts(y, sigma):
    """The same, as NUTS users write it: the effects sized from the data, all of them read at full size."""
    effect = pyro.sample("effect", dist.Normal(0.0, 1.0).expand([len(y)]).to_event(1))
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    theta = pyro.deterministic("theta", mu + tau * effect)
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def test_a_parameter_per_data_point_is_read_by_its_rows_and_its_prior_whole():
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    expected = run(schools_by_subsample, FaldKernel, (y, sigma))
    got = run(schools_for_nuts, FaldKernel, (y, sigma))
    assert got.kernel.potential.sites.row_latents == {"effect": 0}
    for name in ("effect", "mu", "tau"):
        assert torch.equal(got.get_samples()[name], expected.get_samples()[name]), name
    # the deterministic site outside the plate is computed from all the effects, at every draw
    idata = to_inference_data(got)
    assert idata.posterior["theta"].shape == (2, 20, 8)
    draws = got.get_samples()
    theta = draws["mu"][:, None] + draws["tau"][:, None] * draws["effect"]
    torch.testing.assert_close(torch.as_tensor(idata.posterior["theta"].values).reshape(40, 8), theta)
    # a client's sub-model would have its own effects: consensus Monte Carlo refuses, with the fix
    with pytest.raises(ValueError, match=r"parameter per data point \(effect\).*plate's indices"):
        consensus.client_models(schools_for_nuts, 2, y, sigma)


# ------------------------------------------------------------------ what cannot be split
X, Y = regression_data(12, dim=1)


def closure_response(x):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=Y)


def all_global():
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(Y)):
        pyro.sample("obs", dist.Normal(w * X[:, 0], 1.0), obs=Y)


def prior_from_the_data(x, y):
    w = pyro.sample("w", dist.Normal(0.0, y.std()))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=y)


def parameter_sized_from_the_data(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2 * len(y)]).to_event(1))  # not one per datum
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(w.sum() * x[:, 0], 1.0), obs=y)


def no_plate(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0).to_event(1), obs=y)


WAYS_OUT = r"Pass the data to the model as arguments.*pyro.subsample\(data, event_dim=...\)"


@pytest.mark.parametrize(
    "model, args, match",
    [
        (closure_response, (X,), rf"site 'obs' in plate 'data' reads data it cannot split\. {WAYS_OUT}"),
        (all_global, (), rf"site 'obs' in plate 'data' reads data it cannot split\. {WAYS_OUT}"),
        (prior_from_the_data, (X, Y), r"density of site 'w' outside plate 'data' changes .*y\.std\(\)"),
        (
            parameter_sized_from_the_data,
            (X, Y),
            r"Site 'w' outside plate 'data' changes shape .*not as a parameter per data point would",
        ),
        (no_plate, (X, Y), r"no plate containing observed sites"),
    ],
)
def test_data_that_cannot_be_split_are_refused_before_the_warm_up(model, args, match):
    with pytest.raises(ValueError, match=match):
        MCMC(FaldKernel(model, 2), num_samples=2, warmup_steps=2).run(*args)


# ------------------------------------------------------------------ what follows the run
def test_arviz_and_predictive_answer_alike_in_both_forms():
    x, y = logistic_data(num_data=30)
    results = []
    for model in (logistic_model, logistic_model_for_nuts):
        mcmc = run(model, FaldKernel, (x, y))
        pyro.set_rng_seed(1)
        idata = to_inference_data(mcmc, log_likelihood=True, posterior_predictive=True)
        results.append(idata)
    subsample_form, nuts_form = results
    for group in ("posterior", "log_likelihood", "posterior_predictive", "observed_data"):
        assert subsample_form[group].equals(nuts_form[group]), group
    # Pyro's Predictive runs the model as written, at full size, on the draws
    predictive = Predictive(logistic_model_for_nuts, mcmc.get_samples())(x)
    assert predictive["y"].shape == (40, 30) and set(predictive["y"].unique().tolist()) <= {0.0, 1.0}


def test_consensus_gives_the_same_draws_in_both_forms():
    x, y = logistic_data(num_data=30)
    draws = []
    for model in (logistic_model, logistic_model_for_nuts):
        pyro.set_rng_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = consensus.sample(
                model, 2, x, y, num_samples=20, warmup_steps=20, kernel=lambda sub: FaldKernel(sub, 2)
            )
        draws.append(result.samples["w"])
    assert torch.equal(*draws)
    # a sub-model given the whole data takes its client's rows itself (NUTS does not split them further)
    (first, _) = consensus.client_models(logistic_model_for_nuts, 2, x, y)
    args, _ = first.arguments(x, y)
    assert torch.equal(args[0], x[first.indices])
    trace = pyro.poutine.trace(first).get_trace(x, y)
    assert trace.nodes["y"]["value"].shape == (len(first.indices),)
