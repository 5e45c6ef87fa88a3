r"""Exact answers for testing samplers on Gaussian targets.

On a Gaussian target every sampler of this package, with full local batches, is a linear recursion
:math:`z_{k+1} = A z_k + c + \xi_{k+1}` (with random :math:`A` when coins are involved). This module gives
the exact posterior of conjugate models and the exact stationary moments and Monte Carlo standard errors
of a linear recursion, so that tests separate algorithm bugs from discretisation bias and from Monte Carlo
noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import torch


def autocovariances(transition: torch.Tensor, covariance: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    r"""Stationary autocovariances :math:`\Gamma_l = A^l S` for :math:`l = 0, 1, \dots` until negligible."""
    lags = [covariance]
    scale = covariance.abs().max()
    while lags[-1].abs().max() > tol * scale and len(lags) < 100_000:
        lags.append(transition @ lags[-1])
    return torch.stack(lags)


def long_run_covariance(transition: torch.Tensor, covariance: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_{l \in \mathbb Z} \Gamma_l = (I - A)^{-1} S + S (I - A)^{-\top} - S` for stationary
    autocovariances :math:`\Gamma_l = A^l S` (:math:`l \ge 0`), :math:`\Gamma_{-l} = \Gamma_l^\top`."""
    eye = torch.eye(transition.shape[0], dtype=transition.dtype)
    forward = torch.linalg.solve(eye - transition, covariance)
    return forward + forward.T - covariance


def batch_means_standard_error(values: torch.Tensor, num_batches: int = 25) -> torch.Tensor:
    """Standard error of the mean of a stationary series ``values`` (``[K, ...]``) by batch means: the
    spread of the means of ``num_batches`` consecutive batches, each much longer than the
    autocorrelation time. Use it where no exact formula applies (non-Gaussian chains)."""
    k = values.shape[0] // num_batches * num_batches
    means = values[:k].reshape(num_batches, -1, *values.shape[1:]).mean(1)
    return means.std(0) / num_batches**0.5


