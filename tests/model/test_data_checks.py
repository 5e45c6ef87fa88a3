"""Data in the wrong form, observed values outside their support, pyro.param, full-size subsample plates,
misleading starts and masked NaN: each refused at set-up naming the argument or site and the fix, or run as
Pyro's NUTS runs it (issue 29)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel
from pyro_fed.model.potential import FederatedPotential

from ..models import logistic_model, regression_data


def indexed_logistic(x, y):
    """The logistic regression reading its data with the plate's indices (``x[idx]``)."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


def labelled(num_data=40):
    x, y = regression_data(num_data)  # in the default dtype, float64 (tests/conftest.py)
    return x, (y > 0).double()


def run(model, *args, num_samples=4, clients=2, **kernel_kw):
    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, clients, **kernel_kw)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=2, disable_progbar=True)
    mcmc.run(*args)
    return mcmc


def refused(model, args, match, **kernel_kw):
    with pytest.raises(ValueError, match=match):
        run(model, *args, step_size=1e-3, **kernel_kw)


# ------------------------------------------------------------------ the data's form
@pytest.mark.parametrize("which", ["x", "y"])
def test_numpy_arguments_are_named_with_the_conversion(which):
    x, y = labelled()
    args = (x.numpy(), y) if which == "x" else (x, y.numpy())
    match = rf"{which} is a numpy.ndarray \(float64\): pass torch.as_tensor\({which}, dtype=torch.float64\)"
    refused(logistic_model, args, match)


def test_data_indexed_by_the_plate_as_numpy_arrays_or_lists_are_named():
    # NumPy arrays indexed by the plate's index tensor run (the observed value stays an ndarray), and
    # failed later in a raw AttributeError ("'numpy.ndarray' object has no attribute 'dim'", Pyro's NUTS
    # too); lists fail when indexed, in a TypeError that names no argument
    def model(x, y):
        slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)) as idx:
            pyro.sample("y", dist.Bernoulli(logits=slope * x[idx]), obs=y[idx])  # a tensor times an ndarray

    x, y = labelled()
    match = r"observed site 'y' has a value of type numpy.ndarray.*x is a numpy.ndarray \(float64\)"
    refused(model, (x[:, 0].numpy(), y.numpy()), match + r".*y is a numpy.ndarray")
    match = r"x is a list: pass torch.as_tensor\(x\); y is a list: pass torch.as_tensor\(y\)"
    refused(indexed_logistic, (x.tolist(), y.tolist()), match)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.float32])
def test_features_of_another_dtype_than_the_latent_values_are_named(dtype):
    x, y = labelled()
    # e.g. "addmv input tensors must have the same dtype, but got Double, Long, and Double"
    latent = "the model's latent values torch.float64"
    match = rf"first run \(RuntimeError: .*dtype.*\).*x has dtype {dtype}, {latent}"
    refused(logistic_model, ((x * 3).to(dtype), y), match)


def test_float64_data_with_float32_priors_are_named():
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float32), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    x, y = labelled()
    match = r"x has dtype torch.float64, the model's latent values torch.float32: pass x.to\(torch.float32\)"
    refused(model, (x, y), match + r", or build the priors in torch.float64")


def test_valid_integer_labels_and_index_arguments_run():
    # integer labels of a Bernoulli, an integer group index: valid, and run as they are
    def model(x, group, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        shift = pyro.sample("shift", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w + shift[group[idx]]), obs=y[idx])

    x, y = labelled()
    samples = run(model, x, torch.arange(40) % 2, y.long()).get_samples()
    assert samples["w"].shape == (4, 3) and bool(samples["shift"].isfinite().all())


def test_data_on_another_device_are_named():
    x, y = labelled()
    # the meta device stands for a GPU: torch refuses to mix it with the CPU as it refuses cuda tensors
    refused(indexed_logistic, (x.to("meta"), y), r"x is on device meta, the model's latent values on cpu")


