"""DglmcKernel: exact stationary laws of its linear recursion on Gaussian clients, their limits, the
automatic settings against the exact posterior, communication and arguments."""

import math
import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed.algorithms import dglmc
from pyro_fed.kernels.dglmc import DglmcKernel
from pyro_fed.network.distributed import shard
from pyro_fed.testing import (
    GaussianClients,
    Outcome,
    StationaryLaw,
    heterogeneous_gaussian_clients,
    random_recursion_law,
    regression_clients,
)

from ..models import gaussian_regression, logistic_data, logistic_model, regression_data
from ..network.forked import run_forked
from .test_checkpoint import assert_bitwise_equal, interrupt, results
from .test_checkpoint import run as run_checkpointed

NOISE_SD = 0.5
PRIOR_SD = 2.0
Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number


# ------------------------------------------------------------ the exact law, built independently
def dglmc_outcomes(
    clients: GaussianClients,
    step_size,
    tolerance,
    inverse_mass: torch.Tensor | None = None,
    local_steps: int = 1,
) -> tuple[list[Outcome], torch.Tensor]:
    r"""DG-LMC with full local batches on Gaussian clients as a linear recursion of the state :math:`s = (z_1,
    \dots, z_b, \theta)`: ``local_steps`` client steps :math:`z_i \leftarrow z_i - \gamma M A_i (z_i -
    \mu_i) - \frac{\gamma}{\rho_i}(z_i - \theta) + \sqrt{2\gamma} R \xi_i` with :math:`\theta` kept, then the
    server's :math:`\theta = \sum_i w_i z_i + N(0, M / P)`; its single outcome (the steps composed) and the
    read-out of :math:`\theta`."""
    b, d, dtype = clients.num_clients, clients.dim, clients.means.dtype
    mass = torch.eye(d, dtype=dtype) if inverse_mass is None else inverse_mass.to(dtype)
    mass = torch.diag(mass) if mass.dim() == 1 else mass
    rho = torch.as_tensor(tolerance, dtype=dtype).expand(b)
    gamma = torch.as_tensor(step_size, dtype=dtype).expand(b)  # one step per client, or one for all
    eye_d, n = torch.eye(d, dtype=dtype), (b + 1) * d
    # one client step on the whole state (theta kept)
    local = torch.eye(n, dtype=dtype)
    offset = torch.zeros(n, dtype=dtype)
    noise = torch.zeros(n, n, dtype=dtype)
    for i in range(b):
        rows = slice(i * d, (i + 1) * d)
        local[rows, rows] = eye_d - gamma[i] * mass @ clients.precisions[i] - gamma[i] / rho[i] * eye_d
        local[rows, b * d :] = gamma[i] / rho[i] * eye_d
        offset[rows] = gamma[i] * mass @ clients.precisions[i] @ clients.means[i]
        noise[rows, rows] = 2 * gamma[i] * mass
    transition, shift, cov = torch.eye(n, dtype=dtype), torch.zeros(n, dtype=dtype), torch.zeros(n, n)
    for _ in range(local_steps):  # compose: s -> local s + offset + noise
        transition, shift, cov = local @ transition, local @ shift + offset, local @ cov @ local.T + noise
    # the server: theta replaced by the weighted mean of the clients plus its own noise
    precision = (1 / rho).sum()
    server = torch.zeros(n, n, dtype=dtype)
    server[: b * d, : b * d] = torch.eye(b * d, dtype=dtype)
    server[b * d :, : b * d] = torch.cat([eye_d / rho[i] / precision for i in range(b)], 1)
    own = torch.zeros(n, n, dtype=dtype)
    own[b * d :, b * d :] = mass / precision
    outcome = Outcome(1.0, server @ transition, server @ shift, server @ cov @ server.T + own)
    read = torch.cat([torch.zeros(d, b * d, dtype=dtype), eye_d], 1)
    return [outcome], read


def dglmc_law(clients, step_size, tolerance, inverse_mass=None, local_steps=1, thinning=1) -> StationaryLaw:
    """The stationary law of the draws, ``thinning`` iterations apart (their autocovariances ``F^t``)."""
    law = random_recursion_law(*dglmc_outcomes(clients, step_size, tolerance, inverse_mass, local_steps))
    return law._replace(mean_transition=torch.linalg.matrix_power(law.mean_transition, thinning))


