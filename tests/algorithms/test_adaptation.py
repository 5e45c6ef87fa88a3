"""Warm-up adaptation: each quantity against its exact value on Gaussian clients, the adapted kernels'
exact stationary law, reproducibility, and the defaults on a posterior whose scales differ by 100x."""

import dataclasses
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.autoguide.initialization import init_to_value

from pyro_fed import FaldKernel, VrFaldKernel
from pyro_fed.algorithms import adaptation, convergence, fald
from pyro_fed.algorithms.mode import find_mode
from pyro_fed.kernels import warmup as kernel_warmup
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import (
    GaussianClients,
    batch_means_standard_error,
    fald_stationary_law,
    regression_clients,
)

from ..models import gaussian_regression, logistic_data, logistic_model

IN_PROCESS = InProcessNetwork()  # every client in this process: the sums over clients are the tensors'

NOISE_SD = 0.5
Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
SCALES = torch.tensor([1.0, 10.0, 0.1])  # feature scales: posterior sds 100x apart


def anisotropic_problem(num_data=60, num_clients=3, seed=0):
    """A conjugate regression whose posterior sds differ by 100x across coordinates (features of scales 1,
    10 and 0.1), split into client ranges of the first feature; its exact client potentials."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 3, generator=g) * SCALES
    y = x @ torch.tensor([1.0, -0.1, 5.0]) + NOISE_SD * torch.randn(num_data, generator=g)
    clients = torch.empty(num_data, dtype=torch.long)
    clients[x[:, 0].argsort()] = torch.arange(num_data) * num_clients // num_data
    exact = regression_clients(x, y, clients, NOISE_SD, prior_weights=torch.bincount(clients) / num_data)
    return x, y, clients, exact


def correlated_problem(num_data=60, num_clients=3, seed=0):
    """A conjugate regression with two nearly collinear features (correlation ~0.995): a posterior whose
    correlation no diagonal preconditioner undoes (condition number ~400 after it); client ranges of the
    first feature."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(num_data, 3, generator=g)
    x = torch.stack([z[:, 0], z[:, 0] + 0.1 * z[:, 1], z[:, 2]], 1)
    y = x @ torch.tensor([1.0, -0.5, 2.0]) + NOISE_SD * torch.randn(num_data, generator=g)
    clients = torch.empty(num_data, dtype=torch.long)
    clients[x[:, 0].argsort()] = torch.arange(num_data) * num_clients // num_data
    exact = regression_clients(x, y, clients, NOISE_SD, prior_weights=torch.bincount(clients) / num_data)
    return x, y, clients, exact


def preconditioned(clients: GaussianClients, inverse_mass: torch.Tensor) -> GaussianClients:
    """The clients in the coordinates y = R^-1 x (R the symmetric root of the inverse mass, sqrt(m) for a
    diagonal one), where the preconditioned step is the plain one."""
    root = matrix_root(inverse_mass)
    return GaussianClients(
        root @ clients.precisions @ root, torch.linalg.solve(root, clients.means[..., None])[..., 0]
    )


def matrix_root(inverse_mass: torch.Tensor) -> torch.Tensor:
    root = adaptation.square_root(inverse_mass)
    return torch.diag(root) if root.dim() == 1 else root


def check_chains_against_preconditioned_law(chains, law_y, inverse_mass):
    """Independent chains (``[C, K, d]``) against the exact stationary law of a preconditioned recursion,
    computed in ``y = R^-1 x`` and mapped back (the draw ``read @ state`` becomes ``R @ read @ state``): the
    mean and covariance of the chains against the law's, with the law's exact standard errors divided by
    ``sqrt(C)``. Returns the law's mean and covariance in ``x``."""
    root = matrix_root(inverse_mass)
    law = law_y._replace(mean=root @ law_y.mean, cov=root @ law_y.cov @ root, read=root @ law_y.read)
    num_chains, num_draws = chains.shape[:2]
    draws_mean = chains.mean(1).mean(0)
    draws_cov = torch.stack([c.T.cov() for c in chains]).mean(0)
    mean_tol = Z * law.mean_standard_error(num_draws) / num_chains**0.5
    cov_tol = Z * law.covariance_standard_error(num_draws) / num_chains**0.5
    assert ((draws_mean - law.mean).abs() <= mean_tol).all(), (draws_mean, law.mean, mean_tol)
    assert ((draws_cov - law.cov).abs() <= cov_tol).all(), (draws_cov, law.cov, cov_tol)
    return law.mean, law.cov


def potential_of(x, y, clients):
    return FederatedPotential(gaussian_regression(NOISE_SD), (x, y), clients=clients, gradient_mode="traced")


# ----------------------------------------------------------------------------------- the pure parts
def test_mode_hessian_diagonal_and_stiffness_are_exact_on_gaussian_clients():
    x, y, clients, exact = anisotropic_problem()
    pot = potential_of(x, y, clients)
    mean, _ = exact.posterior()

    def potential(point):
        return pot.client_potentials(point).sum()

    def gradient(point):
        return pot.full_client_grads(point).sum(0)

    search = find_mode(potential, gradient, torch.zeros(3))
    mode = search.point
    # L-BFGS stops at a Newton decrement of 0.1 by its estimate of the Hessian; on a Gaussian the true one,
    # sqrt(g' H^-1 g), is the distance to the mode in posterior sds (Mahalanobis)
    _, covariance = exact.posterior()
    distance = float((mode - mean) @ torch.linalg.solve(covariance, mode - mean)) ** 0.5
    assert search.converged and search.decrement <= 0.1 and search.evaluations < 30
    assert distance <= 0.1
    diagonals, hessian, rounds = adaptation.client_hessians(
        pot.full_gradient_fn, mode, pot.num_clients, IN_PROCESS, total=True
    )
    assert rounds == 3  # each client uploads its 3 x 3 Hessian
    torch.testing.assert_close(diagonals, exact.precisions.diagonal(dim1=-2, dim2=-1), rtol=1e-10, atol=0)
    torch.testing.assert_close(hessian, exact.precisions.sum(0), rtol=1e-10, atol=0)
    for inverse_mass in (
        adaptation.preconditioner(diagonals.sum(0)),
        adaptation.dense_preconditioner(hessian),
    ):
        root = adaptation.square_root(inverse_mass)
        # at the mode and at another point (the same Hessians: Gaussian clients)
        points = torch.stack([mode, mode + 1.0])
        stiffness, iterations, _ = adaptation.client_stiffness(
            pot.full_gradient_fn, points, root, pot.num_clients
        )
        # Lanczos's Krylov space is the whole space after d = 3 products: exact then, if not before
        assert 1 < iterations <= 3
        expected = torch.linalg.eigvalsh(preconditioned(exact, inverse_mass).precisions).max(-1).values
        # it stops when the extreme Ritz values move by less than 1e-3 (relative) in an iteration, and they
        # converge from below, faster than linearly
        torch.testing.assert_close(stiffness, expected.expand(2, -1), rtol=1e-3, atol=0)


