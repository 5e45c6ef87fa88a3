"""Full local gradients evaluate every datum once; validation is off per site; fresh initial draws."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.autoguide.initialization import init_to_sample, init_to_value
from pyro.infer.mcmc.util import initialize_model
from pyro.nn import PyroModule, PyroSample
from torch.utils._python_dispatch import TorchDispatchMode

import pyro_fed.model.gradients
from pyro_fed import FaldKernel
from pyro_fed.model.potential import FederatedPotential

from ..models import regression_data, scaled_regression

CLIENTS = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 2, 2] * 4)  # ragged: 12, 8, 20 points


def _regression(gradient_mode="eager", prior_weights="proportional"):
    x, y = regression_data(len(CLIENTS))
    return FederatedPotential(
        scaled_regression, (x, y), clients=CLIENTS, prior_weights=prior_weights, gradient_mode=gradient_mode
    )


@pytest.mark.parametrize("prior_weights", ["proportional", "uniform", torch.tensor([0.5, 0.2, 0.3])])
@pytest.mark.parametrize("chunk_elements", [2**24, 7])  # one chunk; chunks of one datum
def test_full_gradients_equal_padded_full_batches(prior_weights, chunk_elements, monkeypatch):
    monkeypatch.setattr(pyro_fed.model.gradients, "_CHUNK_ELEMENTS", chunk_elements)
    pot = _regression(prior_weights=prior_weights)
    points = torch.randn(2, 3, pot.dim, generator=torch.Generator().manual_seed(0))
    expected = pot.client_grads(points, pot.full_batches)
    torch.testing.assert_close(pot.full_gradient_fn(points), expected, rtol=1e-12, atol=1e-12)
    potentials = pot.client_potentials(points)
    padded = pot.gradients.potential_fn(
        points.reshape(-1, pot.dim), *(a.repeat(2, 1) for a in pot.full_batches), pot.prior_weights.repeat(2)
    )
    torch.testing.assert_close(potentials, padded.reshape(2, 3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["traced", pytest.param("compiled", marks=pytest.mark.slow)])
def test_prepared_full_client_grads_shapes(mode):
    pot, eager = _regression(mode), _regression()
    points = torch.randn(2, 3, pot.dim, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message="pyro_fed could not prepare"
        )  # no fallback: the full gradient traces (and compiles)
        for x in (points, points[0], points[0, 0]):  # [m, b, d], [b, d], one common point [d]
            per_client = x.expand(3, pot.dim) if x.dim() == 1 else x
            grads = pot.full_client_grads(x)
            assert grads.shape == per_client.shape
            torch.testing.assert_close(grads, eager.client_grads(per_client, eager.full_batches))


class _IndexedRows(TorchDispatchMode):
    """Counts the rows of ``data`` that the model reads (indexing ops whose input is ``data``)."""

    def __init__(self, data):
        super().__init__()
        self.data, self.rows = data, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index.Tensor and args[0] is self.data:
            self.rows += out.numel() // self.data[0].numel()
        return out


def test_full_gradients_evaluate_each_datum_once():
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, gradient_mode="eager")
    points = torch.randn(3, pot.dim)
    with _IndexedRows(x) as padded:
        pot.client_grads(points, pot.full_batches)
    with _IndexedRows(x) as full:
        pot.full_gradient_fn(points[None])
    assert padded.rows == 3 * 20  # b * N_max: the padding is evaluated too
    # blocks of one client's data: each datum once, and at most one partly padded block per client
    blocks, weights = pot.gradients._block_index, pot.gradients._block_weights
    assert sorted(blocks[weights > 0].tolist()) == list(range(len(CLIENTS)))
    num_blocks, block = blocks.shape
    # and one datum of weight 0 per client and point (here 1), where the prior share is evaluated alone
    assert full.rows - 3 == num_blocks * block <= len(CLIENTS) + 3 * (block - 1)


class _LargestTensor(TorchDispatchMode):
    """The most entries of any tensor an operation makes (inside :func:`torch.func.vmap`: its whole batch)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_minibatch_gradients_bound_their_largest_tensor(monkeypatch):
    """64 chains x 3 clients, minibatches of 8 points of 3 features: all rows at once make tensors of
    ``rows * n * 3`` entries (the rows' data, read through the plate); in groups of at most
    ``_CHUNK_ELEMENTS / (n e)`` rows (``e`` the entries the gradient makes per datum, measured) no operation
    makes more than ``_CHUNK_ELEMENTS`` entries, but the arguments and the result themselves (``rows * n``
    indices, ``rows * d`` gradients), and the gradients are the same to the bit."""
    pot = _regression()
    entries = pot.gradients.datum_entries
    assert entries >= 3  # at least the datum's features are read
    points = torch.randn(64, 3, pot.dim, generator=torch.Generator().manual_seed(2))
    batches = pot.batches([ix[:8] for ix in pot.client_indices])
    rows, n, d = 64 * 3, 8, pot.dim
    with _LargestTensor() as whole:
        expected = pot.minibatch_gradients(points, *batches)
    bound = n * entries * 10  # groups of 10 rows
    own = rows * max(n, d)  # the arguments and the result: each row's n indices and weights, d gradients
    assert whole.largest >= rows * n * 3 > max(bound, own)  # the rows' data (3 features), at once
    monkeypatch.setattr(pyro_fed.model.gradients, "_CHUNK_ELEMENTS", bound)
    with _LargestTensor() as grouped:
        grads = pot.minibatch_gradients(points, *batches)
    assert grouped.largest <= max(bound, own) < whole.largest
    assert torch.equal(grads, expected)


