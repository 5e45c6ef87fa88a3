r"""The mode of the potential by L-BFGS, stopped by how stationary the point is, not by how little it moved.

A search for :math:`\hat x = \arg\min U` ends when the **Newton decrement**

.. math::

    \lambda(x) = \sqrt{\nabla U(x)^\top H^{-1} \nabla U(x)}

is at most ``MODE_TOLERANCE``, :math:`H^{-1}` the search's own estimate of the inverse Hessian. On a
Gaussian posterior :math:`\lambda` is exactly the distance from :math:`x` to the mode in posterior standard
deviations (the Mahalanobis norm of :math:`H^{-1}\nabla U`), and at a posterior draw
:math:`\mathbb E[\lambda^2] = d`: a scale that does not depend on the parametrisation nor on the size of
:math:`U`. A rule on the change of :math:`U` does: with :math:`N = 10^5` data in float32, :math:`U` is a sum
of :math:`10^5` terms whose rounding (about :math:`10^{-3}` nats) hides the last steps of a search, while the
gradient, a sum of terms that nearly cancel, still points the way.

The line search backtracks from the quasi-Newton step until the sufficient-decrease condition holds,
or, where :math:`U` is within its rounding of the start, until the slope along the step has flattened
(Hager & Zhang's approximate Wolfe condition, which reads the gradient instead of :math:`U`); a point where
:math:`U` or its gradient is not finite (a scale parameter sent to :math:`e^{-50}` by a long first step)
shortens the step instead of poisoning the search. Each evaluation is one round in which every client
uploads its gradient and potential.

**References:** Nocedal & Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4 (the two-loop recursion)
and Section 3.1; Hager & Zhang, *A new conjugate gradient method with guaranteed descent and an efficient line
search*, SIAM J. Optim. 2005 (the approximate Wolfe conditions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

#: :math:`\lambda` at which the search stops: the point is within a tenth of a posterior standard deviation
#: of the mode (on a Gaussian posterior; summed over all directions)
MODE_TOLERANCE = 0.1
#: the decrement above which the warm-up reports that it did not reach the mode: the curvature it measures
#: there (the preconditioner), the typical points around it and the chains' starts are then more than a
#: posterior standard deviation off in some direction (below that, the point serves as well as the mode: a
#: posterior draw is :math:`\sqrt d` away). QLSD⋆'s fixed point needs ``MODE_TOLERANCE`` itself: its drift is
#: off by the gradient left there
MODE_WARNING = 1.0
#: evaluations of :math:`U` and :math:`\nabla U` a search may take (reaching it is reported, never silent)
MODE_EVALUATIONS = 1000
#: pairs of steps and gradient changes that L-BFGS keeps
HISTORY = 20
#: the sufficient-decrease constant :math:`c_1` (Armijo), and :math:`\sigma` of the curvature condition
ARMIJO, CURVATURE = 1e-4, 0.9
#: step halvings a line search may take before the search restarts from the gradient, or stops
BACKTRACKS = 40


class ModeSearch(NamedTuple):
    """The end of a mode search."""

    point: torch.Tensor  #: the lowest point found, ``[d]``
    gradient: torch.Tensor  #: :math:`\nabla U` there, ``[d]``
    evaluations: int  #: evaluations of :math:`U` and :math:`\nabla U` (rounds of uploads)
    #: :math:`\lambda` there, with the search's estimate of :math:`H^{-1}` (posterior sds, on a Gaussian)
    decrement: float
    converged: bool  #: :math:`\lambda \le` the tolerance


def newton_decrement(gradient: torch.Tensor, inverse_hessian: torch.Tensor) -> float:
    r""":math:`\sqrt{g^\top H^{-1} g}` with :math:`H^{-1}` ``[d]`` (diagonal) or ``[d, d]``."""
    g = gradient.double()
    h = inverse_hessian.double()
    return float((g * (h * g if h.dim() == 1 else h @ g)).sum().clamp_min(0).sqrt())


def find_mode(
    potential: Callable[[torch.Tensor], torch.Tensor],
    gradient: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    *,
    inverse_hessian: torch.Tensor | None = None,
    tolerance: float = MODE_TOLERANCE,
    max_evaluations: int | None = None,
) -> ModeSearch:
    r"""A mode of :math:`U` by L-BFGS from ``start`` (``[d]``), until the Newton decrement is at most
    ``tolerance``, the line search can make no progress, or ``max_evaluations`` evaluations (default
    ``MODE_EVALUATIONS``).

    :param potential: :math:`U` at a point ``[d]`` (a scalar tensor).
    :param gradient: :math:`\nabla U` at a point ``[d]``.
    :param inverse_hessian: an estimate of :math:`H^{-1}` (``[d]`` or ``[d, d]``: a preconditioner) that
        starts the L-BFGS recursion in place of a multiple of the identity: the search then runs in the
        coordinates it whitens, where it converges in a few steps.
    """
    dtype = start.dtype
    max_evaluations = MODE_EVALUATIONS if max_evaluations is None else max_evaluations
    x = start.detach().double()
    value, grad = _evaluate(potential, gradient, x, dtype)
    evaluations = 1
    if not (torch.isfinite(value) and bool(grad.isfinite().all())):
        raise ValueError("find_mode: the potential or its gradient is not finite at the start.")
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (s, y, 1 / s.y)
    initial = None if inverse_hessian is None else inverse_hessian.detach().double()
    restarted = False
    while True:
        direction = -_two_loop(grad, steps, initial)
        slope = float(grad @ direction)
        decrement = max(-slope, 0.0) ** 0.5
        # without curvature pairs (or a given estimate) the decrement has no scale: take a step first
        informed = bool(steps) or initial is not None or decrement == 0
        if (informed and decrement <= tolerance) or evaluations >= max_evaluations:
            break
        if not slope < 0:  # not a descent direction (rounding): start again from the gradient
            steps, direction = [], -_two_loop(grad, [], initial)
            slope = float(grad @ direction)
        # the first step of a plain search has no scale yet: at most a unit move
        t = 1.0 if steps or initial is not None else min(1.0, 1.0 / float(grad.abs().sum()))
        accepted = None
        # rounding of U: where the change of U is below it, the slope decides (approximate Wolfe)
        resolution = 1e-6 * abs(float(value)) + 1e-12 if dtype == torch.float64 else 1e-5 * abs(float(value))
        for _ in range(BACKTRACKS):
            if evaluations >= max_evaluations:
                break
            trial = x + t * direction
            new_value, new_grad = _evaluate(potential, gradient, trial, dtype)
            evaluations += 1
            if torch.isfinite(new_value) and bool(new_grad.isfinite().all()):
                change = float(new_value - value)
                new_slope = float(new_grad @ direction)
                sufficient = change <= ARMIJO * t * slope
                flat = change <= resolution and (2 * ARMIJO - 1) * slope >= new_slope >= CURVATURE * slope
                if sufficient or flat:
                    accepted = (trial, new_value, new_grad)
                    break
                # minimiser of the quadratic through U(0), U'(0) and U(t), kept within [t/10, t/2]
                t = min(max(-slope * t * t / (2 * (change - slope * t)), 0.1 * t), 0.5 * t)
            else:
                t *= 0.1  # past a finite region: much shorter
        if accepted is None:
            if restarted or not steps:
                break  # no progress from the gradient direction either
            steps, restarted = [], True
            continue
        restarted = False
        trial, new_value, new_grad = accepted
        s, y = trial - x, new_grad - grad
        curvature = float(s @ y)
        if curvature > 1e-10 * float(s.norm() * y.norm()):  # keeps the recursion positive definite
            steps = [
                *steps[-(HISTORY - 1) :],
                (s, y, torch.tensor(1.0 / curvature, dtype=s.dtype, device=s.device)),
            ]
        x, value, grad = trial, new_value, new_grad
    converged = informed and decrement <= tolerance
    return ModeSearch(x.to(dtype), grad.to(dtype), evaluations, decrement, converged)


def _evaluate(potential, gradient, x: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:math:`U` and :math:`\\nabla U` at ``x`` (kept in float64 by the search, evaluated in the model's
    ``dtype``)."""
    point = x.to(dtype)
    value = potential(point).detach().double()
    if not torch.isfinite(value):
        return value, torch.full_like(x, float("nan"))
    return value, gradient(point).detach().double()


def _two_loop(grad: torch.Tensor, steps: list, initial: torch.Tensor | None) -> torch.Tensor:
    """:math:`H_k^{-1} g` by the L-BFGS two-loop recursion over ``steps`` ``(s, y, 1/s.y)``, from
    ``initial`` (scaled by :math:`s^\\top y / y^\\top H_0 y` of the last pair) or the identity so scaled."""
    q, alphas = grad.clone(), []
    for s, y, rho in reversed(steps):
        alpha = rho * (s @ q)
        alphas.append(alpha)
        q = q - alpha * y
    if initial is None:
        scale = 1.0 if not steps else float(steps[-1][0] @ steps[-1][1]) / float(steps[-1][1] @ steps[-1][1])
        r = scale * q
    else:
        r = initial * q if initial.dim() == 1 else initial @ q
        if steps:
            s, y, _ = steps[-1]
            hy = initial * y if initial.dim() == 1 else initial @ y
            r = (float(s @ y) / float(y @ hy)) * r
    for (s, y, rho), alpha in zip(steps, reversed(alphas), strict=True):
        beta = rho * (y @ r)
        r = r + (alpha - beta) * s
    return r
