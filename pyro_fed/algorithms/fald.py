r"""FALD — Federated Averaging Langevin Dynamics.

Every client :math:`i` holds an iterate :math:`X^i` and takes local Langevin steps on its own potential;
with probability :math:`p_c` (one coin for all clients) the server averages the iterates:

.. math::

    \tilde X^i_{k+1} = X^i_k - \gamma \hat\nabla U^i(X^i_k; S^i_k) + \sqrt{2\gamma}\, Z^i_{k+1}, \qquad
    X^i_{k+1} = \begin{cases} \frac1b \sum_l \tilde X^l_{k+1} & \text{if } B_{k+1} = 1,\\
    \tilde X^i_{k+1} & \text{otherwise,}\end{cases}

with :math:`B_{k+1} \sim \mathrm{Ber}(p_c)` and :math:`Z^i` from
:func:`~pyro_fed.algorithms.langevin.correlated_client_noise`. The reported draw is the client average
:math:`\bar X_k = \frac1b \sum_i X^i_k`. At consensus this is Langevin with step :math:`\gamma/b` on
:math:`U = \sum_i U^i`.

**Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
unified theory and new algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .langevin import correlated_client_noise, langevin_step
from .rng import Randomness


class FaldState(NamedTuple):
    clients: torch.Tensor  #: client iterates :math:`X^i`, ``[b, d]``


class FaldInfo(NamedTuple):
    communicated: bool  #: whether the server averaged this iteration
    dispersion: torch.Tensor  #: :math:`V_k = \frac1b \sum_i \|X^i_k - \bar X_k\|^2` after the step


def init(position: torch.Tensor, num_clients: int) -> FaldState:
    """Every client starts at ``position`` (``[d]``)."""
    return FaldState(position.expand(num_clients, -1).clone())


def position(state: FaldState) -> torch.Tensor:
    """The reported draw: the client average :math:`\\bar X`."""
    return state.clients.mean(0)


def dispersion(clients: torch.Tensor) -> torch.Tensor:
    """:math:`\\frac1b \\sum_i \\|X^i - \\bar X\\|^2`."""
    return (clients - clients.mean(0)).square().sum(-1).mean()


def local_and_average(
    clients: torch.Tensor,
    grads: torch.Tensor,
    rng: Randomness,
    network,
    *,
    step_size: float,
    comm_prob: float,
    noise_corr: float,
) -> tuple[torch.Tensor, FaldInfo]:
    """The FALD iteration given the clients' gradient estimates: local steps, then averaging with
    probability ``comm_prob``. Shared by FALD and VR-FALD⋆, which differ only in ``grads``."""
    b, d = clients.shape
    noise = correlated_client_noise(rng, b, d, noise_corr, clients.dtype)
    proposed = langevin_step(clients, grads, step_size, noise)
    communicated = rng.coin(comm_prob)
    if communicated:
        proposed = network.broadcast(network.average(proposed))
    return proposed, FaldInfo(communicated, dispersion(proposed))


def step(
    state: FaldState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    rng: Randomness,
    network,
    *,
    step_size: float,
    comm_prob: float,
    noise_corr: float,
) -> tuple[FaldState, FaldInfo]:
    """One FALD iteration.

    :param gradients: maps client points ``[b, d]`` to minibatch gradients ``[b, d]`` (fresh minibatches
        of this iteration).
    :param rng: the randomness (Gaussian noise on the device, the communication coin on the host).
    :param network: the communication layer (averaging and broadcasting, with bit accounting).
    """
    clients, info = local_and_average(
        state.clients,
        gradients(state.clients),
        rng,
        network,
        step_size=step_size,
        comm_prob=comm_prob,
        noise_corr=noise_corr,
    )
    return FaldState(clients), info
