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
2. each client's **Hessian diagonal** at the mode by forward-over-reverse differentiation
   (:func:`client_hessian_diagonals`), summed by the server: :math:`m_k = 1 / |\sum_i \partial^2_{kk}
   U^i(\hat x)|` (:func:`preconditioner`), the Laplace approximation's marginal variances when the
   posterior's correlations are weak;
3. the **stiffness** :math:`\lambda^i` of each client, the largest eigenvalue (in absolute value) of its
   preconditioned Hessian :math:`\sqrt m\, \nabla^2 U^i(\hat x)\, \sqrt m` by power iteration
   (:func:`client_stiffness`): a client step is stable only when :math:`\gamma \lambda^i < 2`;
4. with minibatches, the **gradient noise**: the variance :math:`V_k` of the sum of the clients' gradient
   estimates at the mode, measured on a few minibatches (:func:`gradient_noise`).

The step size (:func:`step_size`) is the largest one that keeps both discretisation errors small. On a
Gaussian target of curvature :math:`\lambda` (in the rescaled coordinates), Langevin with step :math:`h`
and gradient noise of variance :math:`V` has stationary variance :math:`\lambda^{-1}(1 + hV/2) / (1 -
h\lambda/2)`. The federated samplers move the client average with :math:`h = \gamma / b` on :math:`U`, and
client :math:`i` alone with :math:`\gamma` on :math:`U^i`; so

.. math::

    \gamma = \min\Big(\frac{\rho}{\max_i \lambda^i},\ \frac{2 b\, \nu}{\max_k m_k V_k}\Big),

with ``STEP_TARGET`` :math:`\rho = 0.2` (the stiffest direction's variance about 10% too wide, its standard
deviation 5%) and ``NOISE_TARGET`` :math:`\nu = 0.1` (at most 10% more variance from the minibatches).

**References:** the preconditioned Langevin step: Girolami & Calderhead, *Riemann manifold Langevin and
Hamiltonian Monte Carlo methods*, JRSS B 2011 (with a constant metric); the step-size stability condition:
Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics*, AISTATS 2023, Section 4.
"""

from __future__ import annotations

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


class Adaptation(NamedTuple):
    """What the warm-up chose, and why."""

    step_size: float  #: :math:`\gamma`
    preconditioner: torch.Tensor  #: :math:`m`, ``[d]``
    mode: torch.Tensor  #: :math:`\hat x`, ``[d]``, where the curvature was measured
    curvature: torch.Tensor  #: the Hessian diagonal of :math:`U` at :math:`\hat x`, ``[d]``
    stiffness: float  #: :math:`\max_i \lambda^i`
    noise: float  #: :math:`\max_k m_k V_k` (0 with full local batches)
    rounds: int  #: rounds in which every client uploaded ``d`` floats (mode search, curvature, noise)


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
    """Each client's Hessian times its own tangent: ``tangents [m, b, d]`` -> ``[m, b, d]``."""
    points = point.expand(tangents.shape).contiguous()
    return torch.func.jvp(client_gradients, (points,), (tangents,))[1]


def client_hessian_diagonals(
    client_gradients: Callable[[torch.Tensor], torch.Tensor], point: torch.Tensor, num_clients: int
) -> torch.Tensor:
    r"""Every client's Hessian diagonal :math:`\partial^2_{kk} U^i` at ``point`` (``[d]``): ``[b, d]``, exact,
    from :math:`d` Hessian-vector products (one full-data pass each, ``DIRECTIONS_PER_PASS`` at a time).

    :param client_gradients: the clients' full gradients, points ``[m, b, d]`` -> ``[m, b, d]``,
        differentiable by :func:`torch.func.jvp`.
    """
    d = point.shape[-1]
    eye = torch.eye(d, dtype=point.dtype, device=point.device)
    columns = []
    for start in range(0, d, DIRECTIONS_PER_PASS):
        basis = eye[start : start + DIRECTIONS_PER_PASS]
        products = _hvp(client_gradients, point, basis[:, None, :].expand(-1, num_clients, -1))
        columns.append((products * basis[:, None, :]).sum(-1))  # [m, b]: entry (k, k) of each client
    return torch.cat(columns).T


def preconditioner(curvature: torch.Tensor) -> torch.Tensor:
    """:math:`m_k = 1 / |H_{kk}|` from the Hessian diagonal of :math:`U` (``[d]``); curvatures below
    ``CURVATURE_FLOOR`` times the largest are raised to it, so that a flat direction gets a large but finite
    scale."""
    magnitude = curvature.abs()
    return 1.0 / magnitude.clamp_min(CURVATURE_FLOOR * float(magnitude.max().clamp_min(1e-300)))


def client_stiffness(
    client_gradients: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    scales: torch.Tensor,
    num_clients: int,
    *,
    iterations: int = 100,
    tolerance: float = 1e-3,
) -> torch.Tensor:
    r"""The stiffness :math:`\lambda^i = \max |\mathrm{eig}(S \nabla^2 U^i S)|`, where
    :math:`S = \mathrm{diag}(\text{scales})`, for every client at once, ``[b]``.

    By power iteration from a fixed pseudo-random start (so the result is reproducible); it stops when no
    client's Rayleigh quotient moves by more than ``tolerance`` (relative) in an iteration.
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (num_clients, point.shape[-1])
    vector = torch.randn(shape, generator=generator, dtype=point.dtype).to(point.device)
    vector = vector / vector.norm(dim=-1, keepdim=True)
    estimate = torch.zeros(num_clients, dtype=point.dtype, device=point.device)
    for _ in range(iterations):
        product = scales * _hvp(client_gradients, point, (scales * vector)[None])[0]
        previous, estimate = estimate, (vector * product).sum(-1).abs()
        vector = product / product.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        if bool(((estimate - previous).abs() <= tolerance * estimate).all()):
            break
    return estimate


def gradient_noise(draws: torch.Tensor, preconditioner: torch.Tensor) -> float:
    r""":math:`\max_k m_k V_k`: ``draws`` are ``R`` independent draws of every client's gradient estimate
    (or of its error, for control variates), ``[R, b, d]``; :math:`V_k` is the variance of their sum over
    clients (the clients' minibatches are independent)."""
    return float((preconditioner * draws.var(0).sum(0)).max())


def step_size(stiffness: float, noise: float, num_clients: int) -> float:
    r""":math:`\gamma = \min(\rho / \max_i \lambda^i,\ 2 b \nu / \max_k m_k V_k)` (see the module's
    docstring)."""
    gamma = STEP_TARGET / stiffness
    if noise > 0:
        gamma = min(gamma, 2 * num_clients * NOISE_TARGET / noise)
    return gamma