@pytest.mark.parametrize("length", [30, 80])
def test_subsampled_data_of_another_length_than_the_plate_are_named(length):
    # y[:30] would fail on an index, y of 80 be read in part: both refused, naming y
    x, y = labelled()
    y = y.repeat(2)[:length]
    match = (
        rf"reads y of shape \({length},\), with {length} entries along the plate's dimension .*datum .*\(40\)"
    )
    refused(logistic_model, (x, y), match)


def test_a_read_of_nested_plates_with_the_wrong_event_dim_is_named_with_the_event_dim_that_fits():
    # y [N, 2] read inside an inner plate of the 2 outputs: event_dim counts from the inner plate's dimension,
    # so event_dim=1 reads the data's dimension under it (NUTS, subsampling nothing, never notices)
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", len(y), dim=-2):
            with pyro.plate("out", 2, dim=-1):
                pyro.sample(
                    "y",
                    dist.Normal(pyro.subsample(x, event_dim=0) * w, 1.0),
                    obs=pyro.subsample(y, event_dim=1),
                )

    x, y = torch.randn(40, 2), torch.randn(40, 2)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, 4, plate="data", step_size=1e-3)
    with pytest.raises(
        ValueError,
        match=r"in plate 'out' of 2 data reads y .* or read it with event_dim=0 \(its dimension -1\)",
    ):
        MCMC(kernel, num_samples=2, warmup_steps=0, disable_progbar=True).run(x, y)


def test_indexed_data_shorter_than_the_plate_are_named():
    x, y = labelled()
    refused(
        indexed_logistic, (x, y[:30]), r"y has 30 entries \(shape \(30,\)\) where plate 'data' has 40 data"
    )


def test_an_unrelated_failure_is_left_as_it_is():
    # nothing in the arguments explains it: the model's own error, unchanged
    def model(x, y):
        pyro.sample("w", dist.Normal(0.0, 1.0))
        raise KeyError("the model's own")

    x, y = labelled()
    with pytest.raises(KeyError, match="the model's own"):
        FederatedPotential(model, (x.double(), y), clients=2)


def test_half_precision_latent_values_are_refused():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float16), 1.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=pyro.subsample(y, event_dim=0))

    with pytest.raises(
        ValueError, match=r"\['mu'\] take values in torch.float16: Langevin steps need float32"
    ):
        FederatedPotential(model, (torch.zeros(10, dtype=torch.float16),), clients=2)


# ------------------------------------------------------------------ the support of observed values
def test_observed_values_outside_the_support_are_named_with_their_index_and_client():
    x, y = labelled()
    y[17], y[30] = 2.0, -1.0
    clients = torch.arange(40) // 10  # datum 17 on client 1, datum 30 on client 3
    match = (
        r"Observed site 'y' has 2 value\(s\) outside the support of Bernoulli \(Boolean\): "
        r"2.0 at data index 17 \(client 1\), -1.0 at data index 30 \(client 3\)"
    )
    with pytest.raises(ValueError, match=match):
        run(logistic_model, x, y, clients=clients)


def test_categorical_labels_outside_the_categories_are_named():
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3, 3]).to_event(2))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Categorical(logits=x[idx] @ w), obs=y[idx])

    x, y = labelled()
    labels = torch.arange(40) % 3
    FederatedPotential(model, (x, labels), clients=2)  # 0, 1, 2: fine
    labels[5] = 3
    with pytest.raises(
        ValueError, match=r"Categorical \(IntegerInterval\(lower_bound=0, upper_bound=2\)\): 3 at"
    ):
        FederatedPotential(model, (x, labels), clients=2)


