r"""Warm-up adaptation: a diagonal preconditioner and a step size from the curvature of the potential.

The samplers run *preconditioned* Langevin steps. With an inverse mass matrix :math:`\mathrm{diag}(m)`,
:math:`m \in \mathbb R^d_{>0}`, a client step reads

.. math::

    X^i \leftarrow X^i - \gamma\, m \odot \hat\nabla U^i(X^i) + \sqrt{2\gamma m} \odot Z^i,

which is the plain step of size :math:`\gamma` in the coordinates :math:`y = x / \sqrt m`, on the potential
:math:`U(\sqrt m \odot y)`. Its continuous-time limit keeps the posterior invariant; a preconditioner close to
the posterior's scales makes the rescaled target close to isotropic, so that one step size suits every
coordinate (a posterior whose scales differ by 100× mixes 10^4 times faster than with an isotropic step).
Everything below is computed once, before the chains start, from what a federated system can compute —
client gradients, Hessian-vector products of each client's own potential, and averages across clients —
never from the pooled data:

1. the **mode** :math:`\hat x` of :math:`U = \sum_i U^i` by L-BFGS
   (:func:`~pyro_fed.kernels.warmup.find_mode`: every evaluation is one round in which each client uploads
   its gradient and potential);
2. each client's **Hessian** at the mode by forward-over-reverse differentiation (:func:`client_hessians`,
   :math:`d` Hessian-vector products; above ``EXACT_DIAGONAL_DIMENSIONS`` coordinates its diagonal is
   estimated from ``DIAGONAL_PROBES`` random probes, a fixed number of data passes), summed by the server
   into :math:`H = \nabla^2 U(\hat x)`. The
   *diagonal* preconditioner is :math:`m_k = 1 / |H_{kk}|` (:func:`preconditioner`), the Laplace
   approximation's marginal variances when the posterior's correlations are weak; the *dense* one is
   :math:`M = |H|^{-1}` (:func:`dense_preconditioner`, the absolute value taken on the eigenvalues), the
   Laplace approximation's covariance, which also undoes correlations. The dense step
   :math:`X - \gamma M \nabla U^i + \sqrt{2\gamma} R Z`, :math:`R R^\top = M`, is the plain step in the
   coordinates :math:`y = R^{-1} x`; it costs a :math:`d \times d` product per client and iteration and
   needs every client's Hessian (:math:`d^2` floats), so it is chosen when :math:`d` is at most
   ``DENSE_DIMENSIONS`` and the diagonal one leaves the Hessian ill-conditioned: the condition number
   :math:`\kappa` of :math:`\sqrt m H \sqrt m` (:func:`condition_number`) above ``DENSE_CONDITION``, or
   above 2 on models of at most 16 coordinates, where a dense iteration costs no more
   (:func:`dense_condition`): Langevin's slowest direction relaxes :math:`\kappa` times slower than its
   stiffest allows;
3. the **stiffness** :math:`\lambda^i` of each client, the largest eigenvalue (in absolute value) of its
   preconditioned Hessian :math:`R^\top \nabla^2 U^i(x) R` (:math:`R = \sqrt m` for the diagonal form) by
   the Lanczos method (:func:`client_stiffness`), the largest over the clients, at the mode and at a few
   draws :math:`x = \hat x + R\, N(0, I)` of the Laplace approximation, each pulled toward the mode until
   its potential is at the level of posterior draws (:func:`typical_points`); the step is set for their
   root mean square over the typical points, :math:`\bar\lambda`, and kept stable at the largest
   (:func:`step_stiffness`): the step's bias is a posterior average of local errors, while a client step
   is stable only when :math:`\gamma \lambda^i < 2` wherever the chain goes, and a posterior that is far
   from Gaussian (a neural network's, a hierarchical one's) can be ten to a hundred times stiffer a
   standard deviation away from its mode;
4. with minibatches, the **gradient noise**: the variance :math:`V_k` of the sum of the clients' gradient
   estimates, measured on a few minibatches at a few draws of the Laplace approximation
   :math:`\hat x + \sqrt m \odot N(0, I)` and averaged over them (:func:`gradient_noise`). Typical points,
   not the mode: a minibatch's gradient varies with the per-datum residuals, which are smallest at the
   mode (on a small Bayesian network the noise at posterior draws is 10–40 times that at the mode), and
   the stationary excess variance is set by the noise where the chain spends its time. :math:`m_k V_k`
   below is the variance in the preconditioned coordinates :math:`y`.

The step size (:func:`step_size`) is the largest one that keeps the two discretisation errors small
together. On a Gaussian target of curvature :math:`\lambda` (in the rescaled coordinates), Langevin with
step :math:`h` and gradient noise of variance :math:`V` has stationary variance :math:`\lambda^{-1}(1 +
hV/2) / (1 - h\lambda/2)`. The federated samplers move the client average with :math:`h = \gamma / b` on
:math:`U`, and client :math:`i` alone with :math:`\gamma` on :math:`U^i`; the step is the one that makes
that variance :math:`1 + \varepsilon` times the posterior's along the stiffest direction,

.. math::

    \frac{1 + hV/2}{1 - h\lambda/2} = 1 + \varepsilon, \qquad
    \gamma = \frac{2 \varepsilon\, b}{\max_k m_k V_k + (1 + \varepsilon)\, b\, \bar\lambda},

with ``VARIANCE_TARGET`` :math:`\varepsilon = 0.1`: the stiffest direction's standard deviation about 5% too
wide, from the step and the minibatch noise together (with exact gradients :math:`\gamma \bar\lambda =
2\varepsilon / (1 + \varepsilon)` = ``STEP_TARGET``), every other direction less; on a Gaussian
posterior :math:`\bar\lambda` is :math:`\max_i \lambda^i`, elsewhere the typical stiffness.

5. The **minibatch size**, when neither it nor the step is given (:func:`choose_batch_size`): the smallest
   whose noise takes at most ``BATCH_NOISE_SHARE`` of that budget, predicted for every size from one
   measurement (:func:`batch_noise`); full local batches where it would evaluate more than half the data.
   A smaller minibatch makes the noise set the step, which then falls in proportion while the iteration's
   cost barely falls; a larger one costs more for the same step.
6. The **thinning**, when not given (:func:`thinning_for`): half the autocorrelation time of the slowest
   direction at the chosen step, so that draws are nearly independent, as NUTS's are.

Last, a **pilot run** (:func:`pilot_step`) checks that step where the posterior's draws go: the typical
points move as ``P`` particles of the unadjusted Langevin recursion on :math:`U`, at the move the samplers
make on it, for a Langevin time of ``PILOT_DURATION`` but at most the warm-up's upload rounds, and the
stiffness is measured at them ``PILOT_CHECKS`` times, the step set again each time by the rule for every
stiffness measured so far. Laplace draws, even pulled in, misjudge a far-from-Gaussian posterior: on a
3-unit network the chains reach points ten times stiffer than any of them, and a step set at them made the
posterior 15-20% too wide; eight schools' mode and Laplace draws sit in its scale's tail.

**References:** the preconditioned Langevin step: Girolami & Calderhead, *Riemann manifold Langevin and
Hamiltonian Monte Carlo methods*, JRSS B 2011 (with a constant metric); the step-size stability condition:
Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics*, AISTATS 2023, Section 4.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..data.minibatch import client_batch_sizes
from .langevin import langevin_step

#: :math:`\varepsilon`: the relative excess of the stationary variance along the stiffest direction, from the
#: step and the gradient noise together
VARIANCE_TARGET = 0.1
#: the product of the step and the stiffest preconditioned curvature with exact gradients
STEP_TARGET = 2 * VARIANCE_TARGET / (1 + VARIANCE_TARGET)
#: the largest product of the step and a stiffness met anywhere (the mode, a typical point, a pilot particle):
#: half a Gaussian direction's stability bound of 2 (see :func:`step_stiffness`)
STABLE_PRODUCT = 1.0
#: curvatures below this fraction of the largest are raised to it (flat or non-convex directions)
CURVATURE_FLOOR = 1e-8
#: eigenvalues of a dense inverse mass below this fraction of the largest are raised to it when its square
#: root is taken (rounding's, in float64; the matrix's own range can reach 1e12, see dense_preconditioner)
ROOT_FLOOR = 1e-15
#: Hessian-vector products computed together (bounds memory: one full-data gradient per product)
DIRECTIONS_PER_PASS = 32
#: the largest dimension whose Hessian diagonal is computed exactly where its estimate is not accurate
#: (:func:`client_hessians`: ``d`` Hessian-vector products, ``d / DIRECTIONS_PER_PASS`` full-data passes);
#: above it, it is estimated whatever its accuracy
EXACT_DIAGONAL_DIMENSIONS = 2048
#: the random probes of the estimated Hessian diagonal (``DIAGONAL_PROBES / DIRECTIONS_PER_PASS`` full-data
#: passes, whatever the dimension)
DIAGONAL_PROBES = 256
#: above this dimension the estimate is tried first: its passes are fewer than the exact diagonal's
ESTIMATED_DIAGONAL_ABOVE = DIAGONAL_PROBES
#: groups of the probes whose means give the estimate's standard error (each client uploads its ``d``
#: numbers per group)
DIAGONAL_GROUPS = 16
#: the estimate is taken below ``EXACT_DIAGONAL_DIMENSIONS`` when 95% of the summed diagonal's entries have a
#: relative standard error at most this: the preconditioned curvatures are then within about 15% of their
#: exact values (3 standard errors), which slows the slowest direction by at most about a third, where the
#: exact diagonal would cost ``d / DIRECTIONS_PER_PASS`` more passes (at ``d = 1000`` and ``N = 2e4``, 40 s
#: against the estimate's 10 s). The stiffness, measured with the estimate, keeps the step stable whatever
#: its error: a poor estimate slows the chains, it does not bias them
DIAGONAL_TOLERANCE = 0.05
#: :math:`T`: the pilot's length in the continuous time of the Langevin diffusion (see :func:`pilot_step`)
PILOT_DURATION = 10.0
#: the pilot's stiffness measurements (and chances to shrink the step), at most
PILOT_CHECKS = 16
#: the pilot's iterations between two measurements, at least (a measurement costs a few Hessian-vector
#: products at every particle, tens of gradients)
PILOT_MIN_BLOCK = 64
#: the relative accuracy of the pilot's stiffness measurements
PILOT_TOLERANCE = 1e-2
#: the pilot's iterations whose noise is drawn at once
PILOT_NOISE_CHUNK = 256
#: halvings of a Laplace draw's offset at most, to bring it to the potential level of posterior draws
TYPICAL_HALVINGS = 10
#: largest dimension for which the dense preconditioner is considered (its iteration costs ``2 d^2`` flops
#: per client, its set-up ``d^2`` floats from every client)
DENSE_DIMENSIONS = 200
#: the share of the excess variance (``VARIANCE_TARGET``) that an automatic minibatch's noise may take (see
#: :func:`choose_batch_size`)
BATCH_NOISE_SHARE = 0.1
#: the largest minibatch size at which the noise is measured to choose one (every other size is predicted
#: from it; see :func:`probe_batch_sizes`)
PROBE_BATCH = 16
#: iterations per draw chosen automatically, at most (see :func:`thinning_for`)
MAX_THINNING = 100
#: the share of the iterations' data evaluations that automatic refreshes or snapshots take
REFRESH_SHARE = 0.1
#: condition number of the diagonally preconditioned Hessian above which the dense preconditioner is chosen
#: (a dense iteration costs up to a few times a diagonal one on cheap models: it pays once the slowest
#: direction would relax this many times slower), and the spread of the draws' covariance beyond chance
#: above which the windowed adaptation replaces the preconditioner (see :func:`draws_preconditioner`)
DENSE_CONDITION = 4.0
#: on models of at most ``SMALL_DIMENSIONS`` coordinates a dense iteration costs what a diagonal one does
#: (its ``d x d`` product is one operation among the iteration's hundreds: 0.31 against 0.28 ms per
#: iteration on a 5-coordinate regression), and the dense preconditioner is chosen above
#: ``SMALL_DENSE_CONDITION``: on posteriordb's ``kidscore_interaction_c`` (``d = 5``, :math:`\kappa = 3.4`
#: after the diagonal one) it gave 2.2 times the effective draws per second (its thinning 18 -> 6), at
#: :math:`\kappa = 2.0` (``sblri``) 1.13 times
SMALL_DIMENSIONS, SMALL_DENSE_CONDITION = 16, 2.0


class Adaptation(NamedTuple):
    """What the warm-up chose, and why."""

    step_size: float  #: :math:`\gamma`
    #: the inverse mass: :math:`m`, ``[d]`` (diagonal), or :math:`M`, ``[d, d]`` (dense)
    preconditioner: torch.Tensor
    mode: torch.Tensor  #: :math:`\hat x`, ``[d]``, where the curvature was measured
    curvature: torch.Tensor  #: the Hessian diagonal of :math:`U` at :math:`\hat x`, ``[d]``
    #: the stiffness the step is set for (:func:`step_stiffness`: the root mean square over the typical points
    #: and the pilot's particles of :math:`\max_i \lambda^i`; for steps from the clients' average, FALD with
    #: ``comm_prob = 1``, the stiffness of :math:`U / b`, and for a server's step that of :math:`U`)
    stiffness: float
    noise: float  #: :math:`\max_k m_k V_k` (0 with full local batches)
    #: rounds in which every client uploaded ``d`` floats: the mode search, the curvature (``d`` for a
    #: gathered Hessian), the power iterations of a stiffness of the whole potential, the noise
    rounds: int
    #: :math:`\kappa` of the diagonally preconditioned Hessian (``nan`` when the Hessian was not gathered)
    condition: float = float("nan")
    #: the draws of the Laplace approximation where the stiffness (with the mode) and the noise were measured
    typical_points: torch.Tensor | None = None
    #: the iterations of the pilot run that checked the step where the posterior's draws go (see
    #: :func:`pilot_step`; 0 when the step was the user's)
    pilot_iterations: int = 0
    #: the Langevin time the pilot covered (``PILOT_DURATION`` unless the warm-up's upload rounds cut it)
    pilot_time: float = 0.0
    #: the Newton decrement :math:`\sqrt{\nabla U^\top M \nabla U}` at :math:`\hat x`, :math:`M` the
    #: Laplace approximation's covariance: its distance to the true mode in posterior sds (see
    #: :mod:`pyro_fed.algorithms.mode`)
    mode_decrement: float = 0.0
    #: the minibatch size per client the iterations use (``None``: full local batches)
    batch_size: int | float | None = None
    #: iterations per draw (:func:`thinning_for` when automatic)
    thinning: int = 1
    #: the smallest curvature of the preconditioned Hessian at the mode (1 when it was not gathered: the
    #: diagonal one's eigenvalues average 1), which sets the slowest relaxation
    slowest: float = 1.0
    #: each client's Hessian diagonal :math:`\partial^2_{kk} U^i` at the mode, ``[b, d]``
    client_curvatures: torch.Tensor | None = None
    #: the largest stiffness measured (the mode's, the typical points', the pilot's), in the units of
    #: ``stiffness``: the step keeps it stable (see :func:`step_stiffness`)
    largest_stiffness: float = float("nan")
    #: the :func:`relaxation_time` of the slowest direction at the automatic step, in iterations, which the
    #: automatic thinning is half of, up to ``MAX_THINNING`` (``nan`` with a step of the user's)
    relaxation: float = float("nan")
    #: the averaging probability the run's communication setting has (FALD's family; ``nan`` elsewhere, or
    #: where the warm-up left the user's unchanged at 1), chosen by the clients' quadratic model where the
    #: user left it automatic (see :func:`~pyro_fed.algorithms.drift.finish_communication`)
    comm_prob: float = float("nan")
    #: VR-FALD⋆'s refresh probability the quadratic model chose (``nan``: the rule of
    #: :func:`refresh_probability`, or the user's)
    refresh_prob: float = float("nan")
    #: the predicted drift error of the run's communication setting, in posterior sds (``nan``: not
    #: predicted; see :meth:`~pyro_fed.algorithms.drift.ClientQuadratics.error`)
    drift_error: float = float("nan")
    #: QLSD's quantisation levels chosen where the user left them automatic (``inf``: no compression;
    #: ``nan``: the user's; see :func:`~pyro_fed.algorithms.levels.choose_levels`)
    quantization_levels: float = float("nan")


def hessian_products(client_gradients: Callable, point: torch.Tensor, tangents: torch.Tensor) -> torch.Tensor:
    """Each client's Hessian at ``point`` (``[d]``, or one per row, ``[m, d]``) times its own tangent:
    ``tangents [m, b, d]`` -> ``[m, b, d]``."""
    points = (point if point.dim() == 1 else point[:, None, :]).expand(tangents.shape).contiguous()
    return torch.func.jvp(client_gradients, (points,), (tangents,))[1]


def _products(client_gradients: Callable, point: torch.Tensor, num_clients: int, directions):
    """Every client's Hessian at ``point`` times each block of ``directions`` (``[m, d]`` blocks of at most
    ``DIRECTIONS_PER_PASS``, one full-data pass each): ``(block [m, d], products [m, b, d])`` per block."""
    for block in directions:
        yield block, hessian_products(client_gradients, point, block[:, None, :].expand(-1, num_clients, -1))


def _unit_products(client_gradients: Callable, point: torch.Tensor, num_clients: int):
    """:func:`_products` with the unit vectors, ``DIRECTIONS_PER_PASS`` of them per full-data pass."""
    eye = torch.eye(point.shape[-1], dtype=point.dtype, device=point.device)
    blocks = (eye[start : start + DIRECTIONS_PER_PASS] for start in range(0, len(eye), DIRECTIONS_PER_PASS))
    return _products(client_gradients, point, num_clients, blocks)


def client_hessian_matrices(
    client_gradients: Callable, point: torch.Tensor, num_clients: int
) -> torch.Tensor:
    r"""Every client's whole Hessian :math:`\nabla^2 U^i` at ``point`` (``[d]``), ``[b, d, d]``, from
    :math:`d` Hessian-vector products (as :func:`client_hessians`)."""
    rows = torch.cat([products for _, products in _unit_products(client_gradients, point, num_clients)])
    return rows.movedim(0, -1)  # [b, d, d]: H_i e_k in column k


def client_hessians(
    client_gradients: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    num_clients: int,
    network,
    *,
    total: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Every client's Hessian diagonal :math:`\partial^2_{kk} U^i` at ``point`` (``[d]``), ``[b, d]``, and
    with ``total`` the sum of the clients' Hessians :math:`\sum_i \nabla^2 U^i`, ``[d, d]`` (else
    ``None``).

    Exact with ``total`` or up to ``ESTIMATED_DIAGONAL_ABOVE`` coordinates: :math:`d` Hessian-vector
    products with the unit vectors, ``DIRECTIONS_PER_PASS`` per full-data pass. Above it, first a fixed
    number of passes whatever :math:`d`: Bekas, Kokiopoulou and Saad's estimator with ``K =
    DIAGONAL_PROBES`` Rademacher probes :math:`z_k \in \{-1, 1\}^d`,

    .. math:: \hat D^i = \frac1K \sum_{k=1}^K z_k \odot \nabla^2 U^i z_k,

    unbiased, each entry with variance :math:`\frac1K \sum_{j \ne l} (\nabla^2_{lj} U^i)^2`: accurate
    where the Hessian's rows are dominated by their diagonal (a regression's), noisy where coordinates are
    strongly coupled (a network's weights). Its standard error is measured from ``DIAGONAL_GROUPS`` groups of
    the probes, on the clients' sum; where 95% of the entries are within ``DIAGONAL_TOLERANCE`` (relative)
    the estimate is taken, else, up to ``EXACT_DIAGONAL_DIMENSIONS`` coordinates, the exact diagonal is
    computed after it. The probes are drawn from a fixed seed, the same in every process holding clients,
    and the choice is made on the clients' sum: the same everywhere.

    **Reference:** Bekas, Kokiopoulou, Saad, *An estimator for the diagonal of a matrix*, Applied Numerical
    Mathematics 57, 2007.

    :param client_gradients: the clients' full gradients, points ``[m, b, d]`` -> ``[m, b, d]``,
        differentiable by :func:`torch.func.jvp`.
    :param network: the :class:`~pyro_fed.network.base.Network` that sums the clients' Hessians.
    :returns: the diagonals, the summed Hessian (or ``None``), and the rounds of uploads of ``d`` floats
        per client they cost (1 for the exact diagonal, ``d`` for the gathered Hessian, ``DIAGONAL_GROUPS``
        for the estimate).
    """
    dim, rounds = point.shape[-1], 0
    if not total and dim > ESTIMATED_DIAGONAL_ABOVE:
        estimate, error = _estimated_diagonals(client_gradients, point, num_clients, network)
        rounds += DIAGONAL_GROUPS
        if error <= DIAGONAL_TOLERANCE or dim > EXACT_DIAGONAL_DIMENSIONS:
            return estimate, None, rounds
    diagonals, rows = [], []
    for basis, products in _unit_products(client_gradients, point, num_clients):
        diagonals.append((products * basis[:, None, :]).sum(-1))  # [m, b]: entry (k, k) of each client
        if total:
            rows.append(network.sum(products))  # [m, d]: rows k of the summed Hessian
    hessian = None
    if total:
        hessian = torch.cat(rows)
        hessian = (hessian + hessian.T) / 2  # symmetric up to rounding: exactly, for eigh
    return torch.cat(diagonals).T, hessian, rounds + (dim if total else 1)