# ------------------------------------------------------------ federated Gaussian targets
class GaussianClients(NamedTuple):
    r"""Client potentials :math:`U^i(x) = \frac12 (x - \mu_i)^\top A_i (x - \mu_i)` (up to constants).

    ``precisions`` :math:`A_i` is ``[b, d, d]``, ``means`` :math:`\mu_i` is ``[b, d]``.
    """

    precisions: torch.Tensor
    means: torch.Tensor

    @property
    def num_clients(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def posterior(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Mean and covariance of :math:`\pi \propto \exp(-\sum_i U^i)`: precision :math:`\sum_i A_i`."""
        precision = self.precisions.sum(0)
        mean = torch.linalg.solve(precision, (self.precisions @ self.means[..., None]).sum(0))[..., 0]
        return mean, torch.linalg.inv(precision)

    def gradients(self, points: torch.Tensor) -> torch.Tensor:
        """:math:`\\nabla U^i(x_i) = A_i (x_i - \\mu_i)` for points ``[..., b, d]``."""
        return ((points - self.means)[..., None, :] @ self.precisions.transpose(-1, -2))[..., 0, :]

    def with_prior(self, prior_sd: float, prior_weights: torch.Tensor) -> GaussianClients:
        r"""Add the share :math:`\varpi^i \|x\|^2 / (2 s^2)` of an isotropic Gaussian prior to each client."""
        eye = torch.eye(self.dim, dtype=self.means.dtype)
        precisions = self.precisions + prior_weights[:, None, None] * eye / prior_sd**2
        means = torch.linalg.solve(precisions, (self.precisions @ self.means[..., None]))[..., 0]
        return GaussianClients(precisions, means)

    def pyro_model(self, prior_sd: float) -> tuple[Callable, tuple]:
        """A Pyro model with prior :math:`N(0, s^2 I)` and one observed datum per client whose negative
        log-likelihood is :math:`U^i`: ``(model, args)``. Its client ``i`` is datum ``i``; its federated
        potential is :meth:`with_prior` of these clients."""
        dim = self.dim

        def model(means, scale_trils):
            x = pyro.sample("x", dist.Normal(0.0, prior_sd).expand([dim]).to_event(1))
            with pyro.plate("clients", means.shape[0]):
                pyro.sample(
                    "obs",
                    dist.MultivariateNormal(x, scale_tril=pyro.subsample(scale_trils, event_dim=2)),
                    obs=pyro.subsample(means, event_dim=1),
                )

        # a Cholesky factor of each covariance, computed once (not at every gradient evaluation)
        return model, (self.means, torch.linalg.cholesky(torch.linalg.inv(self.precisions)))


def heterogeneous_gaussian_clients(
    num_clients: int, dim: int, *, mean_scale: float = 10.0, seed: int = 0, dtype=torch.float64
) -> GaussianClients:
    r"""Random heterogeneous Gaussian clients, as in the FALD paper's Gaussian experiment (Section 5):
    :math:`\mu_i = s \cdot N(0, I)` and :math:`\Sigma_i` made of random rotated 2×2 blocks scaled by
    :math:`c_i \sim U(0.1, 10.1)`.

    Each 2×2 block of :math:`\Sigma_i` is :math:`c_i R_\theta \mathrm{diag}(1, u) R_\theta^\top` with a
    random angle :math:`\theta` and :math:`u \sim U(0.1, 1)`; ``dim`` must be even. ``mean_scale``
    controls the heterogeneity (0: identical client means).
    """
    if dim % 2:
        raise ValueError(f"dim must be even (2x2 blocks); got {dim}.")
    # drawn on the host by a seeded CPU generator, then placed like any new tensor
    with torch.device("cpu"):
        precisions, means = _random_gaussians(num_clients, dim, mean_scale, seed, dtype)
    device = torch.get_default_device()
    return GaussianClients(precisions.to(device), means.to(device))


def _random_gaussians(num_clients: int, dim: int, mean_scale: float, seed: int, dtype) -> tuple:
    """The precisions and means of :func:`heterogeneous_gaussian_clients`."""
    g = torch.Generator().manual_seed(seed)
    means = mean_scale * torch.randn(num_clients, dim, generator=g, dtype=dtype)
    scales = 0.1 + 10.0 * torch.rand(num_clients, generator=g, dtype=dtype)
    covariances = torch.zeros(num_clients, dim, dim, dtype=dtype)
    for block in range(dim // 2):
        theta = 2 * math.pi * torch.rand(num_clients, generator=g, dtype=dtype)
        cos, sin = theta.cos(), theta.sin()
        rotation = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
        spread = torch.stack(
            [torch.ones_like(theta), 0.1 + 0.9 * torch.rand(num_clients, generator=g, dtype=dtype)], -1
        )
        s = slice(2 * block, 2 * block + 2)
        covariances[:, s, s] = (
            scales[:, None, None] * rotation @ torch.diag_embed(spread) @ rotation.transpose(-1, -2)
        )
    return torch.linalg.inv(covariances), means


def regression_clients(
    x: torch.Tensor,
    y: torch.Tensor,
    clients: torch.Tensor,
    noise_sd: float,
    prior_weights: torch.Tensor,
    prior_sd: float = 1.0,
) -> GaussianClients:
    r"""Client potentials of the conjugate regression :math:`y \sim N(x w, \sigma^2)`, :math:`w \sim N(0,
    s^2 I)`, split by client ids with prior weights :math:`\varpi^i`."""
    b, d = int(clients.max()) + 1, x.shape[1]
    precisions = torch.stack([x[clients == i].T @ x[clients == i] / noise_sd**2 for i in range(b)])
    rhs = torch.stack([x[clients == i].T @ y[clients == i] / noise_sd**2 for i in range(b)])
    precisions = precisions + prior_weights[:, None, None] * torch.eye(d, dtype=x.dtype) / prior_sd**2
    return GaussianClients(precisions, torch.linalg.solve(precisions, rhs[..., None])[..., 0])


# ------------------------------------------------------------ random linear recursions
class StationaryLaw(NamedTuple):
    r"""The stationary law of a sampler's reported draw :math:`r z` for a state :math:`z` that follows a
    random linear recursion.

    Because the coins are independent of the past, :math:`E[z_{k+1} \mid z_k] = \bar F z_k + \bar h`
    with :math:`\bar F = \sum_\omega \pi_\omega F_\omega`, so the stationary autocovariances are
    :math:`\bar F^l \mathrm{Cov}(z)` exactly as for a linear Gaussian recursion: the standard error of a
    sample mean is exact.
    """

    mean: torch.Tensor  #: mean of the reported draw
    cov: torch.Tensor  #: covariance of the reported draw
    mean_transition: torch.Tensor  #: :math:`\bar F`
    state_cov: torch.Tensor  #: stationary covariance of the state
    read: torch.Tensor  #: the draw is ``read @ state``

    def mean_standard_error(self, num_draws: int) -> torch.Tensor:
        """Standard error of each coordinate of the sample mean of ``num_draws`` stationary draws (the
        effective sample size made exact)."""
        long_run = self.read @ long_run_covariance(self.mean_transition, self.state_cov) @ self.read.T
        return (long_run.diagonal() / num_draws).sqrt()

    def covariance_standard_error(self, num_draws: int) -> torch.Tensor:
        r"""Standard error of each entry of the sample covariance of ``num_draws`` stationary draws, for a
        *Gaussian* chain (a single outcome, e.g. FALD with ``comm_prob = 1``; with coins the chain is a
        Gaussian mixture: use :func:`batch_means_standard_error`).

        By Isserlis' theorem :math:`\mathrm{Cov}(z_a z_b, z'_a z'_b) = \Gamma_{aa}\Gamma_{bb} +
        \Gamma_{ab}\Gamma_{ba}` at each lag, so :math:`\mathrm{Var}(\hat S_{ab}) \approx \frac1K
        \sum_{l \in \mathbb Z} (\Gamma_{l,aa}\Gamma_{l,bb} + \Gamma_{l,ab}\Gamma_{l,ba})`, with the
        draws' autocovariances :math:`\Gamma_l = r \bar F^l \Sigma r^\top`.
        """
        gammas = self.read @ autocovariances(self.mean_transition, self.state_cov) @ self.read.T
        diag = gammas.diagonal(dim1=-2, dim2=-1)  # [L, d]
        terms = diag[:, :, None] * diag[:, None, :] + gammas * gammas.transpose(-1, -2)
        return ((terms[0] + 2 * terms[1:].sum(0)) / num_draws).sqrt()


class Outcome(NamedTuple):
    r"""One outcome :math:`\omega` of the coins: :math:`z' = F z + h + \xi`, :math:`\xi \sim N(0, Q)`,
    with probability ``prob``."""

    prob: float
    transition: torch.Tensor
    offset: torch.Tensor
    noise_cov: torch.Tensor


def random_recursion_law(
    outcomes: list[Outcome],
    read: torch.Tensor,
    *,
    method: str = "auto",
    tol: float = 1e-11,
    max_iter: int = 3000,
) -> StationaryLaw:
    r"""Exact stationary law of ``read @ z`` for a random linear recursion of the state ``z``.

    The mean solves :math:`(I - \sum_\omega \pi_\omega F_\omega)\mu = \sum_\omega \pi_\omega h_\omega`.
    With :math:`\delta_\omega = F_\omega \mu + h_\omega - \mu`, the covariance solves
    :math:`\Sigma = \sum_\omega \pi_\omega (F_\omega \Sigma F_\omega^\top + \delta_\omega
    \delta_\omega^\top + Q_\omega)`: vectorised with Kronecker products (``method="kronecker"``,
    :math:`O(n^6)` time for a state of size :math:`n`) or matrix-free (``"iterative"``, see
    :func:`solve_second_moment`: states of a few hundred coordinates); ``"auto"`` picks by size.

    :class:`ValueError` if the recursion is not mean-square stable (its second moments diverge): the map
    :math:`T: \Sigma \mapsto \sum_\omega \pi_\omega F_\omega \Sigma F_\omega^\top` preserves the PSD
    cone, and when its spectral radius exceeds 1 no PSD solution exists (for a source that excites the
    unstable mode); a non-PSD solution is therefore reported.
    """
    n = outcomes[0].offset.shape[0]
    dtype = outcomes[0].offset.dtype
    eye = torch.eye(n, dtype=dtype)
    mean_map = sum(o.prob * o.transition for o in outcomes)
    mean = torch.linalg.solve(eye - mean_map, sum(o.prob * o.offset for o in outcomes))
    source = torch.zeros(n, n, dtype=dtype)
    for o in outcomes:
        jump = o.transition @ mean + o.offset - mean
        source = source + o.prob * (torch.outer(jump, jump) + o.noise_cov)
    if method == "auto":
        method = "kronecker" if n <= 30 else "iterative"
    if method == "kronecker":
        kron = sum(o.prob * torch.kron(o.transition, o.transition) for o in outcomes)
        cov = torch.linalg.solve(torch.eye(n * n, dtype=dtype) - kron, source.reshape(-1)).reshape(n, n)
    elif method == "iterative":
        cov = solve_second_moment(outcomes, source, tol=tol, max_iter=max_iter)
    else:
        raise ValueError(f"method={method!r}: use 'auto', 'kronecker' or 'iterative'.")
    cov = (cov + cov.T) / 2
    eigenvalues = torch.linalg.eigvalsh(cov)
    if eigenvalues[0] < -1e-8 * eigenvalues[-1].abs().clamp_min(1e-300):
        raise ValueError(
            f"the stationary covariance solves to a non-PSD matrix (smallest eigenvalue "
            f"{float(eigenvalues[0]):.3e}): the recursion is not mean-square stable."
        )
    return StationaryLaw(read @ mean, read @ cov @ read.T, mean_map, cov, read)


def _client_noise_cov(b: int, d: int, step_size: float, noise_corr: float, dtype) -> torch.Tensor:
    """Covariance of the stacked client noises :math:`\\sqrt{2\\gamma} Z^i`
    (:func:`pyro_fed.algorithms.langevin.client_noise`)."""
    mix = noise_corr / b * torch.ones(b, b, dtype=dtype) + (1 - noise_corr) * torch.eye(b, dtype=dtype)
    return 2 * step_size * torch.kron(mix, torch.eye(d, dtype=dtype))


def _average_map(b: int, d: int, dtype) -> torch.Tensor:
    return torch.kron(torch.full((b, b), 1.0 / b, dtype=dtype), torch.eye(d, dtype=dtype))


# ------------------------------------------------------------ large states (matrix-free solves)
def second_moment_operator(outcomes: list[Outcome]) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""The map :math:`W \mapsto \sum_\omega \pi_\omega F_\omega W F_\omega^\top` of a random linear
    recursion (``n × n`` matrices in and out; never forms the :math:`n^2 \times n^2` Kronecker matrix)."""
    pairs = [(o.prob, o.transition) for o in outcomes]

    def apply(w: torch.Tensor) -> torch.Tensor:
        return sum(prob * (f @ w @ f.T) for prob, f in pairs)

    return apply


def _gmres(apply, rhs, *, tol: float, restart: int, max_iter: int) -> tuple[torch.Tensor, int, float]:
    """Restarted GMRES for ``apply(x) = rhs`` on flat vectors (classical Gram–Schmidt, twice)."""
    x = torch.zeros_like(rhs)
    norm_rhs = float(rhs.norm())
    if norm_rhs == 0.0:
        return x, 0, 0.0
    total = 0
    while True:
        r = rhs - apply(x)
        beta = float(r.norm())
        if beta <= tol * norm_rhs or total >= max_iter:
            return x, total, beta / norm_rhs
        basis = torch.empty(restart + 1, rhs.shape[0], dtype=rhs.dtype)
        basis[0] = r / beta
        hess = torch.zeros(restart + 1, restart, dtype=rhs.dtype)
        for j in range(restart):
            w = apply(basis[j])
            for _ in range(2):  # CGS2: re-orthogonalise once for stability
                coef = basis[: j + 1] @ w
                w = w - coef @ basis[: j + 1]
                hess[: j + 1, j] += coef
            hess[j + 1, j] = w.norm()
            total += 1
            target = torch.zeros(j + 2, dtype=rhs.dtype)
            target[0] = beta
            y = torch.linalg.lstsq(hess[: j + 2, : j + 1], target[:, None]).solution[:, 0]
            small = float((target - hess[: j + 2, : j + 1] @ y).norm())
            if small <= 0.1 * tol * norm_rhs or hess[j + 1, j] <= 1e-300 or total >= max_iter:
                break
            basis[j + 1] = w / hess[j + 1, j]
        x = x + y @ basis[: j + 1]


def solve_second_moment(
    outcomes: list[Outcome],
    source: torch.Tensor,
    *,
    tol: float = 1e-11,
    restart: int = 300,
    max_iter: int = 3000,
) -> torch.Tensor:
    r"""Solve :math:`W = \sum_\omega \pi_\omega F_\omega W F_\omega^\top + S` for a state of size ``n`` in
    :math:`O(n^3)` per iteration and :math:`O(n^2)` memory (the Kronecker solve of
    Kronecker solve needs :math:`O(n^6)` time and :math:`O(n^4)` memory).

    Matrix-free restarted GMRES on :math:`(I - T)\,\mathrm{vec}\,W = \mathrm{vec}\,S`. Its iteration count
    grows with the number of eigenvalues of :math:`T` close to 1 (the slow modes of the chain), not with
    ``n``. The residual is recomputed exactly at the end; :class:`RuntimeError` if it exceeds ``10 * tol``.
    The returned ``W`` is symmetrised. This solves the linear equation whether or not the recursion is
    mean-square stable; see :func:`random_recursion_law` for the stability check.
    """
    n = source.shape[0]
    operator = second_moment_operator(outcomes)

    def apply(flat: torch.Tensor) -> torch.Tensor:
        w = flat.reshape(n, n)
        return (w - operator(w)).reshape(-1)

    flat, iterations, _ = _gmres(apply, source.reshape(-1), tol=tol, restart=restart, max_iter=max_iter)
    w = flat.reshape(n, n)
    w = (w + w.T) / 2
    residual = float((source - (w - operator(w))).norm() / source.norm().clamp_min(1e-300))
    if residual > 10 * tol:
        raise RuntimeError(
            f"second-moment solve did not converge: relative residual {residual:.2e} after {iterations} "
            f"iterations (tol {tol:.0e}); raise max_iter or check mean-square stability."
        )
    return w


def fald_outcomes(
    clients: GaussianClients, step_size: float, comm_prob: float, noise_corr: float
) -> tuple[list[Outcome], torch.Tensor]:
    r"""The random linear recursion of FALD with full local batches on Gaussian clients over the stacked
    :math:`(X^1, \dots, X^b)`, with outcomes "average" (:math:`p_c`) and "keep": its outcomes and the
    read-out matrix of :math:`\bar X`."""
    b, d, dtype = clients.num_clients, clients.dim, clients.means.dtype
    local = torch.eye(b * d, dtype=dtype) - step_size * torch.block_diag(*clients.precisions)
    offset = step_size * (clients.precisions @ clients.means[..., None]).reshape(-1)
    noise = _client_noise_cov(b, d, step_size, noise_corr, dtype)
    outcomes = [
        Outcome(prob, m @ local, m @ offset, m @ noise @ m.T)
        for prob, m in (
            (comm_prob, _average_map(b, d, dtype)),
            (1 - comm_prob, torch.eye(b * d, dtype=dtype)),
        )
        if prob > 0
    ]
    return outcomes, torch.kron(torch.full((1, b), 1.0 / b, dtype=dtype), torch.eye(d, dtype=dtype))


def vr_fald_outcomes(
    clients: GaussianClients, step_size: float, comm_prob: float, noise_corr: float, refresh_prob: float
) -> tuple[list[Outcome], torch.Tensor]:
    r"""The random linear recursion of VR-FALD⋆ with full local batches on Gaussian clients: its outcomes
    and the read-out matrix of :math:`\bar X`. With full batches the shift :math:`C = \bar A Y - \bar c`
    is a function of :math:`Y`, so the state is :math:`(X^1, \dots, X^b, Y)` and
    :math:`G^i = A_i (X^i - Y) + \bar A Y - \bar c`; four outcomes (average or not, refresh or not)."""
    b, d, dtype = clients.num_clients, clients.dim, clients.means.dtype
    n = b * d
    blocks = torch.block_diag(*clients.precisions)
    mean_precision = clients.precisions.mean(0)
    mean_offset = (clients.precisions @ clients.means[..., None]).mean(0)[..., 0]
    ones = torch.kron(torch.ones(b, 1, dtype=dtype), torch.eye(d, dtype=dtype))
    step_x = torch.cat(
        [torch.eye(n, dtype=dtype) - step_size * blocks, step_size * (blocks @ ones - ones @ mean_precision)],
        1,
    )
    offset_x = step_size * ones @ mean_offset
    noise_x = _client_noise_cov(b, d, step_size, noise_corr, dtype)
    keep_y = torch.cat([torch.zeros(d, n, dtype=dtype), torch.eye(d, dtype=dtype)], 1)
    refresh_y = torch.cat([ones.T / b, torch.zeros(d, d, dtype=dtype)], 1)
    outcomes = []
    for comm, p_comm in ((True, comm_prob), (False, 1 - comm_prob)):
        m = _average_map(b, d, dtype) if comm else torch.eye(n, dtype=dtype)
        for y_row, p_refresh in ((refresh_y, refresh_prob), (keep_y, 1 - refresh_prob)):
            prob = p_comm * p_refresh
            if prob == 0:
                continue
            transition = torch.cat([m @ step_x, y_row], 0)
            offset = torch.cat([m @ offset_x, torch.zeros(d, dtype=dtype)])
            noise = torch.block_diag(m @ noise_x @ m.T, torch.zeros(d, d, dtype=dtype))
            outcomes.append(Outcome(prob, transition, offset, noise))
    return outcomes, torch.cat([ones.T / b, torch.zeros(d, d, dtype=dtype)], 1)


def fald_stationary_law(
    clients: GaussianClients, step_size: float, comm_prob: float, noise_corr: float, **solver
) -> StationaryLaw:
    r"""Exact stationary law of FALD's reported draw :math:`\bar X` with full local batches on Gaussian
    clients (:mod:`pyro_fed.algorithms.fald`); ``solver`` options go to :func:`random_recursion_law`."""
    return random_recursion_law(*fald_outcomes(clients, step_size, comm_prob, noise_corr), **solver)


def vr_fald_stationary_law(
    clients: GaussianClients,
    step_size: float,
    comm_prob: float,
    noise_corr: float,
    refresh_prob: float,
    **solver,
) -> StationaryLaw:
    r"""Exact stationary law of VR-FALD⋆'s reported draw :math:`\bar X` with full local batches on Gaussian
    clients (:mod:`pyro_fed.algorithms.vr_fald`); ``solver`` options go to :func:`random_recursion_law`."""
    return random_recursion_law(
        *vr_fald_outcomes(clients, step_size, comm_prob, noise_corr, refresh_prob), **solver
    )


def dula_outcomes(
    clients: GaussianClients,
    step_size: float,
    consensus_size: float,
    laplacian: torch.Tensor,
    inverse_mass: torch.Tensor | None = None,
    consensus_rounds: int = 1,
) -> tuple[list[Outcome], torch.Tensor]:
    r"""The linear recursion of D-ULA with constant steps and full local batches on Gaussian agents over the
    stacked :math:`(w_1, \dots, w_n)`: :math:`w' = ((I - \beta L) \otimes I) w - \alpha n\, M A_i (w_i -
    \mu_i) + \sqrt{2 \alpha n}\, R z_i` (:mod:`pyro_fed.algorithms.dula`; :math:`M = R R^\top` the inverse
    mass, ``[d]`` or ``[d, d]``, the identity by default; ``consensus_rounds`` :math:`K` exchanges per step:
    :math:`(I - \beta L)^K`): its single outcome and the read-out matrix of :math:`\bar w`."""
    n, d, dtype = clients.num_clients, clients.dim, clients.means.dtype
    mass = torch.eye(d, dtype=dtype) if inverse_mass is None else inverse_mass.to(dtype)
    mass = torch.diag(mass) if mass.dim() == 1 else mass
    scaled = step_size * n * mass @ clients.precisions  # [n, d, d]
    exchange = torch.eye(n, dtype=dtype) - consensus_size * laplacian.to(dtype)
    mixing = torch.kron(torch.linalg.matrix_power(exchange, consensus_rounds), torch.eye(d, dtype=dtype))
    transition = mixing - torch.block_diag(*scaled)
    offset = (scaled @ clients.means[..., None]).reshape(-1)
    noise = 2 * step_size * n * torch.kron(torch.eye(n, dtype=dtype), mass)
    read = torch.kron(torch.full((1, n), 1.0 / n, dtype=dtype), torch.eye(d, dtype=dtype))
    return [Outcome(1.0, transition, offset, noise)], read


def dula_stationary_law(
    clients: GaussianClients,
    step_size: float,
    consensus_size: float,
    laplacian: torch.Tensor,
    inverse_mass: torch.Tensor | None = None,
    consensus_rounds: int = 1,
    **solver,
) -> StationaryLaw:
    r"""Exact stationary law of D-ULA's reported draw :math:`\bar w` with constant steps and full local
    batches on Gaussian agents (:func:`dula_outcomes`); ``solver`` options go to
    :func:`random_recursion_law`."""
    outcomes = dula_outcomes(clients, step_size, consensus_size, laplacian, inverse_mass, consensus_rounds)
    return random_recursion_law(*outcomes, **solver)


def squared_distance_bias(law: StationaryLaw, target_mean: torch.Tensor, target_cov: torch.Tensor) -> float:
    r"""Stationary bias of the statistic :math:`\|X - x_\star\|^2` as an estimator of
    :math:`\sigma_\star^2 = \mathrm{tr}\,\Sigma_\star`: :math:`\mathrm{tr}\,\mathrm{Cov}(X) +
    \|E X - x_\star\|^2 - \mathrm{tr}\,\Sigma_\star` (the FALD paper's Section 5 statistic)."""
    return float(law.cov.trace() + (law.mean - target_mean).square().sum() - target_cov.trace())
