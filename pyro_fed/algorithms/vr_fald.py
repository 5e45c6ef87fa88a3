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

The refresh (a full-data gradient) is the expensive, rare event: it is not part of :func:`step`, which stays
a fixed sequence of tensor operations, but a separate :func:`refresh` that the caller runs between
iterations, for the chains whose refresh coin is set.

**Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
unified theory and new algorithms*, AISTATS 2023, Section 3, eq. (17).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import adaptation, drift, traffic
from .fald import Fald, communication_probability, local_and_average, position

__all__ = [
    "VrFald",
    "VrFaldState",
    "averages",
    "control_variate",
    "init",
    "position",
    "refresh",
    "replace_pair",
    "step",
]


class VrFaldState(NamedTuple):
    clients: torch.Tensor  #: client iterates :math:`X^i`, ``[C, b, d]``
    reference: torch.Tensor  #: reference point :math:`Y`, ``[C, d]``
    reference_grads: torch.Tensor  #: each client's full gradient :math:`\nabla U^i(Y)`, ``[C, b, d]``
    #: :math:`C = \frac1b \sum_i \nabla U^i(Y)`, ``[C, d]``: what the server broadcast (a client holds only
    #: its own :math:`\nabla U^i(Y)`), kept rather than re-averaged at every step
    shift: torch.Tensor