def condition(hessian: torch.Tensor, inverse_mass: torch.Tensor) -> float:
    """The condition number the preconditioner ``inverse_mass`` leaves the Hessian."""
    return adaptation.condition_number(adaptation.preconditioned_curvatures(hessian, inverse_mass))


def test_above_the_exact_dimensions_the_hessian_diagonal_is_estimated_without_bias_in_a_few_passes():
    # two clients with Hessians diag(a_i) + B_i B_i^T / k at d beyond EXACT_DIAGONAL_DIMENSIONS: each entry
    # of the estimate is a mean of K = DIAGONAL_PROBES products, with variance sum_{j != l} H_lj^2 / K
    d, k = adaptation.EXACT_DIAGONAL_DIMENSIONS + 52, 8
    g = torch.Generator().manual_seed(0)
    scales = 1.0 + torch.rand(2, d, generator=g, dtype=torch.float64)
    factors = torch.randn(2, d, k, generator=g, dtype=torch.float64)
    calls = []

    def client_gradients(points):  # [m, 2, d] -> [m, 2, d], H_i x
        calls.append(points.shape[0])
        coupled = torch.einsum("idk,mik->mid", factors, torch.einsum("idk,mid->mik", factors, points)) / k
        return scales * points + coupled

    point = torch.zeros(d, dtype=torch.float64)
    diagonals, hessian, rounds = adaptation.client_hessians(client_gradients, point, 2, InProcessNetwork())
    assert hessian is None and diagonals.shape == (2, d) and rounds == adaptation.DIAGONAL_GROUPS
    # a fixed number of passes, whatever d
    assert len(calls) == adaptation.DIAGONAL_PROBES // adaptation.DIRECTIONS_PER_PASS
    exact = scales + factors.square().sum(-1) / k
    coupling = torch.einsum("idk,ijk->idj", factors, factors) / k
    off_diagonal = coupling.square().sum(-1) - coupling.diagonal(dim1=1, dim2=2).square()
    sd = (off_diagonal / adaptation.DIAGONAL_PROBES).sqrt()
    errors = (diagonals - exact) / sd
    # 6 sds per entry: a false alarm has probability about 2e-9 per entry, 1e-5 over the 4,200 entries
    assert errors.abs().max() < 6.0, errors.abs().max()
    # an estimate, not the exact diagonal: its errors have the predicted size (their RMS near 1)
    assert 0.8 < errors.square().mean().sqrt() < 1.2, errors.square().mean().sqrt()
    # and the same probes everywhere: a second call gives the same estimate
    again, _, _ = adaptation.client_hessians(client_gradients, point, 2, InProcessNetwork())
    assert torch.equal(again, diagonals)


@pytest.mark.parametrize("coupling", [0.002, 1.0])
def test_between_the_thresholds_the_estimate_is_taken_where_accurate_else_the_exact_diagonal(coupling):
    # above ESTIMATED_DIAGONAL_ABOVE the estimate comes first; weakly coupled (a regression's Hessian,
    # diagonal-dominant) its relative error is far below DIAGONAL_TOLERANCE and it is kept (8 passes);
    # strongly coupled (rank-8 factors of unit size, as a network's weights) it is not, and the exact
    # diagonal follows it (8 + d / 32 passes)
    d, k = adaptation.ESTIMATED_DIAGONAL_ABOVE + 64, 8
    g = torch.Generator().manual_seed(1)
    scales = 1.0 + torch.rand(2, d, generator=g, dtype=torch.float64)
    factors = coupling * torch.randn(2, d, k, generator=g, dtype=torch.float64)
    calls = []

    def client_gradients(points):  # [m, 2, d] -> [m, 2, d], H_i x
        calls.append(points.shape[0])
        coupled = torch.einsum("idk,mik->mid", factors, torch.einsum("idk,mid->mik", factors, points))
        return scales * points + coupled

    point = torch.zeros(d, dtype=torch.float64)
    diagonals, hessian, rounds = adaptation.client_hessians(client_gradients, point, 2, InProcessNetwork())
    exact = scales + factors.square().sum(-1)
    probing = adaptation.DIAGONAL_PROBES // adaptation.DIRECTIONS_PER_PASS
    if coupling < 1:
        assert len(calls) == probing and rounds == adaptation.DIAGONAL_GROUPS
        assert not torch.equal(diagonals, exact)
        # the entries' relative errors: about coupling^2 * sqrt(d k) / sqrt(K), far within the tolerance
        assert ((diagonals - exact) / exact).abs().max() < adaptation.DIAGONAL_TOLERANCE
    else:
        assert len(calls) == probing + math.ceil(d / adaptation.DIRECTIONS_PER_PASS)
        assert rounds == adaptation.DIAGONAL_GROUPS + 1
        torch.testing.assert_close(diagonals, exact, rtol=1e-10, atol=0)
    assert hessian is None


