import itertools
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.mcmc.util import initialize_model
from pyro.nn import PyroModule, PyroSample

from pyro_fed import FaldKernel, to_inference_data
from pyro_fed.model.potential import FederatedPotential

from ..models import logistic_model, regression_data, scaled_regression

CLIENTS = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 2, 2] * 4)  # unequal sizes 12, 8, 20


def pooled_potential(model, args):
    _, potential_fn, _, _ = initialize_model(model, model_args=args)
    return potential_fn


@pytest.mark.parametrize("prior_weights", ["proportional", "uniform", torch.tensor([0.5, 0.2, 0.3])])
def test_client_potentials_sum_to_full_potential(prior_weights):
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, prior_weights=prior_weights)
    reference = pooled_potential(scaled_regression, (x, y))
    assert pot.dim == 4 and pot.num_clients == 3
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        point = torch.randn(pot.dim, generator=g)
        expected = reference(pot.unconstrained_params(point))
        # float64: the split must be exact up to rounding
        torch.testing.assert_close(pot.potential(point), expected, rtol=1e-12, atol=1e-10)
        x_ = point.clone().requires_grad_()
        expected_grad = torch.autograd.grad(reference(pot.unconstrained_params(x_)), x_)[0]
        torch.testing.assert_close(pot.full_client_grads(point).sum(0), expected_grad, rtol=1e-12, atol=1e-10)


def test_clients_as_index_tensors_or_ids_agree():
    x, y = regression_data(len(CLIENTS))
    by_ids = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS)
    lists = [torch.nonzero(CLIENTS == i).flatten() for i in range(3)]
    by_lists = FederatedPotential(scaled_regression, (x, y), clients=lists)
    points = torch.randn(3, by_ids.dim)
    torch.testing.assert_close(
        by_lists.client_grads(points, by_lists.full_batches), by_ids.client_grads(points, by_ids.full_batches)
    )


def test_prior_share_follows_weights():
    x, y = regression_data(len(CLIENTS))
    weights = torch.tensor([0.5, 0.2, 0.3])
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, prior_weights=weights)
    point = torch.randn(pot.dim)
    empty = pot.batches([torch.zeros(1, dtype=torch.long)] * 3)._replace(datum_weights=torch.zeros(3, 1))
    prior_only = pot.client_grads(point.expand(3, -1), empty)
    torch.testing.assert_close(prior_only / weights[:, None], (prior_only[0] / weights[0]).expand(3, -1))


def test_minibatch_gradient_is_unbiased_by_enumeration():
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS)
    points = torch.randn(3, pot.dim)
    full = pot.client_grads(points, pot.full_batches)
    # client 1 (8 points), every subset of size 2: the average of the estimates is the exact gradient
    own = pot.client_indices[1]
    estimates = []
    for subset in itertools.combinations(range(len(own)), 2):
        indices = [ix[:2] for ix in pot.client_indices]
        indices[1] = own[list(subset)]
        estimates.append(pot.client_grads(points, pot.batches(indices))[1])
    torch.testing.assert_close(torch.stack(estimates).mean(0), full[1], rtol=1e-12, atol=1e-10)


def test_gradients_at_several_points_per_client():
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS)
    points = torch.randn(2, 3, pot.dim)
    both = pot.client_grads(points, pot.full_batches)
    for m in range(2):
        torch.testing.assert_close(both[m], pot.client_grads(points[m], pot.full_batches))


@pytest.mark.parametrize("mode", ["traced", pytest.param("compiled", marks=pytest.mark.slow)])
def test_prepared_gradients_equal_eager(mode):
    x, y = regression_data(len(CLIENTS))
    prepared = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode=mode)
    eager = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode="eager")
    for seed in range(3):  # new inputs through the same prepared function, in other memory layouts too
        generator = torch.Generator().manual_seed(seed)
        points = [
            torch.randn(2, 3, prepared.dim, generator=generator),
            torch.randn(3, 2, prepared.dim, generator=generator).transpose(0, 1),
            torch.randn(1, 3, prepared.dim, generator=generator).expand(2, -1, -1),
        ][seed]
        batches = prepared.batches([ix[seed : seed + 4] for ix in prepared.client_indices])
        torch.testing.assert_close(
            prepared.client_grads(points, batches), eager.client_grads(points, batches)
        )
        torch.testing.assert_close(prepared.full_client_grads(points), eager.full_client_grads(points))


