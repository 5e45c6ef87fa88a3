"""VR-FALD⋆ as a Pyro MCMC kernel."""

from __future__ import annotations

import numpy as np
import torch

from ..algorithms import adaptation, vr_fald
from . import warmup
from .arguments import check_probability
from .fald import FaldKernel


class VrFaldKernel(FaldKernel):
    r"""VR-FALD⋆: FALD whose clients step with control variates around a shared reference point.

    With probability ``refresh_prob`` the reference point becomes the client average
    :math:`Y = \bar X` and every client computes its full local gradient there, giving the shift
    :math:`C = \frac1b \sum_i \nabla U^i(Y)`. Each client then steps with

    .. math::

        G^i = \hat\nabla U^i(X^i_k; S^i) - \hat\nabla U^i(Y; S^i) + C, \qquad
        \tilde X^i_{k+1} = X^i_k - \gamma G^i + \sqrt{2\gamma}\, Z^i_{k+1},

    (one minibatch in both terms, the pair :math:`(Y, C)` of before the refresh), followed by FALD's
    averaging with probability ``comm_prob``. The shift removes FALD's client drift under heterogeneous
    clients, and with full local batches the gradient noise vanishes. A refresh costs one full-data
    gradient (each data point evaluated once) and two uploads and two broadcasts of ``d`` floats per client
    (counted in ``uploaded_bits``); it runs between the compiled iterations, for the chains that refresh.
    ``sample_stats`` records ``refreshed`` per draw.

    **Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
    unified theory and new algorithms*, AISTATS 2023, Section 3.

    :param float refresh_prob: :math:`q_c \in (0, 1]`, the probability of refreshing :math:`(Y, C)` per
        iteration (default ``None``: refreshes take a tenth of the data evaluations,
        :math:`q_c = 0.1 \cdot 2 \sum_i n_i / N` — a control variate measured as far from its reference as
        two posterior draws loses nothing to older references; see
        :func:`~pyro_fed.algorithms.adaptation.refresh_probability`).

    The other arguments are those of :class:`~pyro_fed.FaldKernel`.
    """

    state_type = vr_fald.VrFaldState

    def __init__(self, model, clients=None, *, refresh_prob: float | None = None, **kwargs):
        super().__init__(model, clients, **kwargs)
        self.refresh_prob = None if refresh_prob is None else check_probability("refresh_prob", refresh_prob)
        self._refresh_prob = self.refresh_prob

    @property
    def current_refresh_prob(self) -> float | None:
        """:math:`q_c` of the current run: the user's, or the automatic one (``None`` before set-up)."""
        return self._refresh_prob

    def init_state(self, positions):
        self._refresh_prob = self.refresh_prob
        if self._refresh_prob is None:
            self._refresh_prob = adaptation.refresh_probability(
                self.iteration_data(), self.potential.num_data
            )
        # the clients upload their full gradients at the initial point and the server broadcasts the
        # shift; counted as the two averages of a refresh, as the first draw's bits have always shown
        self.network.record_averages(2)
        return vr_fald.init(positions, self.potential.num_clients, self._full_gradients, self.network)

    def gradient_evaluations(self, minibatches: bool) -> int:
        # a minibatch at the iterate and at the reference point; full batches keep grad U^i(Y)
        return 2 if minibatches else 1

    def adaptation_noise(self, minibatch_gradients, mode, points):
        return warmup.control_variate_error(minibatch_gradients, mode, points)

    def step(self, state, gradients, inputs, step_size):
        noise, communicate = inputs
        return vr_fald.step(
            state,
            gradients,
            noise,
            communicate,
            self.network,
            step_size=step_size,
            exact_gradients=self.full_local_batches,
        )

    def draw_coins(self, num_iterations: int) -> dict[str, np.ndarray]:
        coins = super().draw_coins(num_iterations)
        coins["refreshed"] = self.rng.coins(self._refresh_prob, num_iterations, self.plan.num_chains)
        return coins

    def upload_rate(self) -> float:
        # see vr_fald.averages; automatic refreshes are rare (a tenth of the data evaluations)
        return self.comm_prob + 2 * (self.refresh_prob or 0.0)

    def traffic(self, coins):
        averaged = vr_fald.averages(coins["communicated"], coins["refreshed"])
        return (*self.network.averages_traffic(averaged), coins["communicated"])

    def event_iterations(self, coins):
        return coins["refreshed"].any(1)

    def event(self, state, coins):
        chains = torch.as_tensor(np.flatnonzero(coins["refreshed"]), device=state.clients.device)
        pair = vr_fald.refresh(state, chains, self._full_gradients, self.network)
        return lambda after: vr_fald.replace_pair(after, chains, pair)