@pytest.mark.parametrize("num_clients", [8, 1024])
def test_the_noise_is_measured_with_fewer_draws_only_where_many_clients_make_it_dear(num_clients):
    # every client's probe at the typical points, NOISE_DRAWS times: 8 clients of 32 points evaluate 4,096
    # data, 1,024 clients of 32 evaluate 2^19 per draw, and take as many draws as NOISE_EVALUATIONS allows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 * num_clients, 3, generator=g)
    y = x.sum(-1) + torch.randn(len(x), generator=g)
    pot = potential_of(x, y, torch.arange(len(x)) % num_clients)
    probe = adaptation.probe_batch_sizes(pot.all_client_sizes)
    points = torch.zeros(kernel_warmup.TYPICAL_POINTS, 3)
    draws = kernel_warmup._minibatch_gradients(pot, 0, probe)(points)
    per_draw = kernel_warmup.TYPICAL_POINTS * int(probe.sum())
    expected = kernel_warmup.NOISE_DRAWS
    if per_draw * expected > kernel_warmup.NOISE_EVALUATIONS:
        expected = max(kernel_warmup.MIN_NOISE_DRAWS, kernel_warmup.NOISE_EVALUATIONS // per_draw)
    assert draws.shape == (expected, kernel_warmup.TYPICAL_POINTS, num_clients, 3)
    assert (expected < kernel_warmup.NOISE_DRAWS) == (num_clients > 256)
    # independent minibatches: the draws differ
    assert not torch.equal(draws[0], draws[1])


def test_dense_preconditioner_whitens_the_hessian_and_its_condition_number_is_measured():
    g = torch.Generator().manual_seed(0)
    factor = torch.randn(4, 4, generator=g, dtype=torch.float64)
    hessian = factor @ factor.T + 0.1 * torch.eye(4, dtype=torch.float64)
    dense = adaptation.dense_preconditioner(hessian)
    torch.testing.assert_close(dense, torch.linalg.inv(hessian))
    root = adaptation.square_root(dense)
    torch.testing.assert_close(root @ root.T, dense)
    torch.testing.assert_close(root @ hessian @ root, torch.eye(4, dtype=torch.float64))
    assert condition(hessian, dense) == pytest.approx(1.0)
    # the diagonal preconditioner leaves the correlations: its condition number is that of the correlation
    diagonal = adaptation.preconditioner(hessian.diagonal())
    scaled = hessian / (hessian.diagonal()[:, None] * hessian.diagonal()).sqrt()
    eigenvalues = torch.linalg.eigvalsh(scaled)
    assert condition(hessian, diagonal) == pytest.approx(float(eigenvalues[-1] / eigenvalues[0]))
    # a saddle's negative curvature is taken by its magnitude: M stays positive definite
    saddle = torch.diag(torch.tensor([2.0, -0.5], dtype=torch.float64))
    torch.testing.assert_close(
        adaptation.dense_preconditioner(saddle), torch.diag(torch.tensor([0.5, 2.0])).double()
    )
    # the step tensors: gamma m per coordinate, or gamma M with its root
    drift, root = adaptation.preconditioned_step(0.3, dense)
    torch.testing.assert_close(drift, 0.3 * dense)
    torch.testing.assert_close(root @ root.T, 0.3 * dense)
    torch.testing.assert_close(adaptation.preconditioned_step(0.3, diagonal), 0.3 * diagonal)


def uncentred_regression_hessian(years: torch.Tensor, noise_sd: float = 1.2) -> torch.Tensor:
    """The Hessian of a regression of 62 yearly values on an intercept and the year (posteriordb's
    kilpisjarvi): intercept and slope correlated near -1, eigenvalues about 1e12 apart."""
    design = torch.stack([torch.ones_like(years), years], 1)
    return design.T @ design / noise_sd**2


def test_dense_preconditioner_of_an_uncentred_regression_is_its_inverse_hessian():
    # floored on H itself (eigenvalues below 1e-8 of the largest raised), the ridge kept a scale thousands
    # of times too small; in the coordinates the diagonal scales, its condition number is only ~1e5
    hessian = uncentred_regression_hessian(torch.arange(3952.0, 4014.0, dtype=torch.float64))
    eigenvalues = torch.linalg.eigvalsh(hessian)
    assert eigenvalues[-1] / eigenvalues[0] > 1e11  # the ridge: beyond float32, and 1e-8 floors
    dense = adaptation.dense_preconditioner(hessian)
    torch.testing.assert_close(dense, torch.linalg.inv(hessian), rtol=1e-6, atol=0)
    root = adaptation.square_root(dense)
    torch.testing.assert_close(root @ hessian @ root, torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-6)
    # from a float32 Hessian (a float32 model's), float32 back, and the preconditioned curvatures within
    # the few percent that float32's rounding of the Hessian's entries allows at this conditioning
    single = adaptation.dense_preconditioner(hessian.float())
    assert single.dtype == torch.float32
    curvatures = adaptation.preconditioned_curvatures(hessian, single.double())
    assert ((curvatures - 1).abs() < 0.05).all(), curvatures


def test_typical_points_are_pulled_to_the_potential_level_of_posterior_draws():
    # U(x) = |x|^2 / 2 in d = 2: posterior draws sit at U - U(mode) ~ d/2 = 1, the level is 1 + 3 = 4
    def potentials(points):
        values = points.square().sum(-1) / 2
        return torch.where(points[:, 0] > 50, torch.full_like(values, float("nan")), values)

    mode = torch.zeros(2)
    offsets = torch.tensor([[1.0, 1.0], [4.0, 0.0], [100.0, 0.0]])
    points = adaptation.typical_points(potentials, mode, offsets)
    # a typical offset is kept (U = 1); U = 8 is halved once (U = 2); a NaN and then U = 1250, 312, 78, 19.5
    # are halved until U = 4.9 > 4 is halved once more: 100 / 64
    torch.testing.assert_close(points, torch.tensor([[1.0, 1.0], [2.0, 0.0], [100.0 / 64, 0.0]]))


def test_preconditioner_floor_step_size_and_noise_formulas():
    inverse_mass = adaptation.preconditioner(torch.tensor([4.0, -2.0, 0.0]))
    # |H_kk|, and a flat direction gets 1e8 times the largest curvature's inverse mass
    torch.testing.assert_close(inverse_mass, torch.tensor([0.25, 0.5, 0.25e8]))
    # exact gradients: gamma * stiffness = 2 eps / (1 + eps) = 0.2 / 1.1
    assert adaptation.step_size(stiffness=2.0, noise=0.0, num_clients=5) == pytest.approx(0.2 / 1.1 / 2)
    # with noise, 2 eps b / (V + (1 + eps) b lambda) = 2 * 0.1 * 5 / (10 + 1.1 * 5 * 0.5)
    gamma = adaptation.step_size(stiffness=0.5, noise=10.0, num_clients=5)
    assert gamma == pytest.approx(1.0 / 12.75)
    # the stationary variance it gives along the stiffest direction, (1 + hV/2) / (1 - h lambda_U / 2) with
    # h = gamma / b and lambda_U = b lambda: exactly 1 + eps times the posterior's
    h = gamma / 5
    assert (1 + h * 10.0 / 2) / (1 - h * 5 * 0.5 / 2) == pytest.approx(1 + adaptation.VARIANCE_TARGET)
    at_one_point = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[-1.0, 0.0], [0.0, -2.0]]])  # [R=2, b=2, d=2]
    # variances over R summed over clients: [2, 8]; times m = [1, 0.5]: max 4
    root = torch.tensor([1.0, 0.5]).sqrt()
    assert adaptation.gradient_noise(
        adaptation.noise_profile(at_one_point[:, None], root), IN_PROCESS
    ) == pytest.approx(4.0)
    # a second point with twice the spread (variances [8, 32]): averaged over the points, [5, 20] * m: max 10
    draws = torch.stack([at_one_point, 2 * at_one_point], 1)  # [R=2, P=2, b=2, d=2]
    assert adaptation.gradient_noise(adaptation.noise_profile(draws, root), IN_PROCESS) == pytest.approx(10.0)
    # a dense root: the variances of the whitened draws, v @ R = ((v0 + v1) / sqrt 2) (1, 1): 1 + 4 = 5
    dense_root = torch.ones(2, 2) / 2**0.5
    assert adaptation.gradient_noise(
        adaptation.noise_profile(at_one_point[:, None], dense_root), IN_PROCESS
    ) == pytest.approx(5.0)


