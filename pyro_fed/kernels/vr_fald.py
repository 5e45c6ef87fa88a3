"""VR-FALD⋆ as a Pyro MCMC kernel."""

from __future__ import annotations

from ..algorithms import vr_fald
from .base import check_probability
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
    gradient and two uploads and two broadcasts of ``d`` floats per client (counted in
    ``uploaded_bits``); ``sample_stats`` records ``refreshed`` per draw.

    **Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
    unified theory and new algorithms*, AISTATS 2023, Section 3.

    :param float refresh_prob: :math:`q_c \in (0, 1]`, the probability of refreshing :math:`(Y, C)` per
        iteration (default: ``comm_prob``).

    The other arguments are those of :class:`~pyro_fed.FaldKernel`.
    """

    def __init__(self, model, clients, *, refresh_prob: float | None = None, **kwargs):
        super().__init__(model, clients, **kwargs)
        self.refresh_prob = check_probability(
            "refresh_prob", self.comm_prob if refresh_prob is None else refresh_prob
        )

    def init_state(self, position):
        return vr_fald.init(
            position, self.potential.num_clients, self.potential.full_client_grads, self.network
        )

    def step(self, state, gradients):
        return vr_fald.step(
            state,
            gradients,
            self.potential.full_client_grads,
            self.rng,
            self.network,
            step_size=self.step_size,
            comm_prob=self.comm_prob,
            noise_corr=self.noise_corr,
            refresh_prob=self.refresh_prob,
            exact_gradients=self.full_local_batches,
        )

    def position(self, state):
        return vr_fald.position(state)