def augmented_marginal(clients: GaussianClients, tolerance, inverse_mass=None):
    r"""Mean and covariance of the augmented target's :math:`\theta`-marginal: each client's Gaussian
    likelihood smoothed by :math:`N(0, \rho_i M)`, precision :math:`B_i = (A_i^{-1} + \rho_i M)^{-1}`."""
    b, d, dtype = clients.num_clients, clients.dim, clients.means.dtype
    mass = torch.eye(d, dtype=dtype) if inverse_mass is None else inverse_mass.to(dtype)
    mass = torch.diag(mass) if mass.dim() == 1 else mass
    rho = torch.as_tensor(tolerance, dtype=dtype).expand(b)
    smoothed = torch.linalg.inv(torch.linalg.inv(clients.precisions) + rho[:, None, None] * mass)
    cov = torch.linalg.inv(smoothed.sum(0))
    return cov @ (smoothed @ clients.means[..., None]).sum(0)[..., 0], cov


def gaussian_problem(num_clients=3, dim=2, seed=1):
    """Heterogeneous Gaussian clients (different means and covariances), their precisions scaled so that the
    stiffest is 1 (the steps below are then stable in the identity metric), with a prior N(0, PRIOR_SD^2 I)
    split equally: the clients of the Pyro model's federated potential, client ``i`` its datum ``i``."""
    raw = heterogeneous_gaussian_clients(num_clients, dim, mean_scale=1.0, seed=seed)
    raw = GaussianClients(raw.precisions / torch.linalg.eigvalsh(raw.precisions).max(), raw.means)
    exact = raw.with_prior(PRIOR_SD, torch.full((num_clients,), 1.0 / num_clients))
    model, args = raw.pyro_model(PRIOR_SD)
    return exact, model, args, torch.arange(num_clients)