def test_failed_tracing_falls_back_to_eager_with_a_warning(monkeypatch):
    def broken_make_fx(function):
        raise RuntimeError("cannot trace this")

    monkeypatch.setattr("pyro_fed.engine.compile.make_fx", broken_make_fx)
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS)
    eager = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode="eager")
    points = torch.randn(3, pot.dim)
    with pytest.warns(UserWarning, match="could not prepare.*cannot trace this.*running it eager"):
        grads = pot.client_grads(points, pot.full_batches)
    torch.testing.assert_close(grads, eager.client_grads(points, eager.full_batches))
    # the fallback is kept for that shape: no new attempt, no second warning
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pyro_fed could not prepare")
        pot.client_grads(points, pot.full_batches)


def test_bad_gradient_mode():
    x, y = regression_data(len(CLIENTS))
    with pytest.raises(ValueError, match="gradient_mode='jit'"):
        FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode="jit")


def test_plate_with_index_variable_and_two_observed_sites():
    def model(x, y, z):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("rows", x.shape[0]) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])
            pyro.sample("z", dist.Poisson((x[idx] @ w).exp()), obs=z[idx])

    x = torch.randn(12, 2)
    args = (x, torch.randn(12), torch.poisson(torch.ones(12)))
    pot = FederatedPotential(model, args, clients=torch.arange(12) % 3)
    assert pot.likelihood_sites == ["y", "z"]
    point = torch.randn(2)
    torch.testing.assert_close(pot.potential(point), pooled_potential(model, args)({"w": point}))


def test_pointwise_log_likelihood_and_observed_data():
    x, y = regression_data(20)
    pot = FederatedPotential(logistic_model, (x, (y > 0).double()), clients=torch.arange(20) % 2)
    draws = {"w": torch.randn(5, 3)}
    loglik = pot.pointwise_log_likelihood(draws)["y"]
    assert loglik.shape == (5, 20)
    expected = dist.Bernoulli(logits=draws["w"] @ x.T).log_prob((y > 0).double())
    torch.testing.assert_close(loglik, expected)
    torch.testing.assert_close(pot.observed_data()["y"], (y > 0).double())


def test_posterior_predictive_draws_from_the_model():
    x, y = regression_data(200)
    pot = FederatedPotential(logistic_model, (x, (y > 0).double()), clients=torch.arange(200) % 4)
    pyro.set_rng_seed(0)
    draws = {"w": torch.zeros(400, 3)}  # logits 0: replicates are fair coins
    replicates = pot.posterior_predictive(draws)["y"]
    assert replicates.shape == (400, 200)
    assert set(replicates.unique().tolist()) == {0.0, 1.0}
    # 80000 fair coins: the mean has sd 0.0018; 5 sd
    assert abs(replicates.mean().item() - 0.5) < 0.009
    # replicates differ between draws (vmap with independent randomness)
    assert not torch.equal(replicates[0], replicates[1])


# ------------------------------------------------------------------ errors
def _build(model, args, clients=None, **kwargs):
    n = args[0].shape[0]
    return FederatedPotential(
        model, args, clients=torch.arange(n) % 2 if clients is None else clients, **kwargs
    )


def _prior():
    return pyro.sample("w", dist.Normal(0.0, 1.0))


def test_error_no_plate_with_observations():
    def model(x):
        w = _prior()
        pyro.sample("y", dist.Normal(w, 1.0).expand([x.shape[0]]).to_event(1), obs=x)

    with pytest.raises(ValueError, match="no plate containing observed sites"):
        _build(model, (torch.randn(6),))


def test_error_several_plates_without_name_and_wrong_name():
    def model(x):
        w = _prior()
        with pyro.plate("a", 6):
            pyro.sample("y", dist.Normal(w, 1.0), obs=pyro.subsample(x, event_dim=0))
        with pyro.plate("b", 6):
            pyro.sample("z", dist.Normal(w, 1.0), obs=pyro.subsample(x, event_dim=0))

    with pytest.raises(
        ValueError, match=r"several plates containing observed sites: \['a', 'b'\].*plate='name'"
    ):
        _build(model, (torch.randn(6),))
    with pytest.raises(ValueError, match=r"plate='c': the model has no plate of that name"):
        _build(model, (torch.randn(6),), plate="c")
    assert _build(model, (torch.randn(6),), plate="b").likelihood_sites == ["z"]