def test_masked_values_and_supports_that_depend_on_the_parameters_are_not_checked():
    # a masked label 2 is no observation; Uniform(0, theta) with y > theta at the start is the start's
    # problem, not the data's
    def masked(x, y, observed):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx], obs_mask=observed[idx])

    def uniform(y):
        theta = pyro.sample("theta", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", y.shape[0]) as idx:
            pyro.sample("y", dist.Uniform(0.0, theta), obs=y[idx])

    x, y = labelled()
    y[3] = 2.0
    FederatedPotential(masked, (x, y, torch.arange(40) != 3), clients=2)
    FederatedPotential(uniform, (torch.linspace(0.1, 50.0, 20),), clients=2)


def test_the_support_check_of_tall_data_is_one_vectorised_evaluation():
    x = torch.randn(200_000, 3)
    y = (x[:, 0] > 0).float()
    y[123_456] = 0.5
    with pytest.raises(ValueError, match=r"0.5 at data index 123456 \(client 6\)"):
        FederatedPotential(logistic_model, (x, y), clients=torch.arange(200_000) // 20_000)


# ------------------------------------------------------------------ pyro.param, subsample_size=N
def test_a_pyro_param_is_a_constant_of_the_potential_as_in_nuts():
    def model(x, y):
        scale = pyro.param("prior_scale", torch.tensor(0.5), constraint=dist.constraints.positive)
        w = pyro.sample("w", dist.Normal(0.0, scale).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    def fixed(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 0.5).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    pyro.clear_param_store()
    x, y = labelled()
    draws = run(model, x, y, num_samples=20).get_samples()["w"]
    # the draws are those of the model with the parameter's value written in
    torch.testing.assert_close(draws, run(fixed, x, y, num_samples=20).get_samples()["w"])
    assert not draws.requires_grad
    pot = FederatedPotential(model, (x, y), clients=2)
    assert not pot.full_client_grads(torch.zeros(3)).requires_grad


def test_a_data_plate_whose_subsample_size_is_its_size_is_a_full_plate():
    def model(x, y, subsample_size):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            pyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    x, y = labelled()
    full = run(model, x, y, 40).get_samples()["w"]
    torch.testing.assert_close(full, run(model, x, y, None).get_samples()["w"])
    with pytest.raises(ValueError, match="declared with subsample_size"):  # a real subsample stays refused
        FederatedPotential(model, (x, y, 20), clients=2)


# ------------------------------------------------------------------ misleading messages
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_initial_value_is_named_not_blamed_on_the_data(bad):
    x, y = labelled()
    start = {"w": torch.tensor([bad, 0.0, 0.0])}
    pyro.set_rng_seed(0)
    mcmc = MCMC(FaldKernel(logistic_model, 2, step_size=1e-3), 3, warmup_steps=0, initial_params=start)
    with pytest.raises(
        ValueError, match=rf"initial value of site 'w' in chain 0 is not finite: \[{bad}, 0.0"
    ):
        mcmc.run(x, y)


def masked_regression(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]) as idx:
        observed = y[idx]
        pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=observed, obs_mask=~observed.isnan())


def test_nan_masked_by_obs_mask_contributes_nothing_to_the_potential_nor_its_gradient():
    # the fix our NaN message recommends: the posterior is the one of the data without those points
    x, y = regression_data(40)
    holes = y.clone()
    holes[[3, 17, 18, 39]] = float("nan")
    kept = ~holes.isnan()
    pot = FederatedPotential(masked_regression, (x, holes), clients=4, gradient_mode="eager")
    plain = FederatedPotential(masked_regression, (x[kept], y[kept]), clients=4, gradient_mode="eager")
    points = torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(pot.total_potentials(points), plain.total_potentials(points))
    torch.testing.assert_close(pot.total_gradient(points), plain.total_gradient(points))
    # the exact Gaussian posterior of the kept data, against a run (mean within 5 Monte Carlo errors)
    precision = torch.eye(3, dtype=torch.float64) + x[kept].T @ x[kept] / 0.25
    mean = torch.linalg.solve(precision, x[kept].T @ y[kept] / 0.25)
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    draws = run(masked_regression, x, holes, num_samples=2000).get_samples()["w"]
    assert bool(draws.isfinite().all())
    assert bool(((draws.mean(0) - mean).abs() < 0.25 * sd).all()), (draws.mean(0), mean, sd)
