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
    reference_grads: torch.Tensor  #: each client's full gradient :math:`\nabla U^i(Y)`, ``[b, d]``
    #: :math:`C = \frac1b \sum_i \nabla U^i(Y)`, ``[d]``: what the server broadcast (a client holds only its
    #: own :math:`\nabla U^i(Y)`), kept rather than re-averaged at every step
    shift: torch.Tensor


class VrFaldInfo(NamedTuple):
    communicated: bool  #: whether the server averaged the iterates
    refreshed: bool  #: whether the reference point and shift were refreshed
    dispersion: torch.Tensor  #: :math:`\frac1b \sum_i \|X^i - \bar X\|^2` after the step


def refresh(
    clients: torch.Tensor, full_gradients: Callable[[torch.Tensor], torch.Tensor], network
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A new reference point (the clients' average), the clients' full gradients there (each client keeps
    its own) and the shift (their mean)."""
    reference = network.average(clients)
    network.broadcast(reference)
    reference_grads = full_gradients(reference)
    shift = network.average(reference_grads)
    network.broadcast(shift)
    return reference, reference_grads, shift


def init(
    position: torch.Tensor, num_clients: int, full_gradients: Callable[[torch.Tensor], torch.Tensor], network
) -> VrFaldState:
    """Every client at ``position``; :math:`Y_0 = ` ``position`` and :math:`C_0` its mean full gradient."""
    clients = position.expand(num_clients, -1).clone()
    return VrFaldState(clients, *refresh(clients, full_gradients, network))


def position(state: VrFaldState) -> torch.Tensor:
    """The reported draw: the client average."""
    return state.clients.mean(0)


def control_variate(state: VrFaldState, gradients: Callable, exact_gradients: bool) -> torch.Tensor:
    r""":math:`G^i = \hat\nabla U^i(X^i; S) - \hat\nabla U^i(Y; S) + C`, both terms on one minibatch.

    With ``exact_gradients`` (full local batches) the second term is the stored :math:`\nabla U^i(Y)`, so
    one gradient evaluation instead of two.
    """
    if exact_gradients:
        return gradients(state.clients) - state.reference_grads + state.shift
    both = gradients(torch.stack([state.clients, state.reference.expand_as(state.clients)]))
    return both[0] - both[1] + state.shift


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
    exact_gradients: bool = False,
) -> tuple[VrFaldState, VrFaldInfo]:
    """One VR-FALD⋆ iteration.

    :param gradients: maps points ``[m, b, d]`` (or ``[b, d]``) to minibatch gradients of the same shape on
        this iteration's minibatches (the same minibatch for every ``m``).
    :param full_gradients: maps one point ``[d]`` to every client's full local gradient ``[b, d]``.
    :param bool exact_gradients: the minibatches are the clients' full data (then :math:`\nabla U^i(Y)`
        is not evaluated again at every step).
    """
    refreshed = rng.coin(refresh_prob)
    new_reference = refresh(state.clients, full_gradients, network) if refreshed else tuple(state)[1:]
    grads = control_variate(state, gradients, exact_gradients)
    clients, info = local_and_average(
        state.clients, grads, rng, network, step_size=step_size, comm_prob=comm_prob, noise_corr=noise_corr
    )
    return VrFaldState(clients, *new_reference), VrFaldInfo(info.communicated, refreshed, info.dispersion)
