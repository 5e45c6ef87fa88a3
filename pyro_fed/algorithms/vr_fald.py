r"""VR-FALD⋆ — FALD with control variates and bias reduction.

Besides the client iterates :math:`X^i`, all clients share a reference point :math:`Y` and a shift
:math:`C = \frac1b \sum_i \nabla U^i(Y)` (full local gradients). Each iteration:

1. with probability :math:`q_c`, refresh: :math:`Y_{new} = \frac1b \sum_i X^i_k`,
   :math:`C_{new} = \frac1b \sum_i \nabla U^i(Y_{new})` (two uploads and two broadcasts of ``d`` floats);
2. every client steps with the control-variate gradient, on one minibatch :math:`S^i` in both terms
   and with the *old* pair :math:`(Y, C)`:

   .. math::

       G^i = \hat\nabla U^i(X^i_k; S^i) - \hat\nabla U^i(Y; S^i) + C, \qquad
       \tilde X^i_{k+1} = X^i_k - \gamma G^i + \sqrt{2\gamma}\, Z^i_{k+1};

3. the FALD communication step (averaging with probability :math:`p_c`); then
   :math:`(Y, C) \leftarrow (Y_{new}, C_{new})`.

Since :math:`C` is the clients' mean, :math:`\mathbb E[G^i] \approx \nabla U / b` near :math:`Y`: no
client drift. With ``b = 1`` and :math:`p_c = 1` this is SVRG Langevin dynamics.

**Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
unified theory and new algorithms*, AISTATS 2023, Section 3, eq. (17).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .fald import local_and_average
from .rng import Randomness


class VrFaldState(NamedTuple):
    clients: torch.Tensor  #: client iterates :math:`X^i`, ``[b, d]``
    reference: torch.Tensor  #: reference point :math:`Y`, ``[d]``
    shift: torch.Tensor  #: :math:`C = \frac1b \sum_i \nabla U^i(Y)`, ``[d]``


class VrFaldInfo(NamedTuple):
    communicated: bool  #: whether the server averaged the iterates
    refreshed: bool  #: whether the reference point and shift were refreshed
    dispersion: torch.Tensor  #: :math:`\frac1b \sum_i \|X^i - \bar X\|^2` after the step


def refresh(
    clients: torch.Tensor, full_gradients: Callable[[torch.Tensor], torch.Tensor], network
) -> tuple[torch.Tensor, torch.Tensor]:
    """A new reference point (the clients' average) and its shift (the clients' mean full gradient)."""
    reference = network.average(clients)
    network.broadcast(reference)
    shift = network.average(full_gradients(reference))
    network.broadcast(shift)
    return reference, shift


def init(
    position: torch.Tensor, num_clients: int, full_gradients: Callable[[torch.Tensor], torch.Tensor], network
) -> VrFaldState:
    """Every client at ``position``; :math:`Y_0 = ` ``position`` and :math:`C_0` its mean full gradient."""
    clients = position.expand(num_clients, -1).clone()
    return VrFaldState(clients, *refresh(clients, full_gradients, network))


def position(state: VrFaldState) -> torch.Tensor:
    """The reported draw: the client average."""
    return state.clients.mean(0)


def control_variate(
    clients: torch.Tensor, reference: torch.Tensor, shift: torch.Tensor, gradients: Callable
) -> torch.Tensor:
    r""":math:`G^i = \hat\nabla U^i(X^i; S) - \hat\nabla U^i(Y; S) + C`, both terms on one minibatch."""
    both = gradients(torch.stack([clients, reference.expand_as(clients)]))
    return both[0] - both[1] + shift


def step(
    state: VrFaldState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    full_gradients: Callable[[torch.Tensor], torch.Tensor],
    rng: Randomness,
    network,
    *,
    step_size: float,
    comm_prob: float,
    noise_corr: float,
    refresh_prob: float,
) -> tuple[VrFaldState, VrFaldInfo]:
    """One VR-FALD⋆ iteration.

    :param gradients: maps points ``[m, b, d]`` to minibatch gradients ``[m, b, d]`` on this
        iteration's minibatches (the same minibatch for every ``m``).
    :param full_gradients: maps one point ``[d]`` to every client's full local gradient ``[b, d]``.
    """
    refreshed = rng.coin(refresh_prob)
    new_pair = (
        refresh(state.clients, full_gradients, network) if refreshed else (state.reference, state.shift)
    )
    grads = control_variate(state.clients, state.reference, state.shift, gradients)
    clients, info = local_and_average(
        state.clients, grads, rng, network, step_size=step_size, comm_prob=comm_prob, noise_corr=noise_corr
    )
    return VrFaldState(clients, *new_pair), VrFaldInfo(info.communicated, refreshed, info.dispersion)
