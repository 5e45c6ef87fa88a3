"""The mode search: it reaches a known mode in float64 and float32 with large N, from starts that stopped the
old search early, and the warm-up says so when it cannot."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel
from pyro_fed.algorithms import mode as mode_search
from pyro_fed.kernels import warmup
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.testing import regression_clients

from ..models import gaussian_regression


def scale_regression(x, y):
    """Linear regression with a learned noise scale (the issue's 'well-conditioned regression')."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


def regression_data(num_data, dim, noise, dtype, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, dim, generator=g, dtype=torch.float64)
    x[:, 0] = 1.0
    y = x @ torch.randn(dim, generator=g, dtype=torch.float64) + noise * torch.randn(num_data, generator=g)
    return x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_search_reaches_the_exact_mode_of_a_tall_conjugate_model(dtype):
    # N = 10^5 in 10 clients, known noise: a Gaussian posterior whose mode is its mean. In float32 U is about
    # 5e4, so its rounding (~5e-3 nats) is larger than the last steps' decrease: the gradient decides
    torch.set_default_dtype(dtype)  # the model's own parameters too (the fixture restores float64)
    x, y = regression_data(10**5, 5, 1.0, dtype)
    clients = torch.arange(10**5) % 10
    pot = FederatedPotential(gaussian_regression(1.0), (x, y), clients=clients)
    exact = regression_clients(x.double(), y.double(), clients, 1.0, prior_weights=torch.full((10,), 0.1))
    mean, covariance = exact.posterior()
    search = warmup.find_mode(pot, torch.zeros(5, dtype=dtype))
    error = search.point.double() - mean
    distance = float(error @ torch.linalg.solve(covariance, error)) ** 0.5  # in posterior sds
    # it stops at a Newton decrement of 0.1 by its own Hessian estimate; on a Gaussian the decrement is the
    # distance (a last quasi-Newton step on a quadratic goes most of the rest of the way)
    assert search.converged and distance <= mode_search.MODE_TOLERANCE


def test_a_scale_parameter_sent_astray_by_a_long_first_step_no_longer_stops_the_search():
    # noise sd 0.1 over N = 5000 in float32: from some starts the line search tried points where U overflows
    # (log sigma -> -9); the gradient there was NaN, and the old search ended 20 to 250 posterior sds away,
    # with no word. The reference: the same search in float64 to a 100x tighter tolerance
    x, y = regression_data(5000, 6, 0.1, torch.float32)
    torch.set_default_dtype(torch.float32)
    pot = FederatedPotential(scale_regression, (x, y), clients=torch.arange(5000) % 10)
    torch.set_default_dtype(torch.float64)
    pot64 = FederatedPotential(scale_regression, (x.double(), y.double()), clients=torch.arange(5000) % 10)
    reference = warmup.find_mode(pot64, torch.zeros(7, dtype=torch.float64), tolerance=1e-3).point
    hessian = torch.autograd.functional.hessian(pot64.potential, reference)
    for seed in (17, 18, 27, 34, 37):  # starts that stopped the old search early
        start = torch.randn(7, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        search = warmup.find_mode(pot, start)
        error = search.point.double() - reference
        assert search.converged and float(error @ hessian @ error) ** 0.5 <= mode_search.MODE_TOLERANCE


def test_the_warm_up_refines_a_search_stopped_short_and_warns_when_it_cannot(monkeypatch):
    x, y = regression_data(2000, 4, 0.5, torch.float64)
    model = scale_regression
    # a first search stopped after 4 evaluations, far from the mode: the Hessian's check sends it on, in the
    # Laplace approximation's coordinates, where a quasi-Newton step is nearly Newton's
    searches, find_mode = [], warmup.find_mode

    def first_stopped_short(pot, start, **options):
        searches.append(find_mode(pot, start, **({"max_evaluations": 4} if not searches else options)))
        return searches[-1]

    monkeypatch.setattr(warmup, "find_mode", first_stopped_short)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, 4, gradient_mode="traced")
    MCMC(kernel, num_samples=20, warmup_steps=0, disable_progbar=True).run(x, y)
    assert not searches[0].converged and len(searches) >= 2
    assert kernel.adaptation.mode_decrement <= mode_search.MODE_TOLERANCE
    # with no refinement allowed it cannot: the warm-up says so, and so does the end of the run
    monkeypatch.setattr(warmup, "MODE_REFINEMENTS", 0)
    searches.clear()
    pyro.set_rng_seed(0)
    kernel = FaldKernel(model, 4, gradient_mode="traced")
    with pytest.warns(UserWarning, match="did not reach the mode of the potential") as record:
        MCMC(kernel, num_samples=20, warmup_steps=0, disable_progbar=True).run(x, y)
    assert kernel.adaptation.mode_decrement > mode_search.MODE_WARNING
    assert any("the warm-up did not reach the mode" in str(w.message) for w in record)


@pytest.mark.parametrize("offset, measures", [(0.5, 1), (3.0, 2)])
def test_above_the_estimated_diagonal_a_short_refinement_keeps_the_curvature(offset, measures, monkeypatch):
    """d = 300 > ESTIMATED_DIAGONAL_ABOVE: a first search that stops ``offset`` posterior sds from the mode
    (the exact one, of a conjugate regression) is refined to it; the curvature is measured again only where
    the refinement moved more than a posterior sd, and the mode is reached either way."""
    dim, noise = 300, 1.0
    assert dim > warmup.adaptation.ESTIMATED_DIAGONAL_ABOVE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, dim, generator=g)
    y = x @ torch.randn(dim, generator=g) / dim**0.5 + noise * torch.randn(2000, generator=g)
    pot = FederatedPotential(gaussian_regression(noise), (x, y), clients=torch.arange(2000) % 4)
    precision = torch.eye(dim) + x.T @ x / noise**2
    covariance = torch.linalg.inv(precision)
    mean = covariance @ x.T @ y / noise**2
    # the first search stops offset sds away along a random direction; the others run as written
    direction = torch.randn(dim, generator=g)
    stopped = mean + offset * covariance.diagonal().sqrt() * direction / direction.norm()
    searches, measured_at = [], []
    find_mode, preconditioner = warmup.find_mode, warmup._preconditioner

    def first_stopped_short(pot, start, **options):
        if not searches:
            searches.append(mode_search.ModeSearch(stopped, pot.gradient(stopped), 1, float("nan"), False))
        else:
            searches.append(find_mode(pot, start, **options))
        return searches[-1]

    def recorded(pot, search, *args):
        measured_at.append(search.point)
        return preconditioner(pot, search, *args)

    monkeypatch.setattr(warmup, "find_mode", first_stopped_short)
    monkeypatch.setattr(warmup, "_preconditioner", recorded)
    mode, *_, decrement, _ = warmup._mode_and_preconditioner(pot, torch.zeros(dim), None, "auto")
    assert len(searches) == 2 and len(measured_at) == measures
    assert decrement <= mode_search.MODE_TOLERANCE
    error = mode - mean
    assert float(error @ precision @ error) ** 0.5 <= mode_search.MODE_TOLERANCE  # in posterior sds
