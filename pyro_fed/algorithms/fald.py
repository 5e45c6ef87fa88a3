r"""FALD — Federated Averaging Langevin Dynamics.

Every client :math:`i` holds an iterate :math:`X^i` and takes local Langevin steps on its own potential;
with probability :math:`p_c` (one coin for all clients) the server averages the iterates:

.. math::

    \tilde X^i_{k+1} = X^i_k - \gamma \hat\nabla U^i(X^i_k; S^i_k) + \sqrt{2\gamma}\, Z^i_{k+1}, \qquad
    X^i_{k+1} = \begin{cases} \frac1b \sum_l \tilde X^l_{k+1} & \text{if } B_{k+1} = 1,\\
    \tilde X^i_{k+1} & \text{otherwise,}\end{cases}

with :math:`B_{k+1} \sim \mathrm{Ber}(p_c)` and :math:`Z^i` from
:func:`~pyro_fed.algorithms.langevin.client_noise`. The reported draw is the client average
:math:`\bar X_k = \frac1b \sum_i X^i_k`. At consensus this is Langevin with step :math:`\gamma/b` on
:math:`U = \sum_i U^i`.

Tensors carry a leading chain dimension ``C`` (independent chains simulated together): client iterates are
``[C, b, d]``, coins ``[C]``. The coins and the noise are inputs of :func:`step`, drawn ahead for a chunk of
iterations, so that one iteration is a fixed sequence of tensor operations (a branch on the coin is a
select) that can be compiled once and replayed.

**Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
unified theory and new algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import drift, traffic
from .base import Algorithm, Run
from .dispersion import held_moments, mean_and_dispersion
from .langevin import client_noise, langevin_step


class FaldState(NamedTuple):
    clients: torch.Tensor  #: client iterates :math:`X^i`, ``[C, b, d]``


def init(positions: torch.Tensor, num_clients: int) -> FaldState:
    """Every client of chain ``c`` starts at ``positions[c]`` (``[C, d]``)."""
    return FaldState(positions[:, None, :].expand(-1, num_clients, -1).clone())


def position(state, network) -> torch.Tensor:
    """The reported draw: the client average :math:`\\bar X`, ``[C, d]``."""
    return network.average(state.clients)


def local_and_average(
    clients: torch.Tensor,
    grads: torch.Tensor,
    noise: torch.Tensor,
    communicate: torch.Tensor,
    network,
    step_size: torch.Tensor,
) -> torch.Tensor:
    """The FALD iteration given the clients' gradient estimates: local steps, then averaging in the chains
    whose coin is set. Shared by FALD and VR-FALD⋆, which differ only in ``grads``."""
    return network.average_where(communicate, langevin_step(clients, grads, step_size, noise))


def step(
    state: FaldState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    communicate: torch.Tensor,
    network,
    *,
    step_size: torch.Tensor,
) -> FaldState:
    """One FALD iteration.

    :param gradients: maps client points ``[C, b, d]`` to this iteration's minibatch gradients.
    :param noise: the clients' noises :math:`Z^i`, broadcastable to ``[C, b, d]``.
    :param communicate: the coins :math:`B_{k+1}`, ``[C]`` boolean.
    :param network: the communication layer (averaging and broadcasting).
    :param step_size: :math:`\\gamma`, a tensor: a scalar, or :math:`\\gamma m` per coordinate (``[d]``) for
        preconditioned steps.
    """
    return FaldState(
        local_and_average(state.clients, gradients(state.clients), noise, communicate, network, step_size)
    )


def averages(communicated: np.ndarray) -> np.ndarray:
    """Number of ``d``-float averages per iteration (host side, for the bit count): one per round."""
    return communicated.astype(np.int64)


def communication_probability(comm_prob: float | None, run: Run) -> float:
    """The run's averaging probability: the user's ``comm_prob``, or the one the warm-up chose (``None``
    given), or 1 where there was no warm-up to choose it (a given step and preconditioner)."""
    if comm_prob is not None:
        return comm_prob
    chosen = run.chosen
    return 1.0 if chosen is None or chosen.comm_prob != chosen.comm_prob else chosen.comm_prob


@dataclass(kw_only=True)
class Fald(Algorithm):
    """FALD as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param float comm_prob: :math:`p_c`, the probability of an averaging round per iteration (``None``:
        automatic, chosen by the warm-up from the clients' quadratic model, see
        :func:`~pyro_fed.algorithms.drift.finish_communication`, and resolved for the run by
        :meth:`resolve`).
    :param float noise_corr: :math:`\\tau`, the correlation of the clients' noises
        (:func:`~pyro_fed.algorithms.langevin.client_noise`).
    """

    comm_prob: float | None = 1.0
    noise_corr: float = 1.0

    state_type = FaldState

    def resolve(self, run):
        return {"comm_prob": communication_probability(self.comm_prob, run)}

    def averages_every_iteration(self):
        return self.comm_prob == 1.0

    def average_step(self):
        # the step is the average's; finish_adaptation bounds it by the clients' own stability and drift
        return True

    def finish_adaptation(self, chosen, run):
        """The communication setting and the step the clients' drift allows
        (:func:`~pyro_fed.algorithms.drift.finish_communication`)."""
        return drift.finish_communication(self, chosen, run, refreshes=False)

    def finish_window(self, algorithm, chosen, run):
        return drift.finish_window(self, algorithm, chosen, run)

    def upload_rate(self, run):
        # an automatic setting is not known before the warm-up: its pilot is budgeted as for an average at
        # every iteration
        return 1.0 if self.comm_prob is None else self.comm_prob

    def init(self, positions):
        return init(positions, self.num_held)

    def coins(self, rng, first_iteration, num_iterations):
        return {"communicated": rng.coins(self.comm_prob, num_iterations, self.num_chains)}

    def inputs(self, rng, coins):
        leading = (len(coins["communicated"]), self.num_chains)
        noise = client_noise(
            rng, leading, self.num_clients, self.dim, self.noise_corr, self.dtype, self.held_clients
        )
        return noise, torch.as_tensor(coins["communicated"], device=self.device)

    def step(self, state, gradients, inputs, step_size):
        noise, communicate = inputs
        return step(state, gradients, noise, communicate, self.network, step_size=step_size)

    def meeting_iterations(self, coins):
        # the clients meet only to average
        return coins["communicated"].any(1)

    def local_step(self, state, gradients, inputs, step_size):
        noise, _ = inputs
        grads = self.gradient_estimates(state, gradients)
        return state._replace(clients=langevin_step(state.clients, grads, step_size, noise))

    def gradient_estimates(self, state, gradients: Callable) -> torch.Tensor:
        """The clients' gradient estimates of an iteration, ``[C, b, d]``: their minibatch gradients."""
        return gradients(state.clients)

    def points(self, state):
        return state.clients

    def summary(self, state):
        return {"moments": held_moments(state.clients)}

    def report(self, summaries):
        mean, dispersion = mean_and_dispersion(summaries["moments"], self.network)
        return {"position": mean, "dispersion": dispersion}

    def traffic(self, coins):
        communicated = coins["communicated"]
        return (*traffic.averages(averages(communicated), self.num_clients, self.dim), communicated)