def _estimated_diagonals(
    client_gradients: Callable, point: torch.Tensor, num_clients: int, network
) -> tuple[torch.Tensor, float]:
    """Bekas, Kokiopoulou and Saad's estimate of every client's Hessian diagonal (``[b, d]``, see
    :func:`client_hessians`) and the 95th percentile over the coordinates of the relative standard error of
    their sum, from the spread of the ``DIAGONAL_GROUPS`` group means of the probes."""
    size = DIAGONAL_PROBES // DIAGONAL_GROUPS
    groups = []
    for probes, products in _probe_products(client_gradients, point, num_clients):
        terms = products * probes[:, None, :]  # [m, b, d]: z_k * H_i z_k
        groups += [terms[start : start + size].sum(0) for start in range(0, len(terms), size)]
    groups = torch.stack(groups) / size  # [G, b, d]
    estimate = groups.mean(0)
    totals = network.sum(groups)  # [G, d]: each client uploads its group means
    error = totals.std(0) / (DIAGONAL_GROUPS**0.5 * totals.mean(0).abs().clamp_min(1e-300))
    return estimate, float(error.quantile(0.95))


def _probe_products(client_gradients: Callable, point: torch.Tensor, num_clients: int):
    """:func:`_products` with ``DIAGONAL_PROBES`` Rademacher probes drawn from a fixed seed,
    ``DIRECTIONS_PER_PASS`` per full-data pass."""
    generator = torch.Generator().manual_seed(0)
    counts = [
        min(DIRECTIONS_PER_PASS, DIAGONAL_PROBES - start)
        for start in range(0, DIAGONAL_PROBES, DIRECTIONS_PER_PASS)
    ]
    blocks = (
        (2 * torch.randint(0, 2, (count, point.shape[-1]), generator=generator) - 1).to(point)
        for count in counts
    )
    return _products(client_gradients, point, num_clients, blocks)