STIFF = 50.0  # the quartic pilot's curvature at its mode


def quartic_pilot(points, max_iterations, seed=0):
    """The pilot on U(x) = 50 sum_k (x_k^2 / 2 + x_k^4 / 4), whose curvature 50 (1 + 3 x_k^2) grows away from
    the mode (stiffness at a point: the largest over its coordinates), with the iterations and step of every
    block (the moves between two stiffness checks) and every stiffness measured recorded."""
    blocks, measured = [[0, None]], []

    def move(x, noise, h):
        blocks[-1] = [blocks[-1][0] + len(noise), h]
        for z in noise:
            x = adaptation.langevin_move(lambda p: STIFF * (p + p**3), x, z, torch.tensor(h), torch.ones(1))
        return x

    def stiffness(x):
        blocks.append([0, None])
        measured.append(STIFF * (1 + 3 * x.square()).amax(-1))
        return measured[-1]

    stiffness(points)  # the starts' (measured before the pilot: not a block)
    blocks.pop()
    generator = torch.Generator().manual_seed(seed)
    largest = float(measured[0].max())
    result = adaptation.pilot_step(
        move, stiffness, points, measured[0], largest, 1, generator, max_iterations=max_iterations
    )
    return result, blocks[:-1], torch.cat(measured)


def test_the_pilot_sets_the_step_for_the_stiffness_where_the_particles_go():
    # from the mode, where the curvature is 50 (the rule's step 0.18 / 50), the particles reach |x| ~ 0.14
    # (the posterior's sd) and beyond, where it is 1.1 times that and more: the step must end at the rule's
    # for every stiffness met, the starts' included (P(|x| < 0.19) ~ 0.8 at each of 64 checked states)
    start = torch.zeros(4, 1)
    (step, typical, largest, iterations, elapsed), blocks, measured = quartic_pilot(start, 10**6)
    assert largest == float(measured.max()) > 1.1 * STIFF
    assert typical == pytest.approx(adaptation.step_stiffness(measured, largest), rel=1e-12)
    assert STIFF < typical < largest and step == pytest.approx(adaptation.STEP_TARGET / typical)
    # each block runs for a Langevin time T / checks at the step of the moment: set from what the checks
    # before it measured
    assert len(blocks) == adaptation.PILOT_CHECKS
    assert blocks[0][1] == pytest.approx(adaptation.STEP_TARGET / STIFF)
    for k, (n, h) in enumerate(blocks):
        seen = measured[: 4 * (k + 1)]
        assert h == pytest.approx(adaptation.STEP_TARGET / adaptation.step_stiffness(seen, float(seen.max())))
        assert n == max(math.ceil(adaptation.PILOT_DURATION / (adaptation.PILOT_CHECKS * h)), 64)
    assert sum(n for n, _ in blocks) == iterations
    assert elapsed == pytest.approx(sum(n * h for n, h in blocks)) and elapsed >= adaptation.PILOT_DURATION


def test_the_step_is_set_for_the_typical_stiffness_and_kept_stable_at_the_largest():
    # a stiffness ten times the others' at one point of four: the root mean square, not the largest,
    # sets the step; one a hundred times theirs bounds it, at a product of STABLE_PRODUCT with the step
    typical = torch.tensor([1.0, 1.0, 1.0, 10.0])
    assert adaptation.step_stiffness(typical, 10.0) == pytest.approx((103 / 4) ** 0.5)
    assert adaptation.step_stiffness(typical, 100.0) == pytest.approx(
        100.0 * adaptation.STEP_TARGET / adaptation.STABLE_PRODUCT
    )
    step = adaptation.step_size(adaptation.step_stiffness(typical, 100.0), 0.0, 1)
    assert step * 100.0 == pytest.approx(adaptation.STABLE_PRODUCT)
    # a Gaussian's stiffness is the same everywhere: the largest, as before
    assert adaptation.step_stiffness(torch.full((4,), 3.0), 3.0) == pytest.approx(3.0)


def test_the_pilot_keeps_the_step_on_a_gaussian_and_stops_at_its_iteration_budget():
    # U = |x|^2 / 2 seen through a stiffness of 1 everywhere: nothing to change
    def move(x, noise, h):
        return x + noise[-1]

    def ones(x):
        return torch.ones(len(x))

    generator = torch.Generator().manual_seed(0)
    step, typical, largest, iterations, elapsed = adaptation.pilot_step(
        move, ones, torch.zeros(2, 3), torch.ones(2), 1.0, 1, generator, max_iterations=40
    )
    # the rule's step for 1
    assert (step, typical, largest) == (pytest.approx(adaptation.STEP_TARGET), 1.0, 1.0)
    # a block of at least 64 iterations, cut to the budget of 40: it ends the pilot, short of its time T
    assert iterations == 40 and elapsed == pytest.approx(40 * step) and elapsed < adaptation.PILOT_DURATION
    # without it, blocks of at least 64 iterations at h = 0.18: 56 would reach T = 10, so the first does
    _, _, _, iterations, _ = adaptation.pilot_step(
        move, ones, torch.zeros(2, 3), torch.ones(2), 1.0, 1, generator, max_iterations=10**6
    )
    assert iterations == adaptation.PILOT_MIN_BLOCK
    # no warm-up, no pilot: the rule's step at the starts' stiffness
    none = adaptation.pilot_step(
        move, ones, torch.zeros(2, 3), torch.full((2,), 9.0), 9.0, 1, generator, max_iterations=0
    )
    assert none == (pytest.approx(adaptation.STEP_TARGET / 9.0), 9.0, 9.0, 0, 0.0)
    # a potential flat where it was measured, with gradient noise: the noise alone bounds the step
    flat = adaptation.pilot_step(
        move,
        lambda x: torch.zeros(len(x)),
        torch.zeros(2, 3),
        torch.zeros(2),
        0.0,
        1,
        generator,
        max_iterations=0,
        noise=4.0,
    )
    assert flat[0] == pytest.approx(adaptation.step_size(0.0, 4.0, 1)) and flat[1:3] == (0.0, 0.0)