# --------------------------------------------- validation off per site
class _BayesianNet(PyroModule):
    def __init__(self, num_features, num_hidden):
        super().__init__()
        self.hidden = PyroModule[torch.nn.Linear](num_features, num_hidden)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([num_hidden, num_features]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([num_hidden]).to_event(1))
        self.out = PyroModule[torch.nn.Linear](num_hidden, 1)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, num_hidden]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y):
        # read the weights outside the data plate: a PyroModule samples them at their first access
        hidden, out = (self.hidden.weight, self.hidden.bias), (self.out.weight, self.out.bias)
        with pyro.plate("data", x.shape[0]) as idx:
            h = torch.tanh(torch.nn.functional.linear(x[idx], *hidden))
            mean = torch.nn.functional.linear(h, *out).squeeze(-1)
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y[idx])


def _validation_flags(distribution):
    flags = [vars(distribution).get("_validate_args")]
    if hasattr(distribution, "base_dist"):
        flags += _validation_flags(distribution.base_dist)
    return flags


def test_priors_built_with_validation_on_trace():
    with pyro.validation_enabled(True):
        net = _BayesianNet(3, 4)
    priors = [module._pyro_samples[name] for module in (net.hidden, net.out) for name in ("weight", "bias")]
    flags = [_validation_flags(prior) for prior in priors]
    assert any(True in f for f in flags)  # Normal.expand stores the flag on the instance
    x, y = regression_data(len(CLIENTS))
    with pyro.validation_enabled(True):
        traced = FederatedPotential(net, (x, y), clients=CLIENTS, gradient_mode="traced")
        eager = FederatedPotential(net, (x, y), clients=CLIENTS, gradient_mode="eager")
        assert traced.dim == 4 * 3 + 4 + 4 + 1
        points = torch.randn(3, traced.dim, generator=torch.Generator().manual_seed(0))
        batches = traced.batches([ix[:5] for ix in traced.client_indices])
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "error", message="pyro_fed could not prepare"
            )  # no fallback to the eager gradient
            minibatch = traced.client_grads(points, batches)
            full = traced.full_client_grads(points)
    assert {prepared.mode for prepared in traced._prepared.values()} == {"traced"}
    torch.testing.assert_close(minibatch, eager.client_grads(points, batches))
    torch.testing.assert_close(full, eager.client_grads(points, eager.full_batches))
    assert [_validation_flags(prior) for prior in priors] == flags  # the user's objects are untouched