def preconditioner(curvature: torch.Tensor) -> torch.Tensor:
    """The diagonal inverse mass :math:`m_k = 1 / |H_{kk}|` from the Hessian diagonal of :math:`U` (``[d]``);
    curvatures below ``CURVATURE_FLOOR`` times the largest are raised to it, so that a flat direction gets a
    large but finite scale."""
    return 1.0 / floored_curvature(curvature)


def floored_curvature(curvature: torch.Tensor) -> torch.Tensor:
    """The magnitudes :math:`|H_{kk}|` of a Hessian diagonal (``[d]``), those below ``CURVATURE_FLOOR`` times
    the largest raised to it: the curvatures that :func:`preconditioner` inverts."""
    magnitude = curvature.abs()
    return magnitude.clamp_min(CURVATURE_FLOOR * float(magnitude.max().clamp_min(1e-300)))


def dense_preconditioner(hessian: torch.Tensor) -> torch.Tensor:
    r"""The dense inverse mass :math:`M = S\, \tilde Q\, \mathrm{diag}(1 / |\tilde\lambda|)\, \tilde Q^\top
    S` from the Hessian :math:`H` of :math:`U` (``[d, d]``): :math:`S = \mathrm{diag}(m)^{1/2}` the diagonal
    preconditioner's scales (:func:`preconditioner`) and :math:`\tilde H = S H S = \tilde Q\,
    \mathrm{diag}(\tilde\lambda)\, \tilde Q^\top` the Hessian in the coordinates they scale, whose
    eigenvalues are floored as in :func:`preconditioner` (a saddle's negative curvature is taken by its
    magnitude). Computed in float64, returned in the Hessian's dtype.

    Scaling first makes the floor relative to each coordinate's own curvature rather than to the stiffest
    coordinate's: a regression on an uncentred predictor (years near 2000) has Hessian eigenvalues 1e12
    apart, most of it the predictor's scale; floored on :math:`H` itself, its ridge kept a scale thousands
    of times too small and the chains crawled along it."""
    scales = preconditioner(hessian.diagonal().double()).sqrt()
    scaled = scales[:, None] * hessian.double() * scales
    eigenvalues, vectors = torch.linalg.eigh((scaled + scaled.T) / 2)
    inverse_mass = scales[:, None] * ((vectors * preconditioner(eigenvalues)) @ vectors.T) * scales
    return ((inverse_mass + inverse_mass.T) / 2).to(hessian.dtype)  # symmetric exactly, not up to rounding