def test_error_plate_with_subsample_size():
    def model(x):
        w = _prior()
        with pyro.plate("data", 6, subsample_size=2):
            pyro.sample("y", dist.Normal(w, 1.0), obs=pyro.subsample(x, event_dim=0))

    with pytest.raises(ValueError, match="declared with subsample_size"):
        _build(model, (torch.randn(6),))


def test_error_latent_inside_plate():
    def model(x):
        w = _prior()
        with pyro.plate("data", 6):
            z = pyro.sample("z", dist.Normal(w, 1.0))
            pyro.sample("y", dist.Normal(z, 1.0), obs=pyro.subsample(x, event_dim=0))

    with pytest.raises(ValueError, match="'z' is a latent variable inside the data plate 'data'"):
        _build(model, (torch.randn(6),))


def test_error_discrete_latent():
    def model(x):
        k = pyro.sample("k", dist.Bernoulli(0.5))
        with pyro.plate("data", 6):
            pyro.sample("y", dist.Normal(k, 1.0), obs=pyro.subsample(x, event_dim=0))

    with pytest.raises(ValueError, match="'k' is a discrete latent variable"):
        _build(model, (torch.randn(6),))


@pytest.mark.parametrize(
    "clients, match",
    [
        (torch.zeros(5, dtype=torch.long), "clients has length 5 but the data plate has 6 points"),
        (torch.tensor([0, 0, 2, 2, 0, 2]), "client 1 has no data points"),
        (torch.tensor([0, 1, 0, 1, 0, -1]), "clients"),
    ],
)
def test_error_bad_clients(clients, match):
    x, y = regression_data(6)
    with pytest.raises(ValueError, match=match):
        _build(logistic_model, (x, (y > 0).double()), clients=clients)


def test_error_bad_prior_weights():
    x, y = regression_data(6)
    with pytest.raises(ValueError, match="prior_weights='equal'"):
        _build(logistic_model, (x, y), prior_weights="equal")
    with pytest.raises(
        ValueError, match="prior_weights must be a tensor of 2 non-negative weights summing to 1"
    ):
        _build(logistic_model, (x, y), prior_weights=torch.tensor([0.5, 0.6]))


def test_posterior_predictive_with_in_place_sampler_runs_draw_by_draw():
    # Normal.sample fills a tensor in place, which vmap cannot randomise per draw: the draws run one by one
    x, y = regression_data(50)
    pot = FederatedPotential(scaled_regression, (x, y), clients=torch.arange(50) % 2)
    w, sigma = torch.tensor([0.5, -1.0, 2.0]), 0.3
    draws = {"w": w.expand(400, 3), "sigma": torch.full((400,), sigma)}
    replicates = pot.posterior_predictive(draws, chunk_size=100)["y"]
    assert replicates.shape == (400, 50)
    residuals = (replicates - x @ w) / sigma  # standard normal, 20000 of them
    assert abs(residuals.mean().item()) < 5 / 20000**0.5  # 5 sd of the mean
    assert abs(residuals.std().item() - 1) < 5 / (2 * 20000) ** 0.5  # 5 sd of the sd
    assert not torch.equal(replicates[0], replicates[1])


def test_factors_inside_and_outside_the_plate():
    # a global factor counts with the prior (split by the prior weights); a factor in the plate is per datum
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        pyro.factor("ridge", -0.5 * w.square().sum())
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.factor("huber", -torch.nn.functional.huber_loss(x[idx] @ w, y[idx], reduction="none"))

    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(model, (x, y), clients=CLIENTS)
    assert pot.likelihood_sites == ["huber"] and pot.global_observed == ["ridge"]
    point = torch.randn(3)
    torch.testing.assert_close(pot.potential(point), pooled_potential(model, (x, y))({"w": point}))


