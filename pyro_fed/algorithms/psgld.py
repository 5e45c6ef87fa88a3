r"""pSGLD — preconditioned stochastic gradient Langevin dynamics, taken by a server over the clients.

The server holds :math:`x` and a running mean :math:`V` of the squares of its gradient estimate. Every
iteration each client uploads its minibatch gradient estimate at :math:`x` (``d`` floats) and downloads the
new :math:`x`; the server steps with the diagonal preconditioner :math:`G` that :math:`V` defines:

.. math::

    g = \sum_{i=1}^b \hat\nabla U^i(x; S^i), \qquad
    V \leftarrow \rho V + (1 - \rho)\, g \odot g, \qquad
    G = \frac{1}{\sqrt V + \epsilon}, \qquad
    x \leftarrow x - \gamma\, G \odot g + \sqrt{2 \gamma G} \odot Z,

with :math:`V` starting at 1 and :math:`Z \sim N(0, I_d)` drawn at the server. The term
:math:`\gamma \Gamma(x)`, :math:`\Gamma_k = \partial G_k / \partial x_k`, of the exact preconditioned
dynamics is dropped, as is usual (:math:`G` is taken to change slowly): the draws are then biased beyond the
step's own discretisation error where :math:`G` follows :math:`x` closely, i.e. where a direction relaxes
slowly compared with the :math:`1/(1 - \rho)` iterations that :math:`V` averages over. On a Gaussian target, a
direction that relaxes in :math:`\tau` iterations (:math:`\tau = (2 - h)/h`, :math:`h` its curvature times
:math:`\gamma G`) has a variance beyond unadjusted Langevin's at the same step by 2.5% at :math:`(1 -
\rho)\tau = 0.1`, 13% at 0.5, 21% at 1.1, 53% at 5.5, 63% at 11 and 92% at 55 (measured, exact gradients),
tending to twice the posterior's as :math:`(1 - \rho)\tau \to \infty`, where :math:`V` is the local
:math:`g \odot g` (in one dimension the law is then :math:`\propto |x - \mu|\, \pi(x)`).

With one client (the pooled data) this is pSGLD; with :math:`b` clients its gradient estimate is the sum of
theirs, each on its own minibatch (participation 1, no compression: QLSD's server loop with pSGLD's step).

Scale: :math:`g` here estimates :math:`\nabla U` (prior included, the likelihood's minibatch scaled by
:math:`N_i / n_i`); Li et al.'s Algorithm 1 forms :math:`V` from the minibatch's mean per-datum likelihood
gradient, :math:`N` times smaller, so that its :math:`G` is :math:`N` times larger: their step
:math:`\epsilon_t` (drift :math:`\frac{\epsilon_t}2 G g`, noise variance :math:`\epsilon_t G`) and damping
:math:`\lambda` are :math:`\gamma = N \epsilon_t / 2` and :math:`\epsilon = N \lambda` here (as long as the
prior's gradient is small in :math:`V`).

With :math:`\rho = 1` the second moment stays at its start and the step is preconditioned ULA with the fixed
diagonal :math:`G`. At stationarity on a Gaussian posterior of Hessian :math:`H`, :math:`E[g g^\top] = H` plus
the minibatch noise's covariance (:math:`E_\pi[\nabla U \nabla U^\top] = H E_\pi[(x - \mu)(x - \mu)^\top] H =
H`: the Fisher information), so :math:`G \approx 1 / \sqrt{\mathrm{diag}\, H}` (smaller with minibatch noise,
which adds to :math:`V`) — :func:`stationary_preconditioner`, for which the warm-up chooses the step
(:meth:`Psgld.warmup_preconditioner`).

Tensors carry a leading chain dimension ``C``; the server noise is an input of :func:`step`, drawn ahead for a
chunk of iterations.

**Reference:** Li, Chen, Carlson, Carin, *Preconditioned stochastic gradient Langevin dynamics for deep neural
networks*, AAAI 2016, Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..network.base import BITS_PER_FLOAT
from . import traffic
from .adaptation import floored_curvature
from .base import Algorithm
from .langevin import langevin_step


class PsgldState(NamedTuple):
    server: torch.Tensor  #: :math:`x`, ``[C, d]``
    second_moment: torch.Tensor  #: :math:`V`, ``[C, d]``


def init(positions: torch.Tensor) -> PsgldState:
    """The server of chain ``c`` at ``positions[c]`` (``[C, d]``) and :math:`V = 1`."""
    return PsgldState(positions.clone(), torch.ones_like(positions))


def position(state: PsgldState, network) -> torch.Tensor:
    """The reported draw: the server's :math:`x`, ``[C, d]`` (the ``network`` is taken for the signature
    every algorithm shares)."""
    return state.server


def preconditioner(second_moment: torch.Tensor, damping: float) -> torch.Tensor:
    """:math:`G = 1 / (\\sqrt V + \\epsilon)`, elementwise."""
    return 1.0 / (second_moment.sqrt() + damping)


def stationary_preconditioner(curvature: torch.Tensor, damping: float) -> torch.Tensor:
    r""":math:`G` at stationarity on a Gaussian posterior with exact gradients, ``[d]``:
    :math:`1 / (\sqrt{|H_{kk}|} + \epsilon)` from the Hessian diagonal ``curvature`` of :math:`U` (``[d]``;
    :math:`E[g_k^2] = H_{kk}`, see the module's docstring), its magnitudes floored as the warm-up's
    (:func:`~pyro_fed.algorithms.adaptation.floored_curvature`). Minibatch noise makes :math:`V` larger and
    :math:`G` smaller than this."""
    return 1.0 / (floored_curvature(curvature).sqrt() + damping)


def estimate(state: PsgldState, gradients: Callable, network) -> torch.Tensor:
    """The server's gradient estimate :math:`g = \\sum_i \\hat\\nabla U^i(x; S^i)`, ``[C, d]``: :math:`x`
    sent to the clients held here, their minibatch gradients there (``gradients`` maps ``[C, b, d]`` to the
    same shape) summed by the ``network``."""
    held = network.held(network.num_clients)
    return network.sum(gradients(network.broadcast(state.server, held.stop - held.start)))


def update(
    state: PsgldState,
    grad: torch.Tensor,
    noise: torch.Tensor,
    *,
    step_size: torch.Tensor,
    decay: float,
    damping: float,
) -> PsgldState:
    """The server's pSGLD step given its gradient estimate ``grad`` (``[C, d]``) and noise ``noise``
    (``[C, d]``): :math:`V` first, then :math:`x` with the new :math:`G`.

    :param step_size: :math:`\\gamma`, a tensor: a scalar, or one per coordinate (``[d]``).
    :param float decay: :math:`\\rho \\in [0, 1]`.
    :param float damping: :math:`\\epsilon > 0`.
    """
    if step_size.dim() == 3:
        raise ValueError(
            "pSGLD's preconditioner is its own diagonal G: a dense step (gamma M and its root) does not "
            "apply."
        )
    second_moment = decay * state.second_moment + (1.0 - decay) * grad.square()
    scaled = step_size * preconditioner(second_moment, damping)  # gamma G
    return PsgldState(langevin_step(state.server, grad, scaled, noise), second_moment)


def step(
    state: PsgldState,
    gradients: Callable,
    noise: torch.Tensor,
    network,
    *,
    step_size: torch.Tensor,
    decay: float,
    damping: float,
) -> PsgldState:
    """One pSGLD iteration: the clients' gradients at the server's :math:`x` (:func:`estimate`), then
    :func:`update`.

    :param gradients: maps client points ``[C, b, d]`` to this iteration's minibatch gradients.
    :param noise: the server's Gaussian noise, ``[C, d]``.
    :param network: the communication layer (broadcast of :math:`x`, sum of the uploads).

    The other arguments are :func:`update`'s.
    """
    grad = estimate(state, gradients, network)
    return update(state, grad, noise, step_size=step_size, decay=decay, damping=damping)


@dataclass(kw_only=True)
class Psgld(Algorithm):
    """pSGLD at a server as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param float decay: :math:`\\rho \\in [0, 1]`, the second moment's decay per iteration.
    :param float damping: :math:`\\epsilon > 0`, added to :math:`\\sqrt V`.
    """

    decay: float = 0.99
    damping: float = 1e-5

    state_type = PsgldState

    #: the step is the server's, on the whole potential
    server_step = True
    #: the run's inverse mass (the identity) is no Laplace approximation to draw the starts from: the init
    #: strategy's points, pulled to the posterior's typical level, instead
    laplace_starts = False
    #: its last word replaces the warm-up's inverse mass with the identity, which :math:`G` completes
    finishes_adaptation = True

    def adaptation_noise(self, minibatch_gradients, mode, points, run):
        # the server's estimate is the clients' sum: one "client"
        return run.network.sum(minibatch_gradients(points))[..., None, :]

    def warmup_preconditioner(self, curvature):
        """:math:`G_\\star`, the stationary :math:`G` on a Gaussian posterior with the Hessian diagonal
        ``curvature`` at the mode (:func:`stationary_preconditioner`): the automatic step is chosen for it."""
        return stationary_preconditioner(curvature, self.damping)

    def finish_adaptation(self, chosen, run):
        """The warm-up's choice with the identity as the run's inverse mass: the step was chosen for
        :math:`G_\\star`, which :math:`G` supplies as the chain runs. (A last word of its own also keeps the
        warm-up from measuring the preconditioner again from the draws, which pSGLD's :math:`G`
        replaces.)"""
        return chosen._replace(preconditioner=torch.ones_like(chosen.mode)), self, []

    def init(self, positions):
        return init(positions)

    def coins(self, rng, first_iteration, num_iterations):
        # no randomness on the host: every client uploads at every iteration (counted for the bits)
        return {"uploads": np.full((num_iterations, self.num_chains), self.network.num_clients)}

    def coin_statistics(self, coins):
        return {}

    def inputs(self, rng, coins):
        return (rng.normal(len(coins["uploads"]), self.num_chains, self.dim, dtype=self.dtype),)

    def step(self, state, gradients, inputs, step_size):
        (noise,) = inputs
        return step(
            state, gradients, noise, self.network, step_size=step_size, decay=self.decay, damping=self.damping
        )

    def points(self, state):
        return state.server.unsqueeze(-2)

    def summary(self, state):
        return {"position": position(state, self.network)}

    def traffic(self, coins):
        # each client uploads its d-float gradient and downloads the new x
        return traffic.server(coins["uploads"], BITS_PER_FLOAT * self.dim, self.num_clients, self.dim)