# ----------------------------------------------------------------------------------- in the kernels
def run(kernel, args, num_samples, warmup=100, num_chains=1):
    mcmc = MCMC(
        kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=num_chains, disable_progbar=True
    )
    mcmc.run(*args)
    return mcmc


@pytest.mark.slow
@pytest.mark.parametrize("kernel_type", [FaldKernel, VrFaldKernel])
@pytest.mark.parametrize("problem", [anisotropic_problem, correlated_problem], ids=["scales", "correlated"])
def test_defaults_sample_the_posterior_with_the_exact_law_of_the_chosen_step(kernel_type, problem):
    # MCMC(kernel(model)) alone: the adapted step and preconditioner give a stationary law whose every
    # variance is within the design's 10% of the posterior's (exact gradients: 1 / (1 - STEP_TARGET / 2)), and
    # the draws follow that law exactly (the preconditioned recursion is the plain one in y = R^-1 x);
    # thinning=1: consecutive iterations, the law of the chain itself
    x, y, clients, exact = problem()
    mean, covariance = exact.posterior()
    kernel = kernel_type(gaussian_regression(NOISE_SD), clients, gradient_mode="traced", thinning=1)
    pyro.set_rng_seed(0)
    chains = run(kernel, (x, y), num_samples=4000, num_chains=4).get_samples(group_by_chain=True)["w"]
    chosen = kernel.adaptation
    clients_y = preconditioned(exact, chosen.preconditioner)
    # VR-FALD*, averaging every iteration with exact gradients: the shift cancels in the average, so its law
    # is FALD's for any pair, and it refreshes none automatically
    law_y = fald_stationary_law(clients_y, chosen.step_size, 1.0, 1.0)
    if kernel_type is VrFaldKernel:
        assert kernel.current_refresh_prob == 0.0
    # four independent chains: standard errors of the exact law divided by 2
    law_mean, law_cov = check_chains_against_preconditioned_law(chains, law_y, chosen.preconditioner)
    ratio = law_cov.diagonal() / covariance.diagonal()
    assert (ratio >= 1).all() and (ratio <= 1 + adaptation.VARIANCE_TARGET + 1e-9).all(), ratio
    torch.testing.assert_close(law_mean, mean, rtol=0, atol=1e-9 * float(covariance.diagonal().sqrt().min()))
    if problem is anisotropic_problem:
        # scales 100x apart and weak correlations: the diagonal form; the isotropic step of the same
        # stability could not do it: its slowest direction decorrelates 1e4x slower
        assert chosen.preconditioner.shape == (3,) and chosen.condition < adaptation.DENSE_CONDITION
        assert float(chosen.preconditioner.max() / chosen.preconditioner.min()) > 1e3
    else:
        # nearly collinear features: the diagonal preconditioner would leave a condition number of ~400, so
        # the warm-up takes the dense one, M = H^-1 (the exact posterior covariance here)
        assert chosen.condition > 100 and chosen.preconditioner.shape == (3, 3)
        torch.testing.assert_close(chosen.preconditioner, covariance, rtol=1e-8, atol=0)


def test_preconditioner_forms_can_be_chosen_and_a_dense_matrix_given():
    x, y, clients, exact = correlated_problem()
    mean, covariance = exact.posterior()
    chosen = {}
    for form in ("diagonal", "dense"):
        kernel = FaldKernel(
            gaussian_regression(NOISE_SD),
            clients,
            preconditioner=form,
            gradient_mode="traced",
            # the search starts at the mode: it stops at once, and no check sends it on (the same rounds)
            init_strategy=init_to_value(values={"w": mean}),
        )
        run(kernel, (x, y), num_samples=2, warmup=0)
        chosen[form] = kernel.adaptation
    torch.testing.assert_close(chosen["diagonal"].preconditioner, 1 / exact.precisions.sum(0).diagonal())
    torch.testing.assert_close(chosen["dense"].preconditioner, covariance, rtol=1e-8, atol=0)
    # the diagonal form leaves the correlation: its slowest direction relaxes ~400 times slower than the
    # stiffest allows; for it, the clients upload their diagonals only (no condition number measured)
    hessian = exact.precisions.sum(0)
    assert condition(hessian, chosen["diagonal"].preconditioner) > 100
    assert condition(hessian, chosen["dense"].preconditioner) == pytest.approx(1.0)
    assert math.isnan(chosen["diagonal"].condition)
    # d rounds for the dense form's Hessian, one for the diagonal's (the warm-up's other rounds, its stiffness
    # and pilot, depend on the preconditioner: counted apart)
    pot = kernel.potential
    search = kernel_warmup.find_mode(pot, mean.to(pot.dtype))
    rounds = {
        form: kernel_warmup._preconditioner(pot, search, None, form, search.point)[-1] for form in chosen
    }
    assert rounds == {"diagonal": 1, "dense": 3}
    # a user's matrix with a given step: used as it is, nothing adapted
    given = FaldKernel(
        gaussian_regression(NOISE_SD),
        clients,
        step_size=0.1,
        preconditioner=covariance,
        gradient_mode="traced",
    )
    draws = run(given, (x, y), num_samples=20, warmup=0).get_samples()["w"]
    assert given.adaptation is None and draws.isfinite().all()
    drift, root = given.runner.constants[0]
    torch.testing.assert_close(drift, 0.1 * covariance.to(draws))
    torch.testing.assert_close(root @ root.T, 0.1 * covariance.to(draws))


@pytest.mark.slow
def test_preconditioned_fald_with_local_steps_has_the_exact_law():
    # a user's preconditioner and step, clients averaging with probability 0.2 (a random recursion with two
    # outcomes): the mean of the draws against the exact stationary mean, with its exact standard error
    x, y, clients, exact = anisotropic_problem()
    inverse_mass = 1.0 / exact.precisions.sum(0).diagonal()
    step = 0.6
    kernel = FaldKernel(
        gaussian_regression(NOISE_SD),
        clients,
        step_size=step,
        preconditioner=inverse_mass,
        comm_prob=0.2,
        gradient_mode="traced",
    )
    pyro.set_rng_seed(1)
    draws = run(kernel, (x, y), num_samples=8000).get_samples()["w"]
    law_y = fald_stationary_law(preconditioned(exact, inverse_mass), step, 0.2, 1.0)
    scales = inverse_mass.sqrt()
    law_mean = scales * law_y.mean
    tol = Z * scales * law_y.mean_standard_error(8000)
    assert ((draws.mean(0) - law_mean).abs() <= tol).all(), (draws.mean(0), law_mean, tol)
    # with local steps the law is biased (8 standard errors here): the test can tell the two laws apart
    posterior_mean, _ = exact.posterior()
    assert ((law_mean - posterior_mean).abs() > tol).any()
    assert kernel.adaptation is None  # everything was given: nothing adapted


