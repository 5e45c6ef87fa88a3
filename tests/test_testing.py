"""The exact Gaussian machinery of pyro_fed.testing, checked against closed forms and the pure algorithms."""

import torch

from pyro_fed import testing
from pyro_fed.algorithms import fald, vr_fald
from pyro_fed.algorithms.rng import Randomness
from pyro_fed.communication import InProcessNetwork

Z = 4.5  # standard errors: a false alarm has probability ~1e-5 per checked number


def test_fald_law_at_full_communication_is_langevin_with_step_over_b():
    clients = testing.heterogeneous_gaussian_clients(3, 2, mean_scale=3.0, seed=1)
    mean, cov = clients.posterior()
    precision = torch.linalg.inv(cov)
    step = 0.5 / torch.linalg.eigvalsh(precision).max().item()
    law = testing.fald_stationary_law(clients, 3 * step, comm_prob=1.0, noise_corr=0.4)
    # Langevin on U alone: one outcome x' = (I - h P) x + h P m + sqrt(2h) xi
    langevin = testing.Outcome(
        1.0, torch.eye(2) - step * precision, step * precision @ mean, 2 * step * torch.eye(2)
    )
    ar = testing.random_recursion_law([langevin], torch.eye(2))
    torch.testing.assert_close(law.mean, ar.mean)
    torch.testing.assert_close(law.cov, ar.cov)
    # closed form of that AR(1): covariance (P - h P^2 / 2)^{-1}
    torch.testing.assert_close(ar.cov, torch.linalg.inv(precision - step * precision @ precision / 2))


def test_discretised_laws_tend_to_the_posterior_at_small_steps():
    clients = testing.heterogeneous_gaussian_clients(3, 2, mean_scale=3.0, seed=2)
    mean, cov = clients.posterior()
    step = 1e-4 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    for law in (
        testing.fald_stationary_law(clients, step, 0.5, 1.0),
        testing.vr_fald_stationary_law(clients, step, 0.5, 1.0, 0.5),
    ):
        torch.testing.assert_close(law.mean, mean, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(law.cov, cov, rtol=1e-3, atol=1e-3)


def test_vr_fald_mean_is_unbiased_fald_mean_is_not():
    clients = testing.heterogeneous_gaussian_clients(4, 2, mean_scale=5.0, seed=3)
    mean, _ = clients.posterior()
    step = 4 * 0.3 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    vr = testing.vr_fald_stationary_law(clients, step, 0.2, 1.0, 0.2)
    fa = testing.fald_stationary_law(clients, step, 0.2, 1.0)
    torch.testing.assert_close(vr.mean, mean)  # the shift cancels the client drift in the mean
    assert (fa.mean - mean).norm() > 0.05


def simulate(algorithm, clients, num_iterations, **hyper):
    rng, network, b = Randomness(0), InProcessNetwork(clients.num_clients), clients.num_clients
    full = lambda y: clients.gradients(y.expand(b, -1))  # noqa: E731
    start = torch.zeros(clients.dim)
    if algorithm is fald:
        state = fald.init(start, b)
        step = lambda s: fald.step(s, clients.gradients, rng, network, **hyper)  # noqa: E731
    else:
        state = vr_fald.init(start, b, full, network)
        step = lambda s: vr_fald.step(s, clients.gradients, full, rng, network, **hyper)  # noqa: E731
    draws = torch.empty(num_iterations, clients.dim)
    for k in range(num_iterations):
        state, _ = step(state)
        draws[k] = algorithm.position(state)
    return draws[num_iterations // 10 :]


def test_exact_laws_match_simulations_of_the_pure_algorithms():
    clients = testing.heterogeneous_gaussian_clients(3, 2, mean_scale=3.0, seed=1)
    step = 0.9 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    hyper = {"step_size": step, "comm_prob": 0.3, "noise_corr": 0.5}
    for algorithm, law, extra in (
        (fald, testing.fald_stationary_law(clients, **hyper), {}),
        (vr_fald, testing.vr_fald_stationary_law(clients, **hyper, refresh_prob=0.2), {"refresh_prob": 0.2}),
    ):
        draws = simulate(algorithm, clients, 30000, **hyper, **extra)
        assert ((draws.mean(0) - law.mean).abs() <= Z * law.mean_standard_error(len(draws))).all()
        centred = draws - draws.mean(0)
        products = centred[:, :, None] * centred[:, None, :]
        assert ((products.mean(0) - law.cov).abs() <= Z * testing.batch_means_standard_error(products)).all()