def refresh(
    state: VrFaldState,
    chains: torch.Tensor,
    full_gradients: Callable[[torch.Tensor], torch.Tensor],
    network,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new pair of the chains ``chains`` (a LongTensor of chain indices): the reference point (their
    clients' average), the clients' full gradients there (each client keeps its own) and the shift (their
    mean). ``full_gradients`` maps points ``[r, d]`` to ``[r, b, d]``."""
    reference = network.average(state.clients[chains])
    reference_grads = full_gradients(reference)
    return reference, reference_grads, network.average(reference_grads)


def replace_pair(state: VrFaldState, chains: torch.Tensor, pair: tuple) -> VrFaldState:
    """``state`` with the pair (reference, reference_grads, shift) of the chains ``chains`` replaced."""
    fields = [old.index_copy(0, chains, new) for old, new in zip(state[1:], pair, strict=True)]
    return VrFaldState(state.clients, *fields)


def init(
    positions: torch.Tensor, num_clients: int, full_gradients: Callable[[torch.Tensor], torch.Tensor], network
) -> VrFaldState:
    """Every client of chain ``c`` at ``positions[c]``; :math:`Y_0` there and :math:`C_0` its mean full
    gradient."""
    clients = positions[:, None, :].expand(-1, num_clients, -1).clone()
    reference_grads = full_gradients(positions)
    return VrFaldState(clients, positions.clone(), reference_grads, network.average(reference_grads))


def control_variate(state: VrFaldState, gradients: Callable, exact_gradients: bool) -> torch.Tensor:
    r""":math:`G^i = \hat\nabla U^i(X^i; S) - \hat\nabla U^i(Y; S) + C`, both terms on one minibatch.

    With ``exact_gradients`` (full local batches) the second term is the stored :math:`\nabla U^i(Y)`, so
    one gradient evaluation instead of two.
    """
    shift = state.shift[:, None, :]
    if exact_gradients:
        return gradients(state.clients) - state.reference_grads + shift
    both = gradients(torch.stack([state.clients, state.reference[:, None, :].expand_as(state.clients)]))
    return both[0] - both[1] + shift


def step(
    state: VrFaldState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    communicate: torch.Tensor,
    network,
    *,
    step_size: torch.Tensor,
    exact_gradients: bool = False,
) -> VrFaldState:
    """One VR-FALD⋆ iteration with the current pair (the refresh of step 1 is :func:`refresh`, run by the
    caller before the step with the pre-step clients and applied after it).

    :param gradients: maps points ``[m, C, b, d]`` (or ``[C, b, d]``) to minibatch gradients of the same
        shape on this iteration's minibatches (the same minibatch for every ``m``).
    :param bool exact_gradients: the minibatches are the clients' full data (then :math:`\\nabla U^i(Y)`
        is not evaluated again at every step).

    The other arguments are those of :func:`pyro_fed.algorithms.fald.step`.
    """
    grads = control_variate(state, gradients, exact_gradients)
    return state._replace(
        clients=local_and_average(state.clients, grads, noise, communicate, network, step_size)
    )


def averages(communicated: np.ndarray, refreshed: np.ndarray) -> np.ndarray:
    """Number of ``d``-float averages per iteration (host side, for the bit count): one per round of the
    iterates, two per refresh (the reference point and the shift)."""
    return communicated.astype(np.int64) + 2 * refreshed.astype(np.int64)


@dataclass(kw_only=True)
class VrFald(Fald):
    """VR-FALD⋆ as an :class:`~pyro_fed.algorithms.base.Algorithm`: FALD's settings, and

    :param float refresh_prob: :math:`p_r`, the probability of a refresh of the pair per iteration
        (``None``: automatic, resolved for the run by :meth:`resolve`).
    :param full_gradients: maps points ``[r, d]`` to every client's full local gradient there,
        ``[r, b, d]`` (the run's).
    :param bool exact_gradients: the minibatches are the clients' full data (the run's).
    """

    refresh_prob: float | None = None
    full_gradients: Callable[[torch.Tensor], torch.Tensor] | None = None
    exact_gradients: bool = False

    state_type = VrFaldState

    def resolve(self, run):
        comm_prob = communication_probability(self.comm_prob, run)
        refresh_prob = self.refresh_prob
        chosen = run.chosen
        if refresh_prob is None and chosen is not None and chosen.refresh_prob == chosen.refresh_prob:
            refresh_prob = chosen.refresh_prob  # the clients' quadratic model chose it
        if refresh_prob is None:
            # with exact gradients and an average every iteration the shifts cancel in the average (the
            # clients' mean of G^i is grad U / b for any pair): this is FALD, and refreshes would only cost
            exact_average = run.exact_gradients and comm_prob == 1.0
            refresh_prob = 0.0 if exact_average else run.event_probability
        return {
            "comm_prob": comm_prob,
            "refresh_prob": refresh_prob,
            "full_gradients": run.full_gradients,
            "exact_gradients": run.exact_gradients,
        }

    def finish_adaptation(self, chosen, run):
        """The communication setting (the refresh probability with it) and the step the clients' drift
        allows (:func:`~pyro_fed.algorithms.drift.finish_communication`)."""
        return drift.finish_communication(self, chosen, run, refreshes=True)

    def gradient_evaluations(self, minibatches):
        # a minibatch at the iterate and at the reference point; full batches keep grad U^i(Y)
        return 2 if minibatches else 1

    def adaptation_noise(self, minibatch_gradients, mode, points, run):
        return adaptation.control_variate_error(minibatch_gradients, mode, points)

    def upload_rate(self, run):
        # see averages; automatic refreshes are rare (a tenth of the data evaluations)
        return super().upload_rate(run) + 2 * (self.refresh_prob or 0.0)

    def init(self, positions):
        # the clients upload their full gradients at the initial point and the server broadcasts the
        # shift: the two averages of a refresh
        self.network.record_averages(2)
        return init(positions, self.num_held, self.full_gradients, self.network)

    def coins(self, rng, first_iteration, num_iterations):
        coins = super().coins(rng, first_iteration, num_iterations)
        coins["refreshed"] = rng.coins(self.refresh_prob, num_iterations, self.num_chains)
        return coins

    def step(self, state, gradients, inputs, step_size):
        noise, communicate = inputs
        return step(
            state,
            gradients,
            noise,
            communicate,
            self.network,
            step_size=step_size,
            exact_gradients=self.exact_gradients,
        )

    def gradient_estimates(self, state, gradients):
        return control_variate(state, gradients, self.exact_gradients)

    def traffic(self, coins):
        averaged = averages(coins["communicated"], coins["refreshed"])
        return (*traffic.averages(averaged, self.num_clients, self.dim), coins["communicated"])

    def event_iterations(self, coins):
        return coins["refreshed"].any(1)

    def event(self, state, coins):
        chains = torch.as_tensor(np.flatnonzero(coins["refreshed"]), device=state.clients.device)
        pair = refresh(state, chains, self.full_gradients, self.network)
        return lambda after: replace_pair(after, chains, pair)