@pytest.mark.parametrize("kernel_type, batch_size", [(FaldKernel, None), (VrFaldKernel, 5)])
def test_adaptation_is_reproducible_and_the_same_with_one_or_several_chains(kernel_type, batch_size):
    x, y, clients, _ = anisotropic_problem()
    chosen = []
    for num_chains, seed in ((1, 0), (3, 0), (1, 0), (1, 1)):
        kernel = kernel_type(gaussian_regression(NOISE_SD), clients, batch_size=batch_size)
        pyro.set_rng_seed(seed)
        # with a warm-up: the pilot run is part of the choice
        run(kernel, (x, y), num_samples=2, warmup=5, num_chains=num_chains)
        chosen.append(kernel.adaptation)
    first, several, again, other_seed = chosen
    assert first.pilot_iterations > 0
    for other in (several, again):
        assert other.step_size == first.step_size
        assert torch.equal(other.preconditioner, first.preconditioner)
    if batch_size is None:  # no randomness at all: the seed does not matter
        assert other_seed.step_size == first.step_size
    else:  # the noise is measured on seeded minibatches; the choice is stable across seeds
        assert first.noise > 0 and other_seed.step_size == pytest.approx(first.step_size, rel=0.5)


def cubic_model(y):
    # y_j ~ N(w^3, 1): a posterior whose curvature grows with w (about 9 N w^4), far from Gaussian
    w = pyro.sample("w", dist.Normal(0.0, 2.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("y", dist.Normal(w**3, 1.0), obs=pyro.subsample(y, event_dim=0))


@pytest.mark.parametrize("comm_prob", [1.0, 0.5])  # the step of the average, with or without local steps
def test_the_stiffness_is_measured_at_the_mode_and_at_draws_of_the_laplace_approximation(comm_prob):
    y = torch.tensor([0.8, 1.3, 0.6, 1.1, 1.2, 0.9])
    # full local batches: exact gradients, so that the step is the stiffness's alone
    kernel = FaldKernel(cubic_model, 2, comm_prob=comm_prob, gradient_mode="traced", batch_size="full")
    pyro.set_rng_seed(0)
    run(kernel, (y,), num_samples=2, warmup=0)
    chosen, pot = kernel.adaptation, kernel.potential
    assert chosen.typical_points.shape == (4, 1)
    points = torch.cat([chosen.mode[None], chosen.typical_points])
    root = adaptation.square_root(chosen.preconditioner)

    def gradients(p):
        return pot.total_gradient(p[:, 0])[:, None]

    # the stiffness of U / b: the warm-up sets the step of the clients' average
    per_point = adaptation.client_stiffness(gradients, points, root, 1)[0][:, 0] / pot.num_clients
    # the step is set for the typical points' stiffness, kept stable at the mode's too
    largest = float(per_point.max())
    assert chosen.largest_stiffness == pytest.approx(largest, rel=1e-12)
    assert chosen.stiffness == pytest.approx(adaptation.step_stiffness(per_point[1:], largest), rel=1e-12)
    # the curvature (about 9 N w^4) varies across the typical points: a draw |z| > 0.15 sd from the mode
    # moves it by more than 5% (all four closer has probability ~2e-4), so the mode alone would differ
    assert float(per_point.max() - per_point.min()) > 0.05 * float(per_point.max())
    if comm_prob == 1.0:
        assert chosen.step_size == pytest.approx(adaptation.STEP_TARGET / chosen.stiffness)
    else:
        # with local steps, each client's own steps are kept stable at the stiffest client's curvature
        clients = adaptation.client_stiffness(pot.full_gradient_fn, points, root, 2)[0].max(-1).values
        bound = min(
            adaptation.STEP_TARGET / chosen.stiffness, adaptation.STABLE_PRODUCT / float(clients.max())
        )
        assert chosen.step_size <= bound * (1 + 1e-12)


def test_the_pilot_runs_within_the_warm_up_and_checks_the_step_where_the_draws_go():
    y = torch.tensor([0.8, 1.3, 0.6, 1.1, 1.2, 0.9])
    chosen = []
    for warmup in (0, 10):
        # full local batches: exact gradients, so that the step is the stiffness's alone
        kernel = FaldKernel(cubic_model, 2, thinning=3, gradient_mode="traced", batch_size="full")
        pyro.set_rng_seed(0)
        run(kernel, (y,), num_samples=2, warmup=warmup)
        chosen.append(kernel.adaptation)
    without, pilot = chosen
    assert without.pilot_iterations == 0  # no warm-up, no pilot: the step of the typical points
    # the same mode and typical points; the pilot runs at most the warm-up's 10 x 3 iterations
    assert torch.equal(pilot.typical_points, without.typical_points)
    assert 0 < pilot.pilot_iterations <= 30
    # the largest stiffness it keeps is the largest it met, the typical points' included; the step is the
    # rule's for the stiffness it is set for
    assert pilot.largest_stiffness >= without.largest_stiffness
    assert pilot.stiffness >= adaptation.STEP_TARGET / adaptation.STABLE_PRODUCT * pilot.largest_stiffness
    assert pilot.step_size == pytest.approx(adaptation.STEP_TARGET / pilot.stiffness)
    # every pilot iteration is a round per particle (every client uploads its gradient at 4 points)
    assert pilot.rounds >= without.rounds + 4 * pilot.pilot_iterations
    # a kernel that averages every other iteration on average gives it half the iterations: as many upload
    # rounds per particle as a chain's warm-up
    kernel = FaldKernel(cubic_model, 2, comm_prob=0.5, thinning=3, gradient_mode="traced")
    pyro.set_rng_seed(0)
    run(kernel, (y,), num_samples=2, warmup=10)
    assert 0 < kernel.adaptation.pilot_iterations <= 15


def test_the_adaptation_is_counted_once_for_all_chains():
    # chosen once, from chain 0's start, for every chain: its uploads are charged to chain 0 alone, so the
    # chains' counts add up to the run's traffic (full batches, comm_prob = 1: the same traffic per iteration)
    x, y, clients, _ = anisotropic_problem()
    kernel = FaldKernel(gaussian_regression(NOISE_SD), clients, gradient_mode="traced")
    bits = run(kernel, (x, y), num_samples=4, warmup=0, num_chains=2).diagnostics()["uploaded bits"]
    b, d = 3, 3
    assert bits["chain 0"] - bits["chain 1"] == kernel.adaptation.rounds * b * d * 32
    # four draws of `thinning` iterations, each an averaging round (the thinning is chosen too)
    assert bits["chain 1"] == 4 * kernel.current_thinning * b * d * 32


def test_chosen_values_are_reported_and_the_user_overrides_them():
    x, y, clients, exact = anisotropic_problem()
    kernel = FaldKernel(gaussian_regression(NOISE_SD), clients, gradient_mode="traced")
    mcmc = run(kernel, (x, y), num_samples=4, warmup=0)
    chosen = kernel.adaptation
    assert kernel.current_step_size == chosen.step_size
    assert mcmc.diagnostics()["step size"] == {"chain 0": chosen.step_size}
    assert kernel.logging()["step"] == f"{chosen.step_size:.3g}"
    # the mode search, the curvature and nothing else (full batches) cost uploads before the first draw
    assert chosen.rounds >= 2 and kernel.diagnostics()["uploaded bits"] >= chosen.rounds * 3 * 32 * 3
    # a given step keeps its meaning (no preconditioner): nothing adapted
    given = FaldKernel(gaussian_regression(NOISE_SD), clients, step_size=1e-3, gradient_mode="traced")
    run(given, (x, y), num_samples=2, warmup=0)
    assert given.adaptation is None and given.current_step_size == 1e-3
    # a given step with an adapted preconditioner
    both = FaldKernel(
        gaussian_regression(NOISE_SD), clients, step_size=0.5, preconditioner="adapt", gradient_mode="traced"
    )
    run(both, (x, y), num_samples=2, warmup=0)
    assert both.adaptation.step_size == 0.5
    torch.testing.assert_close(both.adaptation.preconditioner, 1 / exact.precisions.sum(0).diagonal())


@pytest.mark.parametrize(
    "value, match",
    [
        ("auto", "preconditioner must be None"),
        (torch.tensor([1.0, -1.0, 1.0]), "positive finite numbers"),
        (torch.ones(2, 3), "preconditioner must be None"),
        (torch.tensor([[1.0, 2.0], [2.0, 1.0]]), "symmetric positive definite"),
        (torch.tensor([[1.0, 0.5], [0.0, 1.0]]), "symmetric positive definite"),
    ],
)
def test_bad_preconditioner(value, match):
    with pytest.raises(ValueError, match=match):
        FaldKernel(gaussian_regression(NOISE_SD), preconditioner=value)


def test_preconditioner_of_the_wrong_length_is_refused_at_setup():
    x, y, clients, _ = anisotropic_problem()
    kernel = FaldKernel(gaussian_regression(NOISE_SD), clients, preconditioner=torch.ones(2))
    with pytest.raises(ValueError, match=r"preconditioner has shape \(2,\); the model has 3 unconstrained"):
        run(kernel, (x, y), num_samples=2, warmup=0)


def test_the_model_alone_runs():
    # no clients, no step size: 10 i.i.d. clients, the chains start at draws of the Laplace approximation
    x, y, _, exact = anisotropic_problem()
    kernel = FaldKernel(gaussian_regression(NOISE_SD), gradient_mode="traced")
    mcmc = run(kernel, (x, y), num_samples=50, warmup=20, num_chains=2)
    assert kernel.potential.num_clients == 10
    mean, covariance = exact.posterior()
    draws = mcmc.get_samples()["w"]
    # every draw is within 6 posterior sds of the posterior mean (no chain starts far and crawls in)
    assert ((draws - mean).abs() <= 6 * covariance.diagonal().sqrt()).all()
    assert mcmc.diagnostics()["divergences"] == {"chain 0": [], "chain 1": []}


# ------------------------------------------------------------------------------ minibatch and thinning
def test_the_minibatch_noise_is_predicted_for_every_size_by_sampling_without_replacement():
    # one client of N = 40 points whose per-datum gradients are its data: an estimate N/n sum_S g_j has
    # variance N^2 (1/n - 1/N) S^2 (S^2 the data's unbiased variance), whatever n: measured at n = 4 it
    # predicts n = 20 and n = 40 (no noise), and a fixed part (compression) adds to every size
    sizes = torch.tensor([40])
    variance = lambda n: 40**2 * (1 / n - 1 / 40) * 2.0  # noqa: E731  (S^2 = 2)
    probe = torch.tensor([[variance(4)]])
    for n in (4, 20, 40):
        assert adaptation.batch_noise(
            torch.zeros(1, 1), probe, sizes, 4, n, network=IN_PROCESS
        ) == pytest.approx(variance(n))
    assert adaptation.batch_noise(
        torch.full((1, 1), 3.0), probe + 3.0, sizes, 4, 20, network=IN_PROCESS
    ) == pytest.approx(variance(20) + 3.0)
    # several clients: each scales with its own size; the noise is the largest coordinate's sum over them
    sizes = torch.tensor([10, 100])
    probe = torch.tensor([[1.0, 5.0], [2.0, 1.0]])  # [b, d] at n = 5
    factor = lambda n, size: size**2 * (1 / min(n, size) - 1 / size)  # noqa: E731
    expected = max(
        1.0 * factor(8, 10) / factor(5, 10) + 2.0 * factor(8, 100) / factor(5, 100),
        5.0 * factor(8, 10) / factor(5, 10) + 1.0 * factor(8, 100) / factor(5, 100),
    )
    assert adaptation.batch_noise(torch.zeros(2, 2), probe, sizes, 5, 8, network=IN_PROCESS) == pytest.approx(
        expected
    )


def test_the_automatic_minibatch_is_the_smallest_within_its_share_of_the_noise():
    sizes = torch.full((10,), 1000)
    probe = torch.full((10, 3), 1.0)  # at n = 16, each client's variance 1 in every coordinate
    for allowed in (0.5, 2.0, 8.0):
        n = adaptation.choose_batch_size(
            torch.zeros_like(probe), probe, sizes, 16, allowed, evaluations=1, network=IN_PROCESS
        )
        noise = adaptation.batch_noise(torch.zeros_like(probe), probe, sizes, 16, n, network=IN_PROCESS)
        assert (
            noise
            <= allowed
            < adaptation.batch_noise(torch.zeros_like(probe), probe, sizes, 16, n - 1, network=IN_PROCESS)
        )
    # a minibatch that would read more than half the data is not worth its noise: full local batches
    assert (
        adaptation.choose_batch_size(
            torch.zeros_like(probe), probe, sizes, 16, 1e-3, evaluations=1, network=IN_PROCESS
        )
        is None
    )
    # two evaluations per datum (control variates) halve the size at which that happens
    n = adaptation.choose_batch_size(
        torch.zeros_like(probe), probe, sizes, 16, 0.38, evaluations=1, network=IN_PROCESS
    )
    assert 250 < n <= 500
    assert (
        adaptation.choose_batch_size(
            torch.zeros_like(probe), probe, sizes, 16, 0.38, evaluations=2, network=IN_PROCESS
        )
        is None
    )


@dataclasses.dataclass(kw_only=True)
class BlindNoiseFald(fald.Fald):
    """An algorithm whose noise measure never draws the minibatch estimates it is given (as the own-kernel
    tutorial's first version did: its posterior came out 60-100% too wide)."""

    def adaptation_noise(self, minibatch_gradients, mode, points, run):
        return torch.zeros(8, len(points), run.potential.num_clients, run.dim, dtype=points.dtype)


class BlindNoiseKernel(FaldKernel):
    def _algorithm(self):
        return BlindNoiseFald(comm_prob=self.comm_prob, noise_corr=self.noise_corr)


@pytest.mark.parametrize("batch_size", [None, 5])
def test_a_noise_measure_blind_to_the_minibatch_is_named_and_not_trusted(batch_size):
    # it reports every minibatch as noiseless as the full data, so the warm-up would take the smallest one
    # (one point per client) whose noise it never saw: it keeps full local batches instead, and says why;
    # with a given minibatch it says that the step ignores its noise
    x, y = logistic_data(200)
    kernel = BlindNoiseKernel(logistic_model, torch.arange(200) % 4, batch_size=batch_size)
    consequence = "keeps full local batches" if batch_size is None else "as if batch_size=5 added none"
    with pytest.warns(
        UserWarning, match=f"adaptation_noise never called the minibatch_gradients.*{consequence}"
    ):
        kernel.setup(0, x, y)
    assert kernel.current_batch_size == batch_size
    assert kernel.full_local_batches == (batch_size is None)


def test_thinning_is_half_the_autocorrelation_time_of_the_slowest_direction():
    # x' = (1 - h lambda) x + noise has integrated autocorrelation time (2 - h lambda) / (h lambda)
    assert adaptation.thinning_for(0.1, 1.0) == 9  # tau = 19
    assert adaptation.thinning_for(0.1, 0.01) == adaptation.MAX_THINNING  # tau = 1999, capped
    assert adaptation.thinning_for(1.0, 1.0) == 1  # tau = 1: every iteration is a draw
    # draws so thinned of an AR(1) chain have an autocorrelation time of about 2 (e^-1 apart: 2.16; the floor
    # of tau / 2 is a little closer)
    thinned = (1 - 0.1) ** adaptation.thinning_for(0.1, 1.0)
    assert 2 < (1 + thinned) / (1 - thinned) < 2.5


@pytest.mark.slow
def test_the_defaults_on_a_tall_conjugate_model_meet_the_accuracy_target():
    # N = 20000 over 20 clients, known noise: the exact posterior is Gaussian. VR-FALD* at its defaults takes
    # minibatches (its control variates' noise is small) and rare refreshes; its draws must meet the tall
    # benchmark's targets: means within a Monte Carlo error of the exact ones (a linear gradient's noise
    # has mean 0: no bias), sds within the design's 5% (sqrt(1 + 0.1) - 1) plus Monte Carlo error
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 3, generator=g)
    y = x @ torch.tensor([0.5, -1.0, 0.2]) + torch.randn(20000, generator=g)
    clients = torch.arange(20000) % 20
    exact = regression_clients(x, y, clients, 1.0, prior_weights=torch.full((20,), 0.05))
    mean, covariance = exact.posterior()
    pyro.set_rng_seed(0)
    kernel = VrFaldKernel(gaussian_regression(1.0), clients)
    draws = run(kernel, (x, y), num_samples=1000, warmup=200, num_chains=2).get_samples(group_by_chain=True)[
        "w"
    ]
    assert isinstance(kernel.current_batch_size, int) and kernel.current_batch_size < 100
    assert kernel.current_refresh_prob < 0.05 and kernel.current_thinning > 1
    flat = draws.reshape(-1, 3)
    sd = covariance.diagonal().sqrt()
    se = torch.stack([batch_means_standard_error(c) for c in draws]).square().mean(0).sqrt() / 2**0.5
    assert ((flat.mean(0) - mean).abs() <= Z * se).all()
    # an sd estimated from E effective draws has a relative standard error of about 1 / sqrt(2 E)
    ratio = flat.std(0) / sd
    effective = float(convergence.ess_bulk(draws.numpy()).min())
    assert (ratio - 1).abs().max() <= (1.1**0.5 - 1) + Z / (2 * effective) ** 0.5, ratio


@pytest.mark.parametrize("dense", [False, True])
def test_the_draws_replace_a_preconditioner_only_where_they_disagree_beyond_chance(dense):
    # 4 chains of 500 independent draws of N(0, S) in 3 dimensions. Measured against S itself their
    # covariance spreads its eigenvalues (in S's coordinates) by chance alone, well within DENSE_CONDITION
    # times the Marchenko-Pastur allowance: kept. Against a preconditioner whose first variance is 100 times
    # too small (and, dense, whose correlation is missing) the spread is ~100: replaced, by the draws'
    # covariance shrunk toward it by d + 5 = 8 pseudo-draws of 2000, which moves it by under 1%: S to the
    # sampling error of 2000 draws, ~3% of a variance (sqrt(2 / 2000)), checked to 10% (about 3 of those)
    generator = torch.Generator().manual_seed(0)
    covariance = torch.tensor([[4.0, 1.2, 0.0], [1.2, 1.0, 0.0], [0.0, 0.0, 0.25]], dtype=torch.float64)
    draws = (
        torch.randn(4, 500, 3, generator=generator, dtype=torch.float64) @ torch.linalg.cholesky(covariance).T
    )
    current = covariance if dense else covariance.diagonal()
    assert adaptation.draws_preconditioner(draws, current) is None
    wrong = torch.tensor([0.04, 1.0, 0.25], dtype=torch.float64)
    measured = adaptation.draws_preconditioner(draws, wrong.diag() if dense else wrong)
    assert measured is not None
    target = covariance if dense else covariance.diagonal()
    torch.testing.assert_close(measured, target, rtol=0.1, atol=0.1)
    # too few draws for a 3-dimensional covariance (fewer than 4 d independent ones): kept
    assert adaptation.draws_preconditioner(draws[:1, :20], wrong) is None