def test_deterministic_sites_are_neither_data_nor_parameters():
    # pyro.deterministic records a value as an observed Delta site: it carries no density
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        pyro.deterministic("norm", w.norm())
        with pyro.plate("data", x.shape[0]) as idx:
            logits = pyro.deterministic("logits", x[idx] @ w)
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y[idx])

    x, y = regression_data(20)
    labels = (y > 0).double()
    pot = FederatedPotential(model, (x, labels), clients=torch.arange(20) % 2, gradient_mode="eager")
    plain = FederatedPotential(
        logistic_model, (x, labels), clients=torch.arange(20) % 2, gradient_mode="eager"
    )
    assert pot.likelihood_sites == ["y"] and pot.global_observed == []
    point = torch.randn(3)
    torch.testing.assert_close(pot.full_client_grads(point), plain.full_client_grads(point))


def test_missing_data_of_obs_mask_sites_are_integrated_out():
    # pyro.sample(..., obs_mask=...) adds a latent "y_unobserved" inside the plate: its entries carry no
    # information on w, and leaving them out integrates them out exactly. The potential must equal the
    # one of the same model on the observed data alone.
    def model(x, y, observed):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]) as idx:
            pyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=y[idx], obs_mask=observed[idx])

    x, y = regression_data(30)
    observed = torch.arange(30) % 3 != 0
    holes = torch.where(observed, y, torch.tensor(123.0))  # the placeholders of missing values are ignored
    pot = FederatedPotential(model, (x, holes, observed), clients=torch.arange(30) % 3, gradient_mode="eager")
    assert pot.sites.missing_sites == {"y_unobserved"} and pot.likelihood_sites == ["y_observed"]
    kept = torch.ones(int(observed.sum()), dtype=torch.bool)
    plain = FederatedPotential(
        model,
        (x[observed], y[observed], kept),
        clients=torch.arange(int(observed.sum())) % 3,
        gradient_mode="eager",
    )
    point = torch.randn(3)
    torch.testing.assert_close(pot.potential(point), plain.potential(point))
    torch.testing.assert_close(pot.full_client_grads(point).sum(0), plain.full_client_grads(point).sum(0))
    pot.check_initial_points(point[None])
    # and a kernel samples it, traced, with ArviZ output on the observed entries' site
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        FaldKernel(model, 3, step_size=1e-3, gradient_mode="traced"),
        num_samples=10,
        warmup_steps=0,
        disable_progbar=True,
    )
    mcmc.run(x, holes, observed)
    idata = to_inference_data(mcmc, posterior_predictive=True)
    # the missing data are not observations: left out of the log-likelihood (and the other data groups),
    # the observed ones indexed by their position in the data
    assert idata.log_likelihood["y_observed"].shape == (1, 10, 20)
    np.testing.assert_array_equal(idata.log_likelihood["y_observed_data"].values, np.flatnonzero(observed))
    np.testing.assert_array_equal(idata.observed_data["y_observed"].values, y[observed].numpy())
    assert idata.posterior_predictive["y_observed"].shape == (1, 10, 20)
    w = torch.as_tensor(idata.posterior["w"].values[0, -1])
    expected = dist.Normal(x[observed] @ w, 0.5).log_prob(y[observed])
    np.testing.assert_allclose(idata.log_likelihood["y_observed"].values[0, -1], expected.numpy(), rtol=1e-10)
    # NaN placeholders would reach the gradient through the mask (where(mask, NaN, 0)' = 0 * NaN): they are
    # replaced by a finite observed value, and contribute nothing, value and gradient
    nan_holes = torch.where(observed, y, torch.tensor(float("nan")))
    nan_pot = FederatedPotential(model, (x, nan_holes, observed), clients=3, gradient_mode="eager")
    nan_pot.check_initial_points(point[None])
    torch.testing.assert_close(nan_pot.potential(point), plain.potential(point))
    torch.testing.assert_close(nan_pot.full_client_grads(point).sum(0), plain.full_client_grads(point).sum(0))


def test_failed_compilation_is_not_retried(monkeypatch):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("torch._inductor.compile", broken_compile)
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode="compiled")
    point = torch.randn(pot.dim)
    with pytest.warns(UserWarning, match="could not prepare.*no compiler here.*running it traced"):
        first = pot.full_client_grads(point)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pyro_fed could not prepare")
        torch.testing.assert_close(pot.full_client_grads(point), first)