def relative_spread(cov: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The eigenvalues of ``cov`` in the coordinates where ``reference`` is the identity: the ratios of their
    variances along every direction."""
    root = torch.linalg.cholesky(reference)
    return torch.linalg.eigvalsh(torch.linalg.solve(root, torch.linalg.solve(root, cov).T))


def shift_in_sds(mean: torch.Tensor, reference_mean: torch.Tensor, reference_cov: torch.Tensor) -> float:
    """The Mahalanobis distance of ``mean`` from ``reference_mean``: the largest shift, in the reference's
    sds, of any linear function of them."""
    gap = mean - reference_mean
    return float((gap @ torch.linalg.solve(reference_cov, gap)).sqrt())


METRICS = {
    "identity": lambda cov: None,
    "diagonal": lambda cov: cov.diagonal().clone(),
    "dense": lambda cov: cov.clone(),
}


def run(kernel, args, num_samples, warmup, **kwargs):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True, **kwargs)
    mcmc.run(*args)
    return mcmc


# ------------------------------------------------------------ the exact law and its limits (no sampling)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("local_steps", [1, 3])
def test_the_exact_law_tends_to_the_augmented_marginal_and_it_to_the_posterior(metric, local_steps):
    exact, *_ = gaussian_problem()
    mean, cov = exact.posterior()
    mass = METRICS[metric](cov)
    rho = 0.5
    marginal_mean, marginal_cov = augmented_marginal(exact, rho, mass)
    errors = []
    for step in (rho / 10, rho / 100, rho / 1000):
        law = dglmc_law(exact, step, rho, mass, local_steps)
        # the recursion's fixed point does not depend on the step: the marginal's mean exactly
        torch.testing.assert_close(law.mean, marginal_mean, rtol=1e-9, atol=1e-11)
        errors.append(float((law.cov - marginal_cov).abs().max()))
    # the covariance's error is O(step): ten times smaller for a ten times smaller step (to 20%)
    assert errors[0] > 0 and all(0.08 < b / a < 0.12 for a, b in zip(errors, errors[1:], strict=False))
    # the marginal tends to the posterior as O(rho)
    gaps = []
    for tolerance in (1e-1, 1e-2, 1e-3):
        marginal_mean, marginal_cov = augmented_marginal(exact, tolerance, mass)
        gaps.append(max(float((marginal_mean - mean).abs().max()), float((marginal_cov - cov).abs().max())))
    assert gaps[0] > 0 and all(0.08 < b / a < 0.12 for a, b in zip(gaps, gaps[1:], strict=False))
    # both limits together: the law at rho = 1e-3, step = 1e-6 is the posterior to 0.5% of its scale
    law = dglmc_law(exact, 1e-6, 1e-3, mass, local_steps)
    scale = float(cov.diagonal().max())
    torch.testing.assert_close(law.mean, mean, rtol=0, atol=5e-3 * scale**0.5)
    torch.testing.assert_close(law.cov, cov, rtol=0, atol=5e-3 * scale)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mean_scale", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("metric", ["diagonal", "dense"])
def test_the_automatic_settings_hold_the_exact_laws_bias_within_their_targets(seed, mean_scale, metric):
    # the rules of pyro_fed.algorithms.dglmc, given what the warm-up measures on Gaussian clients (the
    # clients' largest curvature, the posterior's smallest, the clients' pull at the mode, all in the
    # preconditioner's coordinates), against the exact laws they bound
    raw = heterogeneous_gaussian_clients(4, 2, mean_scale=mean_scale, seed=seed)
    exact = raw.with_prior(PRIOR_SD, torch.full((4,), 0.25))
    mean, cov = exact.posterior()
    mass = METRICS[metric](cov)
    root = torch.linalg.cholesky(torch.diag(mass) if mass.dim() == 1 else mass)
    whitened = root.T @ exact.precisions @ root
    stiffness = float(torch.linalg.eigvalsh(whitened).max())
    slowest = float(torch.linalg.eigvalsh(whitened.sum(0)).min())
    pull = float((whitened @ (exact.gradients(mean) @ root)[..., None]).sum(0).norm())
    tolerance = dglmc.automatic_tolerance(stiffness, slowest, pull)
    marginal_mean, marginal_cov = augmented_marginal(exact, tolerance, mass)
    # the tolerance's share of the variance's excess, in every direction (a bound: the spread is 1.01-1.03)
    assert relative_spread(marginal_cov, cov).max() <= 1 + dglmc.VARIANCE_SHARE
    # the mean's shift, bounded to first order in rho (rho L <= 0.047: the rest is a few % of it)
    assert shift_in_sds(marginal_mean, mean, cov) <= 1.05 * dglmc.MEAN_TARGET
    # and with the automatic step, the whole law: 10% at most in every direction, and never narrower
    step = dglmc.automatic_step(stiffness, torch.tensor([tolerance]), 0.0, 4)
    law = dglmc_law(exact, float(step), tolerance, mass)
    spread = relative_spread(law.cov, cov)
    assert 1 <= spread.min() and spread.max() <= 1 + dglmc.VARIANCE_TARGET


# ------------------------------------------------------------ the kernel against exact laws
def one_iteration(kernel, args, point, num_chains=2000):
    """One iteration of ``num_chains`` chains from ``point``: its draws (every client starts at the point)."""
    pyro.set_rng_seed(0)
    mcmc = run(kernel, args, 1, 0, num_chains=num_chains, initial_params={"x": point.expand(num_chains, -1)})
    return mcmc.get_samples()["x"]


@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # one draw per chain
@pytest.mark.parametrize("setting", ["identity", "dense", "automatic per client"])
def test_one_iteration_from_a_point_has_its_exact_gaussian_law(setting):
    # from z_i = theta = x the tie pulls nothing: z_i' = x - gamma_i M grad U^i(x) + sqrt(2 gamma_i) R xi_i,
    # and theta' = sum_i w_i z_i' + N(0, M / P), w_i = (1/rho_i) / P: a Gaussian whose mean and covariance are
    # exact; 2000 chains of one iteration each are 2000 independent draws of it
    exact, model, args, clients = gaussian_problem()
    mean, cov = exact.posterior()
    point = mean + torch.tensor([0.3, -0.2])
    mass = None
    if setting == "automatic per client":
        # the warm-up adapts the preconditioner and chooses one step per client for its tolerance
        tolerance = torch.tensor([0.2, 0.5, 1.0])
        kernel = DglmcKernel(model, clients, tolerance=tolerance, thinning=1, gradient_mode="traced")
    else:
        tolerance = torch.full((3,), 0.5)
        mass = None if setting == "identity" else cov
        kernel = DglmcKernel(
            model, clients, tolerance=0.5, step_size=0.3, preconditioner=mass, gradient_mode="traced"
        )
    draws = one_iteration(kernel, args, point)
    mass = torch.eye(2) if mass is None else mass  # the given metric, or the identity
    if kernel.adaptation is not None:
        mass = kernel.adaptation.preconditioner
    mass = torch.diag(mass) if mass.dim() == 1 else mass
    steps = kernel.current_step_size * torch.ones(3)
    if kernel.algorithm.step_factors is not None:
        steps = steps * kernel.algorithm.step_factors
    if setting == "automatic per client":
        assert steps.unique().numel() == 3  # a client of a larger tolerance takes a larger step
        assert (steps.argsort() == tolerance.argsort()).all()
    precision = (1 / tolerance).sum()
    weights = (1 / tolerance) / precision
    moved = point - steps[:, None] * (exact.gradients(point.expand(3, -1)) @ mass)  # M symmetric
    expected_mean = weights @ moved
    expected_cov = (2 * (weights.square() * steps).sum() + 1 / precision) * mass
    n = len(draws)
    sd = expected_cov.diagonal().sqrt()
    # independent draws: the mean's error sd / sqrt(n), a covariance entry's sqrt((S_aa S_bb + S_ab^2) / n)
    assert ((draws.mean(0) - expected_mean).abs() <= Z * sd / math.sqrt(n)).all()
    cov_se = ((sd[:, None] * sd[None]).square() + expected_cov.square()).div(n).sqrt()
    assert ((draws.T.cov() - expected_cov).abs() <= Z * cov_se).all()


SLOW_CASES = {
    "identity": ("identity", 1),
    "diagonal": ("diagonal", 1),
    "dense": ("dense", 1),
    "dense, 2 local steps": ("dense", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_the_draws_follow_the_exact_stationary_law(case):
    # full local batches on Gaussian clients: (z, theta) follow a linear Gaussian recursion whose stationary
    # law is exact; four chains run as one batch, each a stationary chain of it after the warm-up (2500
    # iterations: ~100 relaxation times), so the average of their means and covariances has exact standard
    # errors / sqrt(4). rho = 0.5 and gamma = 0.3 in the metric's units mix fast (an effective draw per ~20
    # iterations) and leave the law measurably away from the posterior.
    metric, local_steps = SLOW_CASES[case]
    exact, model, args, clients = gaussian_problem()
    _, posterior_cov = exact.posterior()
    mass = METRICS[metric](posterior_cov)
    hyper = {"tolerance": 0.5, "step_size": 0.3, "local_steps": local_steps}
    kernel = DglmcKernel(model, clients, preconditioner=mass, gradient_mode="traced", **hyper)
    pyro.set_rng_seed(1)
    num_samples = 5000
    chains = run(kernel, args, num_samples, 2500, num_chains=4).get_samples(group_by_chain=True)["x"]
    law = dglmc_law(exact, 0.3, 0.5, mass, local_steps)
    draws_mean = chains.mean(1).mean(0)
    draws_cov = torch.stack([chain.T.cov() for chain in chains]).mean(0)
    mean_tol = Z * law.mean_standard_error(num_samples) / 2
    cov_tol = Z * law.covariance_standard_error(num_samples) / 2
    assert ((draws_mean - law.mean).abs() <= mean_tol).all(), (draws_mean, law.mean, mean_tol)
    assert ((draws_cov - law.cov).abs() <= cov_tol).all(), (draws_cov, law.cov, cov_tol)
    # the test has power: at this tolerance and step the law is measurably not the posterior
    assert ((law.cov - posterior_cov).abs() > cov_tol).any()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # 4 x 100 draws, ~0.1 effective each
def test_the_automatic_settings_sample_a_regression_within_the_bias_they_allow():
    # a conjugate regression split by the first feature's range over 4 clients (their local posteriors
    # differ), everything automatic but full local batches (so that the recursion is linear and its law
    # exact): at the kernel's chosen tolerance, step and preconditioner the exact law is within the targets
    # of its posterior, and the draws are within that bias plus Z exact standard errors of the posterior
    x, y = regression_data(20, 2)
    clients = torch.empty(20, dtype=torch.long)
    clients[x[:, 0].argsort()] = torch.arange(20) * 4 // 20
    exact = regression_clients(x, y, clients, NOISE_SD, prior_weights=torch.bincount(clients) / 20)
    mean, cov = exact.posterior()
    kernel = DglmcKernel(gaussian_regression(NOISE_SD), clients, batch_size="full", gradient_mode="traced")
    pyro.set_rng_seed(0)
    num_samples = 100
    chains = run(kernel, (x, y), num_samples, 20, num_chains=4).get_samples(group_by_chain=True)["w"]
    chosen = kernel.adaptation
    tolerance = kernel.current_tolerance
    assert kernel.current_thinning == 100  # the capped thinning: the tie slows the chains
    law = dglmc_law(exact, chosen.step_size, tolerance, chosen.preconditioner, thinning=100)
    spread = relative_spread(law.cov, cov)
    assert 1 <= spread.min() and spread.max() <= 1 + dglmc.VARIANCE_TARGET
    assert shift_in_sds(law.mean, mean, cov) <= dglmc.MEAN_TARGET
    # the draws: within the law's bias of the posterior, plus Monte Carlo error (exact, for 4 chains)
    draws_mean = chains.mean(1).mean(0)
    draws_cov = torch.stack([chain.T.cov() for chain in chains]).mean(0)
    mean_tol = (law.mean - mean).abs() + Z * law.mean_standard_error(num_samples) / 2
    cov_tol = (law.cov - cov).abs() + Z * law.covariance_standard_error(num_samples) / 2
    assert ((draws_mean - mean).abs() <= mean_tol).all(), (draws_mean, mean, mean_tol)
    assert ((draws_cov - cov).abs() <= cov_tol).all(), (draws_cov, cov, cov_tol)


@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # the point: too few independent draws
def test_a_capped_thinning_that_leaves_few_independent_draws_is_named_before_the_run():
    # the tie makes the clients' centre relax some 45 times slower than FALD's average: the automatic
    # thinning stops at its cap, and 20 draws of it cover a few relaxation times; the warning says so before
    # the chains start and names the thinning of nearly independent draws, half the relaxation time
    x, y = regression_data(20, 2)
    kernel = DglmcKernel(gaussian_regression(NOISE_SD), 4, gradient_mode="traced")
    pyro.set_rng_seed(0)
    with pytest.warns(UserWarning, match="puts the draws 100 iterations apart") as caught:
        run(kernel, (x, y), 20, 20)
    relaxation = kernel.adaptation.relaxation
    assert kernel.current_thinning == 100 and relaxation / 2 > 100
    (message,) = [str(w.message) for w in caught if "draws 100 iterations apart" in str(w.message)]
    assert f"cover {20 * 100 / relaxation:.3g} relaxation times" in message
    assert f"thinning={math.ceil(relaxation / 2)}" in message
    # with a thinning of the user's, the choice is theirs: no such warning
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        run(DglmcKernel(gaussian_regression(NOISE_SD), 4, gradient_mode="traced", thinning=5), (x, y), 20, 20)
    assert not [w for w in given if "iterations apart" in str(w.message)]


# ------------------------------------------------------------ communication, arguments, runs
@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # 50 draws
def test_every_iteration_sends_the_clients_iterates_up_and_theta_down():
    exact, model, args, clients = gaussian_problem()
    kernel = DglmcKernel(model, clients, tolerance=0.5, step_size=0.1, gradient_mode="traced")
    mcmc = run(kernel, args, 50, 0)
    stats = kernel.sample_stats()
    # 3 clients, d = 2: each uploads z_i and downloads theta, 2 floats of 32 bits each way, at each of the
    # 50 iterations
    assert stats["uploaded_bits"].tolist() == [(k + 1) * 3 * 2 * 32 for k in range(50)]
    assert stats["downloaded_bits"].tolist() == stats["uploaded_bits"].tolist()
    assert mcmc.diagnostics()["communication rounds"] == {"chain 0": 50}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tolerance": 0.0, "step_size": 1e-3}, "tolerance must be a finite positive number"),
        ({"tolerance": -1.0, "step_size": 1e-3}, "tolerance must be a finite positive number"),
        ({"tolerance": float("nan"), "step_size": 1e-3}, "tolerance must be a finite positive number"),
        ({"tolerance": [0.1, -0.1]}, r"tolerance must be .* one per client"),
        ({"tolerance": torch.ones(2, 2)}, r"tolerance must be .* one per client"),
        ({"tolerance": np.array([0.1, float("inf")])}, r"tolerance must be .* one per client"),
        ({"tolerance": 0.1, "step_size": 0.2}, r"step_size=0.2 is at least twice the tolerance 0.1"),
        ({"tolerance": [0.5, 0.05], "step_size": 0.1}, "at least twice the tolerance 0.05"),
        ({"step_size": 1e-3}, "give tolerance too, or pass preconditioner='adapt'"),
        ({"local_steps": 0}, "local_steps must be a positive integer"),
        ({"local_steps": 1.5}, "local_steps must be a positive integer"),
        ({"local_steps": 2, "batch_size": 4}, "local_steps=2 with batch_size=4: the local steps"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DglmcKernel(gaussian_regression(NOISE_SD), 4, **kwargs)


def test_a_tolerance_per_client_must_have_one_value_per_client():
    x, y = regression_data(40)
    kernel = DglmcKernel(
        gaussian_regression(NOISE_SD), 4, tolerance=[0.1, 0.2, 0.3], step_size=1e-3, gradient_mode="traced"
    )
    with pytest.raises(ValueError, match="tolerance has 3 values; the run has 4 clients"):
        run(kernel, (x, y), 2, 0)


def test_more_local_steps_use_full_local_batches_and_count_their_evaluations():
    kernel = DglmcKernel(gaussian_regression(NOISE_SD), 4, local_steps=3, gradient_mode="traced")
    settings = kernel.settings  # the algorithm tells the warm-up: full local batches, 3 evaluations each
    assert not settings.reads_minibatches() and settings.gradient_evaluations(minibatches=False) == 3
    x, y = regression_data(40)
    with pytest.warns(UserWarning, match="end-of-run checks"):  # two draws
        run(kernel, (x, y), 2, 0)
    assert kernel.minibatches is None and kernel.current_batch_size is None


@pytest.mark.slow  # forks two processes
@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # short runs
def test_clients_held_by_two_processes_give_the_one_process_draws():
    # the server's mean is a sum over clients through the network, the clients' noises are drawn by blocks,
    # and the automatic tolerance's pull is summed by the network: split over two ranks, the draws are the
    # one process's up to the rounding of sums reassociated over two blocks of clients
    def draws(clients, data, network=None):
        kernel = DglmcKernel(logistic_model, clients, network=network, thinning=3, gradient_mode="traced")
        mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
        pyro.set_rng_seed(0)
        mcmc.run(*data)
        return mcmc.get_samples(group_by_chain=True)["w"], kernel.diagnostics()["uploaded bits"]

    def on_rank(rank, world_size, network):
        x, y = logistic_data(num_data=60, dim=3)
        rows, clients = shard(6, 60, network)
        return draws(clients, (x[rows], y[rows]), network)

    expected, expected_bits = draws(6, logistic_data(num_data=60, dim=3))
    for found, bits in run_forked(on_rank, 2, timeout_seconds=300):
        torch.testing.assert_close(found, expected, rtol=1e-9, atol=1e-9)
        assert bits == expected_bits


@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # short runs
def test_an_interrupted_automatic_run_resumes_to_the_uninterrupted_draws(tmp_path):
    # the automatic tolerance is not in the checkpoint: a resumed run finds it again from the warm-up's
    # measures that are, and its draws are the uninterrupted run's bit for bit
    def kernel(**kwargs):
        return DglmcKernel(
            gaussian_regression(NOISE_SD), 4, thinning=2, chunk_size=8, gradient_mode="traced", **kwargs
        )

    args = regression_data(40)
    uninterrupted = kernel()
    expected = results(run_checkpointed(uninterrupted, args)[0])
    expected_tolerance = uninterrupted.current_tolerance
    path = tmp_path / "run.pt"
    interrupt(kernel(checkpoint=path, checkpoint_every=5), args=args)
    resumed = kernel(checkpoint=path, checkpoint_every=5)
    mcmc, calls = run_checkpointed(resumed, args)
    assert calls and calls[0] > 0  # resumed, not run again from the start
    assert_bitwise_equal(results(mcmc), expected)
    torch.testing.assert_close(resumed.current_tolerance, expected_tolerance, rtol=0, atol=0)
