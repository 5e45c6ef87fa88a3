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

1. the **mode** :math:`\hat x` of :math:`U = \sum_i U^i` by L-BFGS (:func:`find_mode`: every evaluation is one
   round in which each client uploads its gradient and potential);
2. each client's **Hessian** at the mode by forward-over-reverse differentiation (:func:`client_hessians`,
   :math:`d` Hessian-vector products), summed by the server into :math:`H = \nabla^2 U(\hat x)`. The
   *diagonal* preconditioner is :math:`m_k = 1 / |H_{kk}|` (:func:`preconditioner`), the Laplace
   approximation's marginal variances when the posterior's correlations are weak; the *dense* one is
   :math:`M = |H|^{-1}` (:func:`dense_preconditioner`, the absolute value taken on the eigenvalues), the
   Laplace approximation's covariance, which also undoes correlations. The dense step
   :math:`X - \gamma M \nabla U^i + \sqrt{2\gamma} R Z`, :math:`R R^\top = M`, is the plain step in the
   coordinates :math:`y = R^{-1} x`; it costs a :math:`d \times d` product per client and iteration and
   needs every client's Hessian (:math:`d^2` floats), so it is chosen when :math:`d` is at most
   ``DENSE_DIMENSIONS`` and the diagonal one leaves the Hessian ill-conditioned: the condition number
   :math:`\kappa` of :math:`\sqrt m H \sqrt m` (:func:`condition_number`) above ``DENSE_CONDITION``
   (Langevin's slowest direction relaxes :math:`\kappa` times slower than its stiffest allows);
3. the **stiffness** :math:`\lambda^i` of each client, the largest eigenvalue (in absolute value) of its
   preconditioned Hessian :math:`R^\top \nabla^2 U^i(x) R` (:math:`R = \sqrt m` for the diagonal form) by
   power iteration (:func:`client_stiffness`), the largest over the mode and a few draws
   :math:`x = \hat x + R\, N(0, I)` of the Laplace approximation, each pulled toward the mode until its
   potential is at the level of posterior draws (:func:`typical_points`): a client step is stable only when
   :math:`\gamma \lambda^i < 2` wherever the chain goes, and a posterior that is far from Gaussian (a
   neural network's) can be ten to a hundred times stiffer a standard deviation away from its mode;
4. with minibatches, the **gradient noise**: the variance :math:`V_k` of the sum of the clients' gradient
   estimates, measured on a few minibatches at a few draws of the Laplace approximation
   :math:`\hat x + \sqrt m \odot N(0, I)` and averaged over them (:func:`gradient_noise`). Typical points,
   not the mode: a minibatch's gradient varies with the per-datum residuals, which are smallest at the
   mode (on a small Bayesian network the noise at posterior draws is 10–40 times that at the mode), and
   the stationary excess variance is set by the noise where the chain spends its time. :math:`m_k V_k`
   below is the variance in the preconditioned coordinates :math:`y`.

The step size (:func:`step_size`) is the largest one that keeps both discretisation errors small. On a
Gaussian target of curvature :math:`\lambda` (in the rescaled coordinates), Langevin with step :math:`h`
and gradient noise of variance :math:`V` has stationary variance :math:`\lambda^{-1}(1 + hV/2) / (1 -
h\lambda/2)`. The federated samplers move the client average with :math:`h = \gamma / b` on :math:`U`, and
client :math:`i` alone with :math:`\gamma` on :math:`U^i`; so

.. math::

    \gamma = \min\Big(\frac{\rho}{\max_i \lambda^i},\ \frac{2 b\, \nu}{\max_k m_k V_k}\Big),

with ``STEP_TARGET`` :math:`\rho = 0.2` (the stiffest direction's variance about 10% too wide, its standard
deviation 5%) and ``NOISE_TARGET`` :math:`\nu = 0.1` (at most 10% more variance from the minibatches).

Last, a **pilot run** (:func:`pilot_step`) checks that step where the posterior's draws go: the typical
points move as ``P`` particles of the unadjusted Langevin recursion on :math:`U`, at the move the samplers
make on it, for a Langevin time of ``PILOT_DURATION`` but at most the warm-up's upload rounds, and the
stiffness is measured at them ``PILOT_CHECKS`` times, the step shrunk to :math:`\rho / \lambda` whenever
:math:`\lambda` exceeds the bound. Laplace draws, even pulled in, miss the stiffest regions of a
far-from-Gaussian posterior: on a 3-unit network the chains reach points ten times stiffer than any of them,
and a step set at them made the posterior 15-20% too wide.

**References:** the preconditioned Langevin step: Girolami & Calderhead, *Riemann manifold Langevin and
Hamiltonian Monte Carlo methods*, JRSS B 2011 (with a constant metric); the step-size stability condition:
Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics*, AISTATS 2023, Section 4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

#: :math:`\rho`: the product of the step and the stiffest preconditioned curvature
STEP_TARGET = 0.2
#: :math:`\nu`: the relative excess variance allowed from minibatch gradient noise
NOISE_TARGET = 0.1
#: curvatures below this fraction of the largest are raised to it (flat or non-convex directions)
CURVATURE_FLOOR = 1e-8
#: Hessian-vector products computed together (bounds memory: one full-data gradient per product)
DIRECTIONS_PER_PASS = 32
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
#: condition number of the diagonally preconditioned Hessian above which the dense preconditioner is chosen
#: (a dense iteration costs up to a few times a diagonal one on cheap models: it pays once the slowest
#: direction would relax this many times slower)
DENSE_CONDITION = 4.0


class Adaptation(NamedTuple):
    """What the warm-up chose, and why."""

    step_size: float  #: :math:`\gamma`
    #: the inverse mass: :math:`m`, ``[d]`` (diagonal), or :math:`M`, ``[d, d]`` (dense)
    preconditioner: torch.Tensor
    mode: torch.Tensor  #: :math:`\hat x`, ``[d]``, where the curvature was measured
    curvature: torch.Tensor  #: the Hessian diagonal of :math:`U` at :math:`\hat x`, ``[d]``
    #: :math:`\max_i \lambda^i`; for steps from the clients' average (FALD with ``comm_prob = 1``) the
    #: stiffness of :math:`U / b`, and for a server's step that of :math:`U`
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


def find_mode(
    potential: Callable[[torch.Tensor], torch.Tensor],
    gradient: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    *,
    max_evaluations: int = 200,
    tolerance: float = 1e-3,
) -> tuple[torch.Tensor, int]:
    """A mode of :math:`U` by L-BFGS with a strong-Wolfe line search, from ``start`` (``[d]``).

    Stops when a pass of 20 evaluations lowers :math:`U` by less than ``tolerance`` (in nats: a change of
    the log-density, meaningful whatever the parametrisation) or after ``max_evaluations``. The lowest point
    evaluated is returned (never one where :math:`U` is not finite), with the number of evaluations.
    """
    x = start.detach().clone().requires_grad_(True)
    best = [float(potential(start)), start.detach().clone()]
    evaluations = [1]

    def closure() -> torch.Tensor:
        value = potential(x.detach())
        x.grad = gradient(x.detach())
        evaluations[0] += 1
        if torch.isfinite(value) and bool(x.grad.isfinite().all()) and float(value) < best[0]:
            best[:] = [float(value), x.detach().clone()]
        # a non-finite value makes the line search step back
        return value if torch.isfinite(value) else value.new_tensor(float("inf"))

    optimizer = torch.optim.LBFGS(
        [x], max_iter=20, line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=1e-12
    )
    while evaluations[0] < max_evaluations:
        before = best[0]
        optimizer.step(closure)
        if not before - best[0] > tolerance or not bool(x.detach().isfinite().all()):
            break
    return best[1], evaluations[0]


def _hvp(client_gradients: Callable, point: torch.Tensor, tangents: torch.Tensor) -> torch.Tensor:
    """Each client's Hessian at ``point`` (``[d]``, or one per row, ``[m, d]``) times its own tangent:
    ``tangents [m, b, d]`` -> ``[m, b, d]``."""
    points = (point if point.dim() == 1 else point[:, None, :]).expand(tangents.shape).contiguous()
    return torch.func.jvp(client_gradients, (points,), (tangents,))[1]


def client_hessians(
    client_gradients: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    num_clients: int,
    *,
    total: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Every client's Hessian diagonal :math:`\partial^2_{kk} U^i` at ``point`` (``[d]``), ``[b, d]``, and
    with ``total`` the sum of the clients' Hessians :math:`\sum_i \nabla^2 U^i`, ``[d, d]`` (else
    ``None``): exact, from :math:`d` Hessian-vector products (one full-data pass each,
    ``DIRECTIONS_PER_PASS`` at a time).

    :param client_gradients: the clients' full gradients, points ``[m, b, d]`` -> ``[m, b, d]``,
        differentiable by :func:`torch.func.jvp`.
    """
    d = point.shape[-1]
    eye = torch.eye(d, dtype=point.dtype, device=point.device)
    diagonals, rows = [], []
    for start in range(0, d, DIRECTIONS_PER_PASS):
        basis = eye[start : start + DIRECTIONS_PER_PASS]
        products = _hvp(client_gradients, point, basis[:, None, :].expand(-1, num_clients, -1))
        diagonals.append((products * basis[:, None, :]).sum(-1))  # [m, b]: entry (k, k) of each client
        if total:
            rows.append(products.sum(1))  # [m, d]: rows k of the summed Hessian
    hessian = None
    if total:
        hessian = torch.cat(rows)
        hessian = (hessian + hessian.T) / 2  # symmetric up to rounding: exactly, for eigh
    return torch.cat(diagonals).T, hessian


def preconditioner(curvature: torch.Tensor) -> torch.Tensor:
    """The diagonal inverse mass :math:`m_k = 1 / |H_{kk}|` from the Hessian diagonal of :math:`U` (``[d]``);
    curvatures below ``CURVATURE_FLOOR`` times the largest are raised to it, so that a flat direction gets a
    large but finite scale."""
    magnitude = curvature.abs()
    return 1.0 / magnitude.clamp_min(CURVATURE_FLOOR * float(magnitude.max().clamp_min(1e-300)))


def dense_preconditioner(hessian: torch.Tensor) -> torch.Tensor:
    r"""The dense inverse mass :math:`M = Q\, \mathrm{diag}(1 / |\lambda|)\, Q^\top` from the Hessian
    :math:`H = Q\, \mathrm{diag}(\lambda)\, Q^\top` of :math:`U` (``[d, d]``), the eigenvalues floored as
    in :func:`preconditioner` (a saddle's negative curvature is taken by its magnitude)."""
    eigenvalues, vectors = torch.linalg.eigh(hessian)
    inverse_mass = (vectors * preconditioner(eigenvalues)) @ vectors.T
    return (inverse_mass + inverse_mass.T) / 2  # symmetric exactly, not up to rounding


def condition_number(hessian: torch.Tensor, inverse_mass: torch.Tensor) -> float:
    r""":math:`\kappa = \max |\lambda| / \min |\lambda|` over the eigenvalues of the preconditioned Hessian
    :math:`R^\top H R` (curvatures floored as in :func:`preconditioner`)."""
    root = square_root(inverse_mass)
    magnitude = torch.linalg.eigvalsh(whiten(root, whiten(root, hessian).T)).abs()
    return float(magnitude.max() / magnitude.clamp_min(CURVATURE_FLOOR * float(magnitude.max())).min())


def square_root(inverse_mass: torch.Tensor) -> torch.Tensor:
    r"""A square root :math:`R` of the inverse mass, :math:`R R^\top = M`: :math:`\sqrt m` (``[d]``) for a
    diagonal one, the symmetric root (``[d, d]``, by eigendecomposition) for a dense one."""
    if inverse_mass.dim() == 1:
        return inverse_mass.sqrt()
    eigenvalues, vectors = torch.linalg.eigh(inverse_mass)
    # eigenvalues that rounding made tiny or negative (a matrix of condition ~1e8 in float32) are raised to
    # the floor of preconditioner(): a small but positive scale
    floor = CURVATURE_FLOOR * float(eigenvalues.max())
    root = (vectors * eigenvalues.clamp_min(floor).sqrt()) @ vectors.T
    return (root + root.T) / 2


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
) -> tuple[torch.Tensor, int, torch.Tensor]:
    r"""The stiffness :math:`\lambda^i(x) = \max |\mathrm{eig}(R^\top \nabla^2 U^i(x) R)|` of every client at
    each of ``points`` (``[P, d]``), ``[P, b]``, where ``root`` is :math:`R` (:func:`square_root` of the
    inverse mass), the number of power iterations it took (each one Hessian-vector product per client
    and point), and the last directions (``[P, b, d]``: a ``start`` for points nearby).

    By power iteration, all points and clients at once, from ``start`` (``[P, b, d]``) or a fixed
    pseudo-random start (so the result is reproducible); it stops when no Rayleigh quotient moves by more
    than ``tolerance`` (relative) in an iteration.
    """
    shape = (points.shape[0], num_clients, points.shape[-1])
    done = 0
    if start is None:
        generator = torch.Generator(device="cpu").manual_seed(0)
        start = torch.randn(shape, generator=generator, dtype=points.dtype).to(points.device)
    vector = start / start.norm(dim=-1, keepdim=True)
    estimate = torch.zeros(shape[:-1], dtype=points.dtype, device=points.device)
    while done < iterations:
        done += 1
        product = whiten(root, _hvp(client_gradients, points, whiten(root, vector)))
        previous, estimate = estimate, (vector * product).sum(-1).abs()
        vector = product / product.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        if bool(((estimate - previous).abs() <= tolerance * estimate).all()):
            break
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
    stiffness: Callable[[torch.Tensor], float],
    points: torch.Tensor,
    step: float,
    clients_per_step: int,
    generator: torch.Generator,
    *,
    max_iterations: int,
) -> tuple[float, float, int]:
    r"""The step, shrunk where a pilot run finds the posterior stiffer than at the typical points.

    A posterior far from Gaussian (a neural network's) has regions ten times stiffer than any draw of its
    Laplace approximation, which chains reach only after thousands of iterations; a step chosen at the
    Laplace draws is biased there (on a small network, a posterior 15-20% too wide). So ``P`` pilot
    particles, from ``points`` (``[P, d]``), run the preconditioned unadjusted Langevin recursion on the
    whole potential :math:`U` (:func:`langevin_move`; ``move(x, noise, h)`` runs ``len(noise)`` of them),

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
    are the full data's). After each block the stiffness is measured at the particles (``stiffness``:
    points ``[P, d]`` -> :math:`\max_i \lambda^i`, in the units of :func:`step_size`) and the step becomes
    :math:`\min(\gamma, \rho / \lambda)`, so that the rest of the pilot moves as the chains will.
    ``generator`` (on the host) draws the noise: the pilot is the same for any number of chains.

    :returns: the step, the largest stiffness measured and the iterations run.
    """
    largest, iterations, elapsed, x = 0.0, 0, 0.0, points.clone()
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
            x = move(x, torch.randn(shape, generator=generator, dtype=x.dtype).to(x.device), h)
        iterations, elapsed = iterations + block, elapsed + block * h
        measured = stiffness(x)
        largest = max(largest, measured)
        if measured > 0:  # a flat potential bounds no step
            step = min(step, STEP_TARGET / measured)
    return step, largest, iterations


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
    was (a pure tensor function: a select, not a branch)."""
    moved = x - h * whiten(root, whiten(root, gradient(x))) + (2 * h).sqrt() * whiten(root, noise)
    return torch.where(moved.isfinite().all(-1, keepdim=True), moved, x)


def gradient_noise(draws: torch.Tensor, root: torch.Tensor) -> float:
    r""":math:`\max_k \bar V_k` in the preconditioned coordinates: ``draws`` are ``R`` independent draws of
    every client's gradient estimate (or of its error, for control variates) at each of ``P`` points,
    ``[R, P, b, d]``, mapped to those coordinates by ``root`` (:func:`whiten`: :math:`m_k V_k` for a
    diagonal inverse mass); :math:`V_k` is the variance of their sum over clients (the clients' minibatches
    are independent) and :math:`\bar V_k` its average over the points."""
    return float(whiten(root, draws).var(0).sum(-2).mean(0).max())


def step_size(stiffness: float, noise: float, num_clients: int) -> float:
    r""":math:`\gamma = \min(\rho / \max_i \lambda^i,\ 2 b \nu / \max_k m_k V_k)` (see the module's
    docstring)."""
    gamma = STEP_TARGET / stiffness
    if noise > 0:
        gamma = min(gamma, 2 * num_clients * NOISE_TARGET / noise)
    return gamma