def test_pyro_module_weights_first_read_inside_the_plate_get_the_fix():
    # a PyroModule samples its PyroSample weights where they are first read: inside the data plate they
    # would be per-datum latents. The error says how to read them before the plate.
    class Linear(PyroModule):
        def __init__(self):
            super().__init__()
            self.linear = PyroModule[torch.nn.Linear](3, 1)
            self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
            self.linear.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y):
            with pyro.plate("data", x.shape[0]) as idx:
                pyro.sample("y", dist.Normal(self.linear(x[idx])[:, 0], 0.5), obs=y[idx])

    class Fixed(Linear):
        def forward(self, x, y):
            weights = (self.linear.weight, self.linear.bias)  # noqa: F841 - sampled here, reused below
            super().forward(x, y)

    x, y = regression_data(20)
    with pytest.raises(ValueError, match=r"read the weights before the plate, e.g. `weights = \("):
        FederatedPotential(Linear(), (x, y), clients=2)
    pot = FederatedPotential(Fixed(), (x, y), clients=2, gradient_mode="eager")
    assert [s.name for s in pot.latent_sites] == ["linear.weight", "linear.bias"]


@pytest.mark.parametrize("minibatches", [False, True])
def test_working_gradients_are_the_working_clients_own_and_zero_elsewhere(minibatches):
    # two chains of three clients, at two points each (a control variate's pair); the working (chain, client)
    # pairs 0 (chain 0, client 0), 4 and 5 (chain 1, clients 1 and 2), and a padding row (6 = C b)
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS)
    points = torch.randn(2, 2, 3, pot.dim)
    rows = torch.tensor([0, 4, 5, 6])
    if minibatches:
        indices = torch.stack([ix[:4] for ix in pot.client_indices] * 2).reshape(2, 3, 4)
        weights = (pot.client_sizes / 4.0).repeat(2)[:, None].expand(6, 4)
        every = pot.minibatch_gradients(points, indices, weights.reshape(2, 3, 4))
    else:
        indices = weights = None
        every = pot.full_client_grads(points)
    working = pot.working_gradients(points, rows, indices, weights)
    kept = torch.zeros(2, 3, dtype=torch.bool)
    kept.view(-1)[rows[:-1]] = True
    torch.testing.assert_close(working[:, kept], every[:, kept], rtol=1e-12, atol=1e-12)
    assert (working[:, ~kept] == 0).all()


@pytest.mark.parametrize("leave", ["float", "item", "tolist"])
def test_a_model_that_takes_a_parameter_out_of_torch_is_named_at_set_up(leave):
    # the noise scale computed from a Python number: no gradient flows through it, so the sampler sees only
    # its prior's (NUTS too) and samples another posterior (log_s at -2.2 where it is 0.7): the set-up's
    # central differences disagree with the gradient along log_s by orders of magnitude, and say so
    y = 1.0 + 2.0 * torch.randn(60, generator=torch.Generator().manual_seed(0))
    number = {"float": float, "item": lambda t: t.item(), "tolist": lambda t: t.tolist()}[leave]
    pyro.set_rng_seed(0)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        log_s = pyro.sample("log_s", dist.Normal(0.0, 2.0))
        with pyro.plate("data", len(y)) as i:
            pyro.sample("y", dist.Normal(mu, math.exp(number(log_s))), obs=y[i])

    with pytest.warns(
        UserWarning, match=r"gradient disagrees .*\(log_s: .* by differences, .* by the gradient\)"
    ):
        MCMC(FaldKernel(model, 3, step_size=1e-3), num_samples=2, warmup_steps=0, disable_progbar=True).run(y)


def test_a_model_that_computes_with_a_numpy_copy_of_a_parameter_is_refused():
    # torch.func.grad cannot run it at all (a raw "Cannot access data pointer of Tensor that doesn't have
    # storage" at the first gradient): refused, saying why and what to write instead
    y = 1.0 + 2.0 * torch.randn(60, generator=torch.Generator().manual_seed(0))

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        log_s = pyro.sample("log_s", dist.Normal(0.0, 2.0))
        with pyro.plate("data", len(y)) as i:
            pyro.sample("y", dist.Normal(mu, torch.as_tensor(np.exp(log_s.detach().numpy()))), obs=y[i])

    with pytest.raises(
        ValueError, match=r"gradient cannot be taken \(torch.func.grad: .*\)\. A model that computes"
    ):
        MCMC(FaldKernel(model, 3, step_size=1e-3), num_samples=2, warmup_steps=0, disable_progbar=True).run(y)
