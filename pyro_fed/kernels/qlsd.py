"""The QLSD family as a Pyro MCMC kernel."""

from __future__ import annotations

import math
import warnings

import torch

from ..algorithms import adaptation, qlsd
from ..network.compression import compressor
from .arguments import check_positive_int, check_probability
from .base import FederatedKernel

CONTROL_VARIATES = (None, "fixed_point", "svrg")
#: how many times smaller the participation's noise alone may make the automatic step before the kernel names
#: it (the chains then need that many times the iterations of participation=1 for the same accuracy)
PARTICIPATION_WARNING = 10.0


class QlsdKernel(FederatedKernel):
    r"""QLSD: the server takes Langevin steps with the clients' compressed gradient estimates, from the
    clients that take part in each iteration.

    .. math::

        g_i = Q_s(H^i - \eta^i),\quad g = \frac{b}{|A|}\sum_{i\in A} g_i + \sum_i \eta^i,\quad
        \theta \leftarrow \theta - \gamma\, m \odot g + \sqrt{2\gamma m} \odot Z,\quad
        \eta^i \leftarrow \eta^i + \alpha g_i\ (i \in A),

    with :math:`Q_s` the QSGD quantiser with ``quantization_levels`` :math:`s` levels (:math:`\omega =
    \min(d/s^2, \sqrt d/s)`), each client active with probability ``participation`` :math:`p`, and
    :math:`H^i` the client's estimate of :math:`\nabla U^i(\theta)` (see :mod:`pyro_fed.algorithms.qlsd`).
    Each draw is the server's :math:`\theta`; :math:`m` is the preconditioner (see
    :class:`~pyro_fed.FederatedKernel`). The papers' variants are settings of one kernel:

    ============  ======================================================================================
    QLSD          exact local gradients (``batch_size=None``), no control variate
    QLSD#         ``batch_size`` set
    QLSD⋆         ``control_variate="fixed_point"``: :math:`H^i = \hat\nabla U^i(\theta) -
                  \hat\nabla U^i(\theta_\star)` around the mode :math:`\theta_\star`
    QLSD++        ``control_variate="svrg"``, ``snapshot_every=l``: SVRG snapshots every :math:`l`
                  iterations, memory rate :math:`\alpha = 1/(\omega + 1)` by default
    LSD⋆, LSD++   the same with ``quantization_levels=None`` (no compression)
    ============  ======================================================================================

    An iteration in which no client would take part (probability :math:`(1-p)^b`) draws its set again: the
    set is the independent coins' conditioned on at least one client, so that :math:`g` is always defined and
    unbiased and no step is taken without a gradient (see :mod:`pyro_fed.algorithms.qlsd`; stepping without
    one made the draws :math:`1/\sqrt{1 - (1-p)^b}` times too wide). Each active client uploads one quantised
    message (:meth:`~pyro_fed.network.compression.StochasticQuantizer.bits`; ``32 d`` uncompressed) and
    downloads :math:`\theta` (``32 d``); a snapshot sends :math:`\theta` to every client. ``sample_stats``
    records per draw ``active_clients`` (and ``snapshot`` for QLSD++) beside the cumulative ``uploaded_bits``
    and ``downloaded_bits``.

    **Reference:** Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic
    dynamics for Bayesian federated learning*, AISTATS 2022, Algorithms 1, 2 and S1.

    :param int quantization_levels: :math:`s` (e.g. ``2**8``); ``None`` (default): no compression.
    :param str control_variate: ``None`` (default), ``"fixed_point"`` or ``"svrg"``.
    :param int snapshot_every: :math:`l`, iterations between SVRG snapshots (``"svrg"`` only; default
        ``None``: snapshots take a tenth of the data evaluations, :math:`l = \lceil N / (0.1 \cdot 2 \sum_i
        n_i) \rceil`, see :func:`~pyro_fed.algorithms.adaptation.refresh_probability`; none with full local
        batches, where the SVRG estimate is the exact gradient and costs one evaluation).
    :param float memory_rate: :math:`\alpha \in [0, 1]`; default :math:`1/(\omega + 1)` for ``"svrg"``,
        0 (no memory) otherwise.
    :param float participation: :math:`p \in (0, 1]`, each client's probability of taking part.
    :param fixed_point: :math:`\theta_\star` for ``"fixed_point"``, as a flat unconstrained tensor ``[d]``
        (default: the mode of the potential, found by L-BFGS before sampling).
    :param bool prior_on_server: keep the prior (and the Jacobian of the unconstrained transforms) on the
        server: the clients' estimates are of their likelihoods alone (:math:`\varpi^i = 0`) and the server
        adds the exact :math:`\nabla U^0(\theta)` to :math:`g`. Default ``False``: the prior is split by
        ``prior_weights``, as in the other kernels.

    The other arguments are those of :class:`~pyro_fed.FederatedKernel`. The automatic step size is chosen
    for the server's step on the full potential, with the gradient noise of this estimator (minibatches,
    quantisation and participation) measured at draws of the Laplace approximation. When the random set of
    clients alone makes that step more than ``PARTICIPATION_WARNING`` times smaller than with every client
    (few clients per iteration, whose gradients differ), a warning names the participation before the run.
    """

    #: the step is the server's, on the whole potential (not a client's, on its share)
    server_step = True

    def __init__(
        self,
        model,
        clients=None,
        *,
        quantization_levels: int | None = None,
        control_variate: str | None = None,
        snapshot_every: int | None = None,
        memory_rate: float | None = None,
        participation: float = 1.0,
        fixed_point: torch.Tensor | None = None,
        prior_on_server: bool = False,
        **kwargs,
    ):
        if prior_on_server:
            if "prior_weights" in kwargs:
                raise ValueError(
                    "prior_on_server=True keeps the whole prior on the server: leave prior_weights out."
                )
            kwargs["prior_weights"] = "server"
        self.prior_on_server = bool(prior_on_server)
        super().__init__(model, clients, **kwargs)
        self.compressor = compressor(quantization_levels)
        self.quantization_levels = quantization_levels
        if control_variate not in CONTROL_VARIATES:
            raise ValueError(
                f"control_variate must be one of {CONTROL_VARIATES} (QLSD, QLSD⋆, QLSD++); got "
                f"{control_variate!r}."
            )
        self.control_variate = control_variate
        if control_variate != "svrg" and snapshot_every is not None:
            raise ValueError(
                f'snapshot_every is the period of control_variate="svrg"\'s snapshots; with control_variate='
                f'{control_variate!r} there are none: leave it out, or use control_variate="svrg".'
            )
        self.snapshot_every = check_positive_int("snapshot_every", snapshot_every, "chosen")
        if memory_rate is not None and not 0 <= memory_rate <= 1:
            raise ValueError(f"memory_rate must be in [0, 1] or None (the default); got {memory_rate!r}.")
        self.memory_rate = memory_rate
        self.participation = check_probability("participation", participation)
        if fixed_point is not None and not isinstance(fixed_point, torch.Tensor):
            raise ValueError(
                f"fixed_point must be a flat unconstrained tensor of d numbers; got {fixed_point!r}."
            )
        self.fixed_point = fixed_point

    # ---------------------------------------------------------------- set-up
    def current_memory_rate(self) -> float:
        """:math:`\\alpha`: the user's, or :math:`1/(\\omega+1)` for ``"svrg"``, else 0."""
        if self.memory_rate is not None:
            return float(self.memory_rate)
        return qlsd.memory_rate(self.control_variate, self.compressor.omega(self.potential.dim))

    def make_algorithm(self, **common) -> qlsd.Qlsd:
        pot = self.potential
        snapshot_every = self.snapshot_every
        if self.control_variate == "svrg" and snapshot_every is None and not self.full_local_batches:
            # with full local batches the SVRG estimate is the exact gradient: snapshots would be useless
            snapshot_every = math.ceil(1.0 / self._event_probability())
        return qlsd.Qlsd(
            compressor=self.compressor,
            participation=self.participation,
            control_variate=self.control_variate,
            memory_rate=self.current_memory_rate(),
            snapshot_every=snapshot_every,  # None but for "svrg" (checked at construction)
            full_gradients=self._full_gradients,
            fixed_point=self._fixed_point() if self.control_variate == "fixed_point" else None,
            prior_gradient=self._server_prior_gradient if pot.prior_on_server else None,
            exact_gradients=self.full_local_batches,
            **common,
        )

    def _server_prior_gradient(self, points: torch.Tensor) -> torch.Tensor:
        # the server's term of g, given to the algorithm as a callable (see qlsd.Qlsd.prior_gradient)
        return self.potential.server_prior(points, gradient=True)

    def _fixed_point(self) -> torch.Tensor:
        pot = self.potential
        if self.fixed_point is not None:
            if self.fixed_point.shape != (pot.dim,):
                raise ValueError(
                    f"fixed_point has shape {tuple(self.fixed_point.shape)}; the model has {pot.dim} "
                    "unconstrained coordinates: give the flat unconstrained mode (or leave it None)."
                )
            return self.fixed_point
        return self._mode(
            "QLSD⋆'s fixed point", "QLSD⋆'s drift is off by the gradient left there", "Give fixed_point"
        )

    def random_at_full_batch(self) -> bool:
        return self.compressor.random or self.participation < 1

    def gradient_evaluations(self, minibatches: bool) -> int:
        # theta and the reference point; SVRG with full local batches evaluates theta alone
        exact_svrg = self.control_variate == "svrg" and not minibatches
        return 1 if self.control_variate is None or exact_svrg else 2

    def adaptation_noise(self, minibatch_gradients, mode, points):
        memory_rate = self.current_memory_rate()
        full = None
        if self.control_variate == "svrg" or memory_rate > 0:
            full = self.potential.full_client_grads(mode)  # the clients' full gradients at the mode, once
        return qlsd.estimate_noise(
            minibatch_gradients,
            mode,
            points,
            full,
            self.network,
            self.compressor,
            control_variate=self.control_variate,
            participation=self.participation,
            memory_rate=memory_rate,
        )

    def warn_before_run(self) -> None:
        """Warn when the participation alone makes the automatic step more than ``PARTICIPATION_WARNING``
        times smaller than with every client (:meth:`participation_noise`): with few active clients whose
        gradients differ, the server's estimate is that noisy, and the chains need that many times the
        iterations of ``participation=1``."""
        chosen = self.adaptation
        if chosen is None or self.step_size is not None or self.participation == 1.0:
            return
        noise = self.participation_noise(chosen)
        shrink = adaptation.step_shrink(noise, chosen.stiffness)
        if shrink <= PARTICIPATION_WARNING:
            return
        b, p = self.potential.network.num_clients, self.participation
        active = b * p / -math.expm1(b * math.log1p(-p))
        warnings.warn(
            f"{type(self).__name__}: with participation={p:.3g} and {b} clients the server's gradient "
            f"comes from {active:.3g} clients per iteration on average, scaled by b/|A|; their gradients "
            f"differ, and the random set alone makes the automatic step {shrink:.3g} times smaller than "
            f"with every client (participation noise {noise:.3g} against a curvature of "
            f"{chosen.stiffness:.3g}, preconditioned): the chains need {shrink:.3g} times the iterations of "
            "participation=1 for the same accuracy. A larger participation, or a control variate "
            "(control_variate='fixed_point' or 'svrg'), which leaves the random set only the clients' "
            "gradients' changes from the mode, reduces it.",
            stacklevel=2,
        )

    def participation_noise(self, chosen) -> float:
        r"""The variance that the random set of clients alone adds to the server's estimate (exact local
        gradients, no compression), per preconditioned coordinate, averaged over the warm-up's typical points,
        at its largest coordinate. Given :math:`|A| = k` the set is a uniform :math:`k`-subset, so
        :math:`\mathrm{Var}(\frac bk \sum_{i \in A} v_i) = b^2 (\frac1k - \frac1b) S^2`, :math:`S^2` the
        clients' variance (divisor :math:`b - 1`) of what they upload, :math:`v_i = H^i - \eta^i`: their
        gradients, less those at the reference point where a fixed point or a memory takes them off; averaged
        over :math:`k \sim` Binomial(:math:`b, p`) given :math:`k \ge 1`. One evaluation of the clients' full
        gradients at the points, and one meeting."""
        pot = self.potential
        b, p = pot.network.num_clients, self.participation
        if b == 1:
            return 0.0
        points = chosen.typical_points
        uploads = self._full_gradients(points)  # [P, b, d]: the held clients'
        if self.control_variate == "fixed_point" or self.current_memory_rate() > 0:
            reference = self._fixed_point() if self.control_variate == "fixed_point" else chosen.mode
            uploads = uploads - self._full_gradients(reference[None].to(points))
        whitened = adaptation.whiten(adaptation.square_root(chosen.preconditioner), uploads).double()
        total, squares = pot.network.sums(whitened, whitened.square())
        spread = (squares - total.square() / b).clamp_min(0) / (b - 1)  # S^2, [P, d]
        # E[1/k - 1/b] for k ~ Binomial(b, p) given k >= 1
        k = torch.arange(1, b + 1, dtype=torch.float64)
        log_pmf = (
            math.lgamma(b + 1) - torch.lgamma(k + 1) - torch.lgamma(b - k + 1)
            + k * math.log(p) + (b - k) * math.log1p(-p)
        )  # fmt: skip
        weights = log_pmf.exp() / -math.expm1(b * math.log1p(-p))
        factor = b**2 * float((weights * (1 / k - 1 / b)).sum())
        return float((factor * spread).mean(0).max())
