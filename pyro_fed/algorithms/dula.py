r"""D-ULA — decentralized unadjusted Langevin over a graph of agents, with no server.

Agent :math:`i` of :math:`n` holds :math:`w_i` and its potential :math:`U_i` (its data's negative
log-likelihood and a :math:`1/n` share of the prior). All agents update at once:

.. math::

    w \leftarrow ((I - \beta_k L) \otimes I_d)\, w - \alpha_k\, n\, g(w) + \sqrt{2 \alpha_k}\, v,
    \qquad v_i \sim N(0, n I_d),

with :math:`g_i(w) = \hat\nabla U_i(w_i)`, :math:`L` the graph's Laplacian (:mod:`pyro_fed.graphs`) and
the decaying steps :math:`\alpha_k = a / (k_0 + k + 1)^{\delta_2}`, :math:`\beta_k = b / (k + 1)^{\delta_1}`.
Since
:math:`\mathbf 1^\top L = 0`, the agents' average takes an exact Langevin step on :math:`U = \sum_i U_i`,
:math:`\bar w \leftarrow \bar w - \alpha_k \sum_i \nabla U_i(w_i) + \sqrt{2\alpha_k}\, \bar v` with
:math:`\bar v \sim N(0, I)`, evaluated at the agents' own points; the consensus step keeps them close. The
draw is :math:`\bar w`.

Tensors carry a leading chain dimension ``C``; the noise and the iteration number are inputs of
:func:`step`, so that the decaying steps are computed inside a compiled chunk.

**Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
NeurIPS 2020 (the step sizes' condition :math:`1/2 + \delta_1 < \delta_2 < 1`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .langevin import langevin_step, scale_step


class DulaState(NamedTuple):
    clients: torch.Tensor  #: the agents' iterates :math:`w_i`, ``[C, n, d]``


def init(positions: torch.Tensor, num_agents: int) -> DulaState:
    """Every agent of chain ``c`` starts at ``positions[c]`` (``[C, d]``)."""
    return DulaState(positions[:, None, :].expand(-1, num_agents, -1).clone())


def position(state: DulaState) -> torch.Tensor:
    """The reported draw: the agents' average :math:`\\bar w`, ``[C, d]``."""
    return state.clients.mean(-2)


def step_sizes(
    iteration: torch.Tensor, step_size, consensus_size, *, step_decay, consensus_decay, step_offset
):
    """:math:`(\\alpha_k, \\beta_k)` at iteration ``k`` (a tensor: computed inside a compiled chunk)."""
    alpha = scale_step(step_size, (step_offset + iteration + 1.0) ** -step_decay)
    beta = consensus_size / (iteration + 1.0) ** consensus_decay
    return alpha, beta


def step(
    state: DulaState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    graph,
    alpha: torch.Tensor,
    beta: torch.Tensor,
) -> DulaState:
    """One D-ULA iteration.

    :param gradients: maps the agents' points ``[C, n, d]`` to their gradient estimates.
    :param noise: standard Gaussian noise ``[C, n, d]`` (scaled here to :math:`N(0, n I)`).
    :param graph: a :class:`~pyro_fed.graphs.Graph`.
    :param alpha: :math:`\\alpha_k`, a step of :func:`~pyro_fed.algorithms.langevin.langevin_step` (a
        scalar, per coordinate, or a dense preconditioned step with its root).
    :param beta: :math:`\\beta_k`.
    """
    w = state.clients
    n = w.shape[-2]
    # w_mix - alpha n g + sqrt(2 alpha n) v: the Langevin step of size alpha on n g, from the mixed point
    return DulaState(langevin_step(graph.mix(w, beta), n * gradients(w), alpha, math.sqrt(n) * noise))