def preconditioned_curvatures(hessian: torch.Tensor, inverse_mass: torch.Tensor) -> torch.Tensor:
    r"""The magnitudes of the eigenvalues of the preconditioned Hessian :math:`R^\top H R`, floored as in
    :func:`preconditioner`, ``[d]``."""
    root = square_root(inverse_mass)
    magnitude = torch.linalg.eigvalsh(whiten(root, whiten(root, hessian).T)).abs()
    return magnitude.clamp_min(CURVATURE_FLOOR * float(magnitude.max()))


def dense_condition(dim: int) -> float:
    """The condition number above which the dense preconditioner is chosen for a model of ``dim``
    coordinates: ``SMALL_DENSE_CONDITION`` up to ``SMALL_DIMENSIONS``, else ``DENSE_CONDITION``."""
    return SMALL_DENSE_CONDITION if dim <= SMALL_DIMENSIONS else DENSE_CONDITION


def condition_number(curvatures: torch.Tensor) -> float:
    r""":math:`\kappa = \max |\lambda| / \min |\lambda|` over the magnitudes of the eigenvalues of a
    preconditioned Hessian :math:`R^\top H R` (:func:`preconditioned_curvatures`)."""
    return float(curvatures.max() / curvatures.min())


def square_root(inverse_mass: torch.Tensor) -> torch.Tensor:
    r"""A square root :math:`R` of the inverse mass, :math:`R R^\top = M`: :math:`\sqrt m` (``[d]``) for a
    diagonal one, the symmetric root (``[d, d]``, by eigendecomposition) for a dense one."""
    if inverse_mass.dim() == 1:
        return inverse_mass.sqrt()
    # in float64: a dense preconditioner's eigenvalues can be 1e12 apart (see dense_preconditioner), beyond
    # what a float32 decomposition resolves; eigenvalues that rounding made tiny or negative are raised to a
    # small but positive scale
    eigenvalues, vectors = torch.linalg.eigh(inverse_mass.double())
    floor = ROOT_FLOOR * float(eigenvalues.max())
    root = (vectors * eigenvalues.clamp_min(floor).sqrt()) @ vectors.T
    return ((root + root.T) / 2).to(inverse_mass.dtype)