with pyro.validation_enabled(True):
    _PRIOR = dist.Normal(0.0, 1.0, validate_args=True).expand([3]).to_event(1)  # built at import time


def _module_prior_model(x, y):
    w = pyro.sample("w", _PRIOR)
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, 1.0), obs=y[idx])


def test_module_level_prior_traces():
    x, y = regression_data(len(CLIENTS))
    traced = FederatedPotential(_module_prior_model, (x, y), clients=CLIENTS, gradient_mode="traced")
    eager = FederatedPotential(_module_prior_model, (x, y), clients=CLIENTS, gradient_mode="eager")
    points = torch.randn(3, 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pyro_fed could not prepare")
        grads = traced.client_grads(points, traced.full_batches)
    torch.testing.assert_close(grads, eager.client_grads(points, eager.full_batches))
    assert _validation_flags(_PRIOR) == [None, True]


# ------------------------------------------------------ initial draws
def test_draw_initial_flat_is_a_fresh_draw():
    pyro.set_rng_seed(0)
    x, y = regression_data(len(CLIENTS))
    pot = FederatedPotential(scaled_regression, (x, y), clients=CLIENTS, init_strategy=init_to_sample)
    first = pot.initial_flat.clone()
    draws = torch.stack([pot.draw_initial_flat() for _ in range(2)])
    assert draws.shape == (2, pot.dim)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], first)
    torch.testing.assert_close(pot.initial_flat, first)  # the construction's draw stays
    value = {"w": torch.tensor([0.1, 0.2, 0.3]), "sigma": torch.tensor(2.0)}
    fixed = FederatedPotential(
        scaled_regression, (x, y), clients=CLIENTS, init_strategy=init_to_value(values=value)
    )
    flat = fixed.draw_initial_flat()
    torch.testing.assert_close(flat, torch.tensor([0.1, 0.2, 0.3, torch.tensor(2.0).log()]))
    torch.testing.assert_close(fixed.constrained(flat)[0]["sigma"], value["sigma"])


# --------------------------------------------- models vmap cannot batch
def _branching_model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    scale = s if s > 0.5 else torch.tensor(0.5)  # a Python branch on a parameter's value
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, scale), obs=y[idx])


def _in_place_model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    padded = torch.zeros(x.shape[-1] + 1)
    padded[: x.shape[-1]] = w  # an in-place write of a parameter into a tensor made here
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ padded[:-1] + padded[-1], 0.5), obs=y[idx])


@pytest.mark.parametrize("model", [_branching_model, _in_place_model])
def test_models_vmap_cannot_batch_run_client_by_client(model):
    x, y = regression_data(40)
    with pytest.warns(UserWarning, match="cannot vectorise the model over clients .* one at a time"):
        pot = FederatedPotential(model, (x, y), clients=CLIENTS, gradient_mode="compiled")
    assert not pot.gradients.vectorized and pot.gradient_mode == "eager"
    # the client gradients sum to the gradient of Pyro's own potential, on both sides of the branch
    _, potential_fn, _, _ = initialize_model(model, (x, y))
    for value in (-1.0, 1.0):
        point = torch.full((pot.dim,), value)
        params = pot.unconstrained_params(point)
        params = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads = torch.autograd.grad(potential_fn(params), list(params.values()))
        expected = pot.flatten(dict(zip(params, grads, strict=True)))
        torch.testing.assert_close(pot.full_client_grads(point).sum(0), expected)
    # and a kernel samples it (as written, not traced)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, 4, step_size=1e-3, batch_size=5)
    mcmc = MCMC(kernel, num_samples=10, warmup_steps=5, disable_progbar=True)
    with pytest.warns(UserWarning, match="cannot vectorise"):
        mcmc.run(x, y)
    assert all(torch.isfinite(v).all() for v in mcmc.get_samples().values())
