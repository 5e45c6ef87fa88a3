"""VR-FALD⋆ as a Pyro MCMC kernel."""

from __future__ import annotations

from ..algorithms import vr_fald
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
        iteration (default ``None``: with ``comm_prob < 1`` and an automatic step, the least whose predicted
        drift error is within 0.05 posterior sd in the clients' quadratic model at the mode (stale
        references widen the draws on heterogeneous clients, :mod:`~pyro_fed.algorithms.drift`), at least
        the rule that follows (a sixteenth of it with ``comm_prob=None``) and, with minibatches, refreshes
        evaluating at most as much data as the iterations; otherwise refreshes take a tenth of the data
        evaluations,
        :math:`q_c = 0.1 \cdot 2 \sum_i n_i / N` — a control variate measured as far from its reference as
        two posterior draws loses nothing to older references; see
        :func:`~pyro_fed.algorithms.adaptation.refresh_probability`; and none with full local batches and
        ``comm_prob = 1``, where the clients' average of :math:`G^i` is :math:`\nabla U(X) / b` whatever
        the pair, so that the chain is FALD's).

    The other arguments are those of :class:`~pyro_fed.FaldKernel`.
    """

    def __init__(self, model, clients=None, *, refresh_prob: float | None = None, **kwargs):
        self.refresh_prob = None if refresh_prob is None else check_probability("refresh_prob", refresh_prob)
        super().__init__(model, clients, **kwargs)

    def _algorithm(self) -> vr_fald.VrFald:
        return vr_fald.VrFald(
            comm_prob=self.comm_prob, noise_corr=self.noise_corr, refresh_prob=self.refresh_prob
        )

    @property
    def current_refresh_prob(self) -> float | None:
        """:math:`q_c` of the current run: the user's, or the automatic one (the user's, ``None`` when
        automatic, before set-up)."""
        return self.refresh_prob if self.algorithm is None else self.algorithm.refresh_prob