def whiten(root: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    r""":math:`R v` for each row :math:`v` of ``vectors`` (``[..., d]``): the map from the preconditioned
    coordinates :math:`y` to :math:`x`, and (the root being symmetric) the map of gradients from :math:`x`
    to :math:`y`."""
    return root * vectors if root.dim() == 1 else vectors @ root


def marginal_scales(inverse_mass: torch.Tensor) -> torch.Tensor:
    r""":math:`\sqrt{M_{kk}}`, ``[d]``: the scale of each coordinate (the Laplace approximation's marginal
    standard deviations, when adapted)."""
    return (inverse_mass if inverse_mass.dim() == 1 else inverse_mass.diagonal()).sqrt()


def preconditioned_step(step_size: float, inverse_mass: torch.Tensor) -> torch.Tensor:
    r"""The step tensor of :func:`~pyro_fed.algorithms.langevin.langevin_step`: :math:`\gamma m` (``[d]``)
    for a diagonal inverse mass; for a dense one :math:`\gamma M` and its square root :math:`\sqrt\gamma R`
    stacked (``[2, d, d]``), so that an iteration multiplies each client's gradient by one matrix."""
    if inverse_mass.dim() == 1:
        return step_size * inverse_mass
    return torch.stack([step_size * inverse_mass, math.sqrt(step_size) * square_root(inverse_mass)])


def client_stiffness(
    client_gradients: Callable[[torch.Tensor], torch.Tensor],
    points: torch.Tensor,
    root: torch.Tensor,
    num_clients: int,
    *,
    iterations: int = 100,
    tolerance: float = 1e-3,
    start: torch.Tensor | None = None,
    products: Callable | None = None,
    everywhere: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    r"""The stiffness :math:`\lambda^i(x) = \max |\mathrm{eig}(R^\top \nabla^2 U^i(x) R)|` of every client at
    each of ``points`` (``[P, d]``), ``[P, b]``, where ``root`` is :math:`R` (:func:`square_root` of the
    inverse mass), the number of Lanczos iterations it took (each one Hessian-vector product per client
    and point), and the directions of the extreme eigenvalues found (``[P, b, d]``: a ``start`` for points
    nearby). ``products`` maps ``points`` and tangents ``[P, b, d]`` to the Hessians' products with them
    (default: :func:`hessian_products` of ``client_gradients``).

    By the Lanczos method (with full reorthogonalisation), all points and clients at once, from ``start``
    (``[P, b, d]``) or a fixed pseudo-random start (so the result is reproducible): the extreme Ritz values
    of the Krylov space built so far, whose largest magnitude rises to the stiffness; it stops when none
    moves by more than ``tolerance`` (relative) in an iteration, or the space is the whole one. The
    extreme eigenvalues of a Hessian whose spectrum is clustered (a well-conditioned posterior's) take a
    power iteration hundreds of products and Lanczos a few. Where the clients are held in several places,
    ``everywhere`` (:meth:`~pyro_fed.network.base.Network.everywhere`) makes that stop a decision of all of
    them: each client's estimate then has the same iterations however the clients are split.

    **Reference:** Golub & Van Loan, *Matrix Computations*, 4th ed., Section 10.1.
    """
    if products is None:
        products = functools.partial(hessian_products, client_gradients)
    shape = (points.shape[0], num_clients, points.shape[-1])
    dim, done = shape[-1], 0
    if start is None:
        generator = torch.Generator(device="cpu").manual_seed(0)
        start = torch.randn(shape, generator=generator, dtype=points.dtype, device="cpu").to(points.device)
    basis = [start / start.norm(dim=-1, keepdim=True).clamp_min(1e-300)]
    alphas, betas = [], []
    estimate = torch.zeros(shape[:-1], dtype=points.dtype, device=points.device)
    vector = basis[0]
    while done < min(iterations, dim):
        done += 1
        product = whiten(root, products(points, whiten(root, basis[-1])))
        alphas.append((basis[-1] * product).sum(-1))
        stacked = torch.stack(basis, -2)  # [P, b, j, d]
        for _ in range(2):  # Gram-Schmidt twice: orthogonal to rounding
            product = product - ((stacked @ product[..., None]) * stacked).sum(-2)
        norm = product.norm(dim=-1)
        tridiagonal = torch.diag_embed(torch.stack(alphas, -1))
        if betas:
            off = torch.diag_embed(torch.stack(betas, -1), offset=1)
            tridiagonal = tridiagonal + off + off.transpose(-1, -2)
        ritz, vectors = torch.linalg.eigh(tridiagonal)
        extreme = torch.where(ritz[..., -1:].abs() >= ritz[..., :1].abs(), vectors[..., -1], vectors[..., 0])
        previous, estimate = estimate, ritz.abs().amax(-1)
        vector = (extreme[..., None] * stacked).sum(-2)
        converged = (estimate - previous).abs() <= tolerance * estimate
        exhausted = norm <= 1e-10 * estimate.clamp_min(1e-300)  # an invariant subspace: exact
        stop = (converged | exhausted).all().reshape(1)
        if done > 1 and bool((stop if everywhere is None else everywhere(stop)).all()):
            break
        betas.append(norm)
        basis.append(product / norm[..., None].clamp_min(1e-300))
    return estimate, done, vector


def typical_points(
    potentials: Callable[[torch.Tensor], torch.Tensor], mode: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    r"""Points ``mode + c * offsets`` (``offsets [P, d]``, draws of the Laplace approximation around the mode)
    at the potential level of posterior draws: :math:`U - U(\hat x) \le d/2 + 3 \sqrt{d/2}` (for a Gaussian
    posterior :math:`U - U(\hat x)` of a draw has mean :math:`d/2` and standard deviation
    :math:`\sqrt{d/2}`). A draw above that level is where the posterior has next to no mass (the Laplace
    approximation of a far-from-Gaussian posterior, a neural network's, puts many there, in regions tens to
    hundreds of times stiffer), so its offset is halved, ``c = 1, 1/2, 1/4, ...``, until it is at that level
    (at most ``TYPICAL_HALVINGS`` times). ``potentials`` maps points ``[P, d]`` to :math:`U` ``[P]``."""
    d = mode.shape[-1]
    level = float(potentials(mode[None])[0]) + d / 2 + 3 * math.sqrt(d / 2)
    scale = torch.ones(offsets.shape[0], 1, dtype=mode.dtype, device=mode.device)
    for _ in range(TYPICAL_HALVINGS):
        values = potentials(mode + scale * offsets)
        above = ~(values <= level)  # a non-finite potential is above every level
        if not bool(above.any()):
            break
        scale = torch.where(above[:, None], scale / 2, scale)
    return mode + scale * offsets


def pilot_step(
    move: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    stiffness: Callable[[torch.Tensor], torch.Tensor],
    points: torch.Tensor,
    measured: torch.Tensor,
    largest: float,
    clients_per_step: int,
    generator: torch.Generator,
    *,
    max_iterations: int,
    noise: float = 0.0,
) -> tuple[float, float, float, int, float]:
    r"""The step, chosen again where a pilot run finds the posterior's draws.

    The step is set for the stiffness the posterior's draws meet on average, kept stable where they meet
    the most (:func:`step_stiffness`); draws of the Laplace approximation, even pulled in, can misjudge both:
    a neural network's chains reach regions ten times stiffer than any of them after thousands of
    iterations, and a hierarchical posterior's mode sits in its scale's tail. So ``P`` pilot particles, from
    ``points`` (``[P, d]``), run the preconditioned unadjusted Langevin recursion on the whole potential
    :math:`U` (:func:`langevin_move`; ``move(x, noise, h)`` runs ``len(noise)`` of them),

    .. math::

        x \leftarrow x - h M \nabla U(x) + \sqrt{2h}\, R Z, \qquad h = \gamma / b_\gamma,

    the move the samplers make on :math:`U` (:math:`b_\gamma` = ``clients_per_step``: the clients' average
    moves by :math:`\gamma / b`, a server's iterate by :math:`\gamma`), for a continuous time :math:`T` =
    ``PILOT_DURATION`` (the preconditioner makes the posterior's scales about 1, and a Langevin diffusion
    relaxes a unit scale in a time of about 1) and at most ``max_iterations`` iterations, in up to
    ``PILOT_CHECKS`` blocks of :math:`\lceil T / (\mathrm{checks} \cdot h) \rceil` iterations, at most
    ``max_iterations / checks``, at least ``PILOT_MIN_BLOCK``. The kernels pass the warm-up's iterations
    times their upload rounds per iteration, so that a particle uploads no more than a chain's warm-up;
    with full batches and a round every iteration the pilot explores as far as the chains' warm-up, at
    ``P / C`` times its cost for ``C`` chains (``N_i / n_i`` times more with minibatches: its gradients
    are the full data's). After each block the stiffness is measured at every particle (``stiffness``:
    points ``[P, d]`` -> :math:`\max_i \lambda^i` at each, ``[P]``, in the units of :func:`step_size`) and
    the step becomes :func:`step_size` for the :func:`step_stiffness` of every measurement so far (the
    typical points' ``measured``, ``[P]``, the particles' at each check) and the largest (at least
    ``largest``, the mode's and the typical points'), with the gradient ``noise``, so that the rest of the
    pilot moves as the chains will. ``generator`` (on the host) draws the noise: the pilot is the same for
    any number of chains.

    :returns: the step, the stiffness it is set for, the largest stiffness measured, the iterations run and
        the Langevin time they covered.
    """
    values = [measured.double().reshape(-1)]

    def rule(step: float) -> tuple[float, float]:
        typical = step_stiffness(torch.cat(values), largest)
        # a flat potential with exact gradients bounds no step
        bounded = typical > 0 or noise > 0
        return (step_size(typical, noise, clients_per_step) if bounded else step), typical

    iterations, elapsed, x = 0, 0.0, points.clone()
    step, typical = rule(float("inf"))
    for _ in range(PILOT_CHECKS):
        h = step / clients_per_step
        # at least PILOT_MIN_BLOCK iterations between checks: a check costs tens of gradients
        block = min(
            max(math.ceil(PILOT_DURATION / (PILOT_CHECKS * h)), PILOT_MIN_BLOCK),
            max(math.ceil(max_iterations / PILOT_CHECKS), PILOT_MIN_BLOCK),
            max_iterations - iterations,
        )
        if block <= 0 or elapsed >= PILOT_DURATION:
            break
        for start in range(0, block, PILOT_NOISE_CHUNK):  # the noise of many iterations per transfer
            shape = (min(PILOT_NOISE_CHUNK, block - start), *x.shape)
            kicks = torch.randn(shape, generator=generator, dtype=x.dtype, device="cpu")
            x = move(x, kicks.to(x.device), h)
        iterations, elapsed = iterations + block, elapsed + block * h
        values.append(stiffness(x).double().reshape(-1))
        largest = max(largest, float(values[-1].max()))
        step, typical = rule(step)
    return step, typical, largest, iterations, elapsed


def langevin_move(
    gradient: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    noise: torch.Tensor,
    h: torch.Tensor,
    root: torch.Tensor,
) -> torch.Tensor:
    r"""One preconditioned unadjusted Langevin step on :math:`U` from each of the points ``x`` (``[P, d]``):
    :math:`x - h M \nabla U(x) + \sqrt{2h} R Z`, ``gradient`` giving :math:`\nabla U` (``[P, d]``),
    ``noise`` :math:`Z` (``[P, d]``), ``root`` :math:`R`. A point whose step is not finite stays where it
    was (a pure tensor function: a select, not a branch). The step is the samplers'
    (:func:`~pyro_fed.algorithms.langevin.langevin_step`), with ``h`` a tensor so that a prepared move serves
    every step."""
    step = h * root.square() if root.dim() == 1 else torch.stack([h * (root @ root), h.sqrt() * root])
    moved = langevin_step(x, gradient(x), step, noise)
    return torch.where(moved.isfinite().all(-1, keepdim=True), moved, x)


def noise_profile(draws: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    r"""The variance of each client's gradient estimate per coordinate in the preconditioned coordinates,
    averaged over the points, ``[b, d]``: ``draws`` are ``R`` independent draws of every client's estimate
    (or of its error, for control variates) at each of ``P`` points, ``[R, P, b, d]``, mapped to those
    coordinates by ``root`` (:func:`whiten`: :math:`m_k V_k` for a diagonal inverse mass)."""
    return whiten(root, draws).var(0).mean(0)


def gradient_noise(profile: torch.Tensor, network, per_client: bool = True) -> float:
    r""":math:`\max_k \bar V_k`, :math:`V_k` the variance of the sum over clients of their gradient estimates
    (the clients' minibatches are independent) in the preconditioned coordinates and :math:`\bar V_k` its
    average over the points, from the clients' :func:`noise_profile` (``[b, d]``, summed by the ``network``),
    or from a server's estimate of the sum (``per_client=False``: one row, already the sum). Said, not read
    from the shape: a process holding one client has one row too."""
    return float((network.sum(profile) if per_client else profile[0]).max())


def _finite_population(
    client_sizes: torch.Tensor, batch: int | torch.Tensor, per_client: bool, network
) -> torch.Tensor:
    r""":math:`N_i^2 (1/n_i - 1/N_i)`, :math:`n_i = \min(n, N_i)`: the factor of the variance of client
    :math:`i`'s minibatch estimate (:math:`N_i/n_i` times a sum of :math:`n_i` of its :math:`N_i` terms,
    drawn without replacement) over its terms' variance; ``[b]``, or summed over all clients, wherever they
    are held (``[1]``), for an estimate of the server's."""
    sizes = client_sizes.double()
    factor = sizes.square() * (1.0 / client_batch_sizes(batch, client_sizes).double() - 1.0 / sizes)
    return factor if per_client else network.sum(factor, -1).reshape(1)


def probe_batch_sizes(client_sizes: torch.Tensor) -> torch.Tensor:
    r"""The minibatch size of each client at which its gradient noise is measured: ``PROBE_BATCH`` points,
    and at most half of its data, ``[b]``. A minibatch of all of a client's data is not random: it measures
    no noise and predicts none at any smaller size (on clients of 16 points or fewer a common probe of 16
    did so, and the warm-up chose a minibatch of one point whose noise biased the draws). With at most half,
    every client of two points or more is measured; one of a single point has no minibatch noise at all."""
    return (client_sizes // 2).clamp(min=1, max=PROBE_BATCH)


def batch_noise(
    full: torch.Tensor,
    probe: torch.Tensor,
    client_sizes: torch.Tensor,
    probe_batch: int | torch.Tensor,
    batch: int,
    network,
    per_client: bool = True,
) -> float:
    r"""The gradient noise :math:`\max_k \sum_i V_{ik}(n)` (as :func:`gradient_noise`) predicted at
    minibatch size ``batch`` from the noise profiles (:func:`noise_profile`) measured with full local batches
    (``full``: the part no minibatch removes, compression's or participation's; zeros for exact gradients)
    and at ``probe_batch`` (``probe``): the minibatch's part of client :math:`i`'s variance scales as
    :math:`N_i^2 (1/n_i - 1/N_i)` (sampling without replacement), exactly in expectation. Profiles of one
    row (a server's estimate of the sum, ``per_client=False``) scale with all clients' factors summed."""
    at_probe = _finite_population(client_sizes, probe_batch, per_client, network)
    scale = _finite_population(client_sizes, batch, per_client, network) / at_probe.clamp_min(1e-300)
    variance = full.double() + (probe.double() - full.double()).clamp_min(0) * scale[:, None]
    return gradient_noise(variance, network, per_client)


def choose_batch_size(
    full: torch.Tensor,
    probe: torch.Tensor,
    client_sizes: torch.Tensor,
    probe_batch: int | torch.Tensor,
    allowed: float,
    evaluations: int,
    network,
    per_client: bool = True,
) -> int | None:
    r"""The automatic minibatch size: the smallest :math:`n` whose noise (:func:`batch_noise`) exceeds the
    full batches' by at most ``allowed``; ``None`` (full local batches) where that :math:`n` would evaluate
    more than half the data a full batch does (``evaluations`` terms per datum of a minibatch: 2 for control
    variates, which evaluate each datum at two points). Smaller minibatches would make the noise, not the
    stability, set the step (a step proportional to :math:`n` for a cost that barely falls with it, since an
    iteration has a fixed cost); larger ones cost more for the same step."""
    largest = int(network.maximum(client_sizes, -1))  # over all clients, wherever they are held
    base = batch_noise(full, probe, client_sizes, probe_batch, largest, network, per_client)
    low, high = 1, largest
    while low < high:  # the noise falls as n grows
        middle = (low + high) // 2
        if batch_noise(full, probe, client_sizes, probe_batch, middle, network, per_client) <= base + allowed:
            high = middle
        else:
            low = middle + 1
    evaluated = int(network.sum(client_batch_sizes(low, client_sizes), -1))
    if evaluations * evaluated > int(network.sum(client_sizes, -1)) / 2:
        return None
    return low


def draws_preconditioner(draws: torch.Tensor, current: torch.Tensor) -> torch.Tensor | None:
    """Stan's windowed adaptation's measure: the covariance of the chains' draws ``[C, n, d]`` (within
    chains, pooled), shrunk toward the ``current`` inverse mass (``[d]``: then the variances alone, or
    ``[d, d]``) by ``d + 5`` pseudo-draws of it, in float64; or ``None`` when it should not replace
    ``current``: when its eigenvalues in the coordinates of ``current`` spread no more than
    ``DENSE_CONDITION`` times what chance allows the draws (Marchenko-Pastur, the draws counting half, as
    they are half an autocorrelation time of the slowest direction apart), or there are too few draws for a
    ``d``-dimensional covariance (fewer than ``4 d`` independent ones)."""
    chains, count, dim = draws.shape
    centred = (draws - draws.mean(1, keepdim=True)).reshape(-1, dim)
    current = current.double()
    weight = dim + 5  # pseudo-draws of the current preconditioner
    # the measured covariance, and its spread in the current preconditioner's coordinates (the identity if
    # it agrees)
    if current.dim() == 1:
        measured = (centred.square().sum(0) + weight * current) / (chains * count - chains + weight)
        spread = measured / current
    else:
        measured = (centred.T @ centred + weight * current) / (chains * count - chains + weight)
        root = square_root(current)
        relative = torch.linalg.solve(root, torch.linalg.solve(root, measured).T)
        spread = torch.linalg.eigvalsh((relative + relative.T) / 2)
    # a covariance of n independent draws of a Gaussian in d dimensions spreads its eigenvalues over
    # (1 -+ sqrt(d / n))^2 by chance alone (Marchenko-Pastur); the draws, half an autocorrelation time
    # of the slowest direction apart, count about half
    independent = chains * (count - 1) / 2
    if dim >= independent / 4 or not bool(spread.isfinite().all()):
        return None
    chance = ((1 + (dim / independent) ** 0.5) / (1 - (dim / independent) ** 0.5)) ** 2
    if float(spread.max() / spread.min()) <= DENSE_CONDITION * chance:
        return None
    return measured


def relaxation_time(step: float, slowest: float) -> float:
    r"""The integrated autocorrelation time :math:`\tau = (2 - h\lambda)/(h\lambda)`, in iterations, of the
    slowest direction (curvature :math:`\lambda` = ``slowest`` in the preconditioned coordinates, moved by a
    step :math:`h` = ``step`` on :math:`U`; the autoregression :math:`x' = (1 - h\lambda) x + \text{noise}`
    of a Gaussian target)."""
    product = min(step * slowest, 1.0)
    return (2.0 - product) / product


def thinning_for(step: float, slowest: float) -> int:
    r"""Iterations per draw: half the :func:`relaxation_time` :math:`\tau` of the slowest direction at the
    step :math:`h` = ``step`` on :math:`U`, at most ``MAX_THINNING``. Draws so spaced are nearly independent
    (their own autocorrelation time is about 2) and lose almost no effective draws per iteration, as a NUTS
    draw is about one independent draw: so ``num_samples`` keeps its meaning across models and steps."""
    return int(min(max(1, math.floor(relaxation_time(step, slowest) / 2)), MAX_THINNING))


def refresh_probability(iteration_data: int, full_data: int) -> float:
    r"""The probability per iteration of an event that evaluates every datum (a VR-FALD⋆ refresh, a QLSD++
    snapshot) such that such events cost on average ``REFRESH_SHARE`` of the iterations' data evaluations
    (``iteration_data`` per iteration, ``full_data`` per event). A control variate's noise measured at
    points as far from their reference as two posterior draws is what it has after any number of iterations
    past the posterior's relaxation time, so rarer events cost no accuracy there; they serve to bring the
    reference along with a chain that travels."""
    return min(1.0, REFRESH_SHARE * iteration_data / full_data)


def step_size(stiffness: float, noise: float, num_clients: int) -> float:
    r""":math:`\gamma = 2 \varepsilon b / (\max_k m_k V_k + (1 + \varepsilon) b \max_i \lambda^i)` (see the
    module's docstring): ``stiffness`` :math:`\max_i \lambda^i`, ``noise`` :math:`\max_k m_k V_k`,
    ``num_clients`` :math:`b` (the clients per step: 1 for a server's step)."""
    epsilon = VARIANCE_TARGET
    return 2 * epsilon * num_clients / (noise + (1 + epsilon) * num_clients * stiffness)


def step_stiffness(typical: torch.Tensor, largest: float) -> float:
    r"""The stiffness :math:`\bar\lambda` that the step is set for (:func:`step_size`): the root mean square
    of the stiffness over points where the posterior's draws are (``typical``, ``[P]``: draws, pilot
    particles), and at least ``STEP_TARGET / STABLE_PRODUCT`` times the ``largest`` met anywhere (the mode
    included).

    An average, not the largest: the step's bias is a posterior average of local discretisation errors (to
    first order in :math:`h`, the invariant law of the unadjusted recursion is :math:`\pi\,(1 + h\,\phi)`,
    :math:`\phi = |\nabla U|^2 / 4 - \Delta U / 2` in the preconditioned coordinates, a function of the
    local curvature), so a stiff region of little mass costs little accuracy, while a step set by its
    stiffness costs every region its speed (eight schools: its mode and its scale's right tail are ten times
    stiffer than the bulk, and the largest made the chains seven times slower). The root mean square weighs
    the stiff regions more than their mass alone, as a tail quantity needs: on eight schools (24,000
    effective draws) the plain mean left tau's mean 0.06 posterior sds low, the root mean square 0.03 (the
    largest: 0.01), at 1.8 times the mean's step. The bound keeps every point met stable with a margin: a
    Gaussian direction of curvature :math:`\lambda` is stable for :math:`h\lambda < 2`, and
    :math:`h\lambda \le` ``STABLE_PRODUCT`` there."""
    return max(float(typical.double().square().mean().sqrt()), STEP_TARGET / STABLE_PRODUCT * largest)


def step_shrink(noise: float, stiffness: float) -> float:
    r"""How many times smaller the gradient ``noise`` :math:`V` makes a server's automatic step (one "client",
    :func:`step_size`) than exact gradients would: :math:`1 + V / ((1 + \varepsilon) \lambda)`, ``stiffness``
    :math:`\lambda`; the chains need that many times the iterations for the same accuracy."""
    return 1.0 + noise / ((1.0 + VARIANCE_TARGET) * stiffness)


def batch_noise_allowance(stiffness: float, num_clients: int) -> float:
    r"""The noise :math:`V` an automatic minibatch may add: ``BATCH_NOISE_SHARE`` of the excess variance at
    the step of exact gradients, :math:`h V / 2 \le s\, \varepsilon` with :math:`h \lambda = 2\varepsilon/(1 +
    \varepsilon)`, i.e. :math:`V \le s (1 + \varepsilon) b \max_i \lambda^i` (the step then shrinks by
    :math:`1 / (1 + s)`)."""
    return BATCH_NOISE_SHARE * (1 + VARIANCE_TARGET) * num_clients * stiffness


def control_variate_error(
    minibatch_gradients: Callable, mode: torch.Tensor, points: torch.Tensor
) -> torch.Tensor:
    """``[R, P, b, d]`` draws of a control variate's error: the same minibatch at a point and at the reference
    point (the mode), at ``P`` points as far from it as two independent posterior draws are from each other
    (:math:`\\sqrt 2` times as far as the typical ``points`` ``[P, d]``, draws of the Laplace
    approximation, are from the mode)."""
    apart = mode + math.sqrt(2.0) * (points - mode)
    both = minibatch_gradients(torch.cat([apart, mode[None]]))
    return both[:, :-1] - both[:, -1:]
