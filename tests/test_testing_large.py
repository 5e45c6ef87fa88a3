"""The stationary-law solvers of pyro_fed.testing: the matrix-free one (states of a few hundred
coordinates) against the Kronecker solve on small problems, and the mean-square stability checks."""

import pytest
import torch

from pyro_fed import testing


@pytest.fixture(autouse=True)
def _one_thread():
    # the solver does many small (n ≤ 200) matrix products: on a busy machine, several threads per product
    # oversubscribe the cores and run tens of times slower than one
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_law(large: testing.StationaryLaw, small: testing.StationaryLaw):
    torch.testing.assert_close(large.mean, small.mean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(large.cov, small.cov, rtol=1e-8, atol=1e-11)
    torch.testing.assert_close(large.state_cov, small.state_cov, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(large.mean_transition, small.mean_transition)


@pytest.mark.parametrize("comm_prob, noise_corr", [(0.2, 0.0), (0.2, 1.0), (0.7, 0.4), (1.0, 0.5)])
def test_fald_large_law_matches_the_kronecker_solve(comm_prob, noise_corr):
    clients = testing.heterogeneous_gaussian_clients(4, 2, mean_scale=5.0, seed=3)
    step = 4 * 0.3 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    large = testing.fald_stationary_law(clients, step, comm_prob, noise_corr, method="iterative")
    assert_same_law(
        large, testing.fald_stationary_law(clients, step, comm_prob, noise_corr, method="kronecker")
    )


@pytest.mark.parametrize(
    "comm_prob, noise_corr, refresh_prob",
    [(0.2, 0.0, 0.2), (0.2, 1.0, 0.5), (0.6, 0.3, 1.0), (1.0, 1.0, 0.3)],
)
def test_vr_fald_large_law_matches_the_kronecker_solve(comm_prob, noise_corr, refresh_prob):
    clients = testing.heterogeneous_gaussian_clients(3, 4, mean_scale=3.0, seed=1)
    step = 3 * 0.4 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    args = (clients, step, comm_prob, noise_corr, refresh_prob)
    large = testing.vr_fald_stationary_law(*args, method="iterative")
    assert_same_law(large, testing.vr_fald_stationary_law(*args, method="kronecker"))


def test_generic_random_recursion_matches_the_kronecker_solve():
    g = torch.Generator().manual_seed(0)
    n = 7
    outcomes = []
    for prob in (0.5, 0.3, 0.2):
        transition = torch.randn(n, n, generator=g) * 0.6 / n**0.5
        root = torch.randn(n, n, generator=g)
        outcomes.append(testing.Outcome(prob, transition, torch.randn(n, generator=g), root @ root.T / n))
    read = torch.randn(2, n, generator=g)
    large = testing.random_recursion_law(outcomes, read, method="iterative")
    assert_same_law(large, testing.random_recursion_law(outcomes, read, method="kronecker"))


def test_solve_second_moment_solves_the_equation_and_is_symmetric():
    clients = testing.heterogeneous_gaussian_clients(5, 2, mean_scale=2.0, seed=4)
    step = 5 * 0.5 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    outcomes, _ = testing.fald_outcomes(clients, step, 0.3, 0.5)
    source = torch.eye(10) + 0.1 * torch.ones(10, 10)
    w = testing.solve_second_moment(outcomes, source)
    torch.testing.assert_close(w, w.T, rtol=0, atol=0)
    torch.testing.assert_close(w - testing.second_moment_operator(outcomes)(w), source)


@pytest.mark.parametrize("method", ["kronecker", "iterative"])
def test_unstable_recursion_is_reported(method):
    # FALD with a local step beyond the stability bound and rare communication: second moments diverge
    clients = testing.heterogeneous_gaussian_clients(4, 2, mean_scale=1.0, seed=0)
    step = 8.0 / torch.linalg.eigvalsh(clients.precisions).max().item()
    with pytest.raises(ValueError, match="mean-square stable"):
        testing.fald_stationary_law(clients, step, 0.1, 0.0, method=method)


def test_unstable_but_plausible_looking_recursion_is_reported():
    # many heterogeneous clients, rare averaging: the client iterates' second moments diverge although the
    # average's covariance solved without the check would look plausible
    clients = testing.heterogeneous_gaussian_clients(10, 2, mean_scale=10.0, seed=0)
    step = 10 * 0.5 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    with pytest.raises(ValueError, match="mean-square stable"):
        testing.fald_stationary_law(clients, step, 0.05, 1.0)


def test_non_convergence_is_reported():
    clients = testing.heterogeneous_gaussian_clients(4, 2, mean_scale=1.0, seed=0)
    step = 4 * 0.5 / torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    with pytest.raises(RuntimeError, match="did not converge"):
        testing.fald_stationary_law(clients, step, 0.3, 0.0, method="iterative", max_iter=1)


def test_squared_distance_bias():
    clients = testing.heterogeneous_gaussian_clients(3, 2, mean_scale=3.0, seed=2)
    mean, cov = clients.posterior()
    law = testing.fald_stationary_law(clients, 0.05, 0.5, 1.0)
    expected = law.cov.trace() + (law.mean - mean).square().sum() - cov.trace()
    assert testing.squared_distance_bias(law, mean, cov) == pytest.approx(float(expected), rel=1e-12)
    # the bias vanishes with the step size (here roughly linearly)
    curvature = torch.linalg.eigvalsh(clients.precisions.sum(0)).max().item()
    for make in (
        lambda step: testing.fald_stationary_law(clients, step, 0.5, 1.0),
        lambda step: testing.vr_fald_stationary_law(clients, step, 0.5, 1.0, 0.5),
    ):
        big, small = (testing.squared_distance_bias(make(s / curvature), mean, cov) for s in (0.3, 0.03))
        assert 0 < small < big / 5


def test_large_state_is_fast_enough():
    # b = 100, d = 2: a state of 202 coordinates (the Kronecker solve would need a 40804² matrix)
    clients = testing.heterogeneous_gaussian_clients(100, 2, mean_scale=10.0, seed=0)
    eigenvalues = torch.linalg.eigvalsh(clients.precisions.sum(0))
    step = 0.1 * 0.5 * 100 * 2 / float(eigenvalues[0] + eigenvalues[-1])
    law = testing.vr_fald_stationary_law(clients, step, 0.5, 1.0, 0.5)  # "auto": the iterative solve
    mean, cov = clients.posterior()
    torch.testing.assert_close(law.mean, mean, rtol=1e-6, atol=1e-8)  # VR-FALD⋆: no client drift in the mean
