"""The exact Gaussian machinery of pyro_fed.testing, checked against closed forms and the pure algorithms."""

import torch

from pyro_fed import testing
from pyro_fed.algorithms import fald, vr_fald
from pyro_fed.algorithms.langevin import client_noise
from pyro_fed.engine.randomness import Randomness
from pyro_fed.network.in_process import InProcessNetwork

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


def simulate(algorithm, clients, num_iterations, step_size, comm_prob, noise_corr, refresh_prob=None):
    """One chain of the pure algorithm with host coins and fresh noise, as the kernels run it."""
    b, d = clients.num_clients, clients.dim
    rng, network, chain = Randomness(0), InProcessNetwork(b, d), torch.zeros(1, dtype=torch.long)
    full = lambda y: clients.gradients(y[:, None, :].expand(-1, b, -1))  # noqa: E731  [1, d] -> [1, b, d]
    start, step_size = torch.zeros(1, d), torch.tensor(step_size)
    state = fald.init(start, b) if algorithm is fald else vr_fald.init(start, b, full, network)
    draws = torch.empty(num_iterations, d)
    for k in range(num_iterations):
        refresh = refresh_prob is not None and bool(rng.coins(refresh_prob, 1)[0])
        pair = vr_fald.refresh(state, chain, full, network) if refresh else None  # from the pre-step clients
        noise = client_noise(rng, (1,), b, d, noise_corr, torch.float64)
        communicate = torch.as_tensor(rng.coins(comm_prob, 1))
        state = algorithm.step(state, clients.gradients, noise, communicate, network, step_size=step_size)
        state = vr_fald.replace_pair(state, chain, pair) if refresh else state
        draws[k] = algorithm.position(state, network)[0]
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
