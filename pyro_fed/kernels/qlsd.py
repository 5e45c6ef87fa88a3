"""The QLSD family as a Pyro MCMC kernel."""

from __future__ import annotations

import math

import torch

from .. import messages
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

    :param int quantization_levels: :math:`s` (e.g. ``2**8``); ``None`` (default): no compression;
        ``"auto"``: the warm-up chooses the levels of fewest uploaded bits per unit of Langevin time at its
        accuracy, among :math:`2, 4, \dots, 2^{16}` and none (:mod:`pyro_fed.algorithms.levels`; needs the
        automatic step).
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

    def __init__(
        self,
        model,
        clients=None,
        *,
        quantization_levels: int | str | None = None,
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
        if control_variate not in CONTROL_VARIATES:
            raise ValueError(
                f"control_variate must be one of {CONTROL_VARIATES} (QLSD, QLSD⋆, QLSD++); got "
                f"{control_variate!r}."
            )
        if control_variate != "svrg" and snapshot_every is not None:
            raise ValueError(
                f'snapshot_every is the period of control_variate="svrg"\'s snapshots; with control_variate='
                f'{control_variate!r} there are none: leave it out, or use control_variate="svrg".'
            )
        if memory_rate is not None and not 0 <= memory_rate <= 1:
            raise ValueError(f"memory_rate must be in [0, 1] or None (the default); got {memory_rate!r}.")
        if fixed_point is not None and not isinstance(fixed_point, torch.Tensor):
            raise ValueError(
                f"fixed_point must be a flat unconstrained tensor of d numbers; got {fixed_point!r}."
            )
        automatic_levels = isinstance(quantization_levels, str)
        if automatic_levels and quantization_levels != "auto":
            raise ValueError(
                f"quantization_levels must be a positive integer (e.g. 2**8), None (no compression) or "
                f"'auto' (chosen by the warm-up); got {quantization_levels!r}."
            )
        if automatic_levels and kwargs.get("step_size") is not None:
            raise ValueError(
                "quantization_levels='auto' is chosen from the warm-up's noise measurement, which a given "
                "step_size skips: give quantization_levels (e.g. 2**8), or leave step_size out."
            )
        self.quantization_levels = quantization_levels
        # the automatic levels' warm-up measures the noise uncompressed, and the run takes the chosen ones
        self.compressor = compressor(None if automatic_levels else quantization_levels)
        self.control_variate = control_variate
        self.snapshot_every = check_positive_int("snapshot_every", snapshot_every, "chosen")
        self.memory_rate = memory_rate
        self.participation = check_probability("participation", participation)
        self.fixed_point = fixed_point
        self.prior_on_server = bool(prior_on_server)
        algorithm = qlsd.Qlsd(
            compressor=self.compressor,
            participation=self.participation,
            control_variate=control_variate,
            memory_rate=memory_rate,
            snapshot_every=self.snapshot_every,
            fixed_point=fixed_point,
            prior_on_server=self.prior_on_server,
            automatic_levels=automatic_levels,
        )
        super().__init__(model, clients, algorithm=algorithm, **kwargs)

    def current_memory_rate(self) -> float:
        """:math:`\\alpha`: the user's, or :math:`1/(\\omega+1)` for ``"svrg"``, else 0 (of the run's
        compressor once set up)."""
        algorithm = self.settings if self.algorithm is None else self.algorithm
        return algorithm.rate(self.potential.dim)

    @property
    def current_quantization_levels(self) -> int | str | None:
        """:math:`s` of the current run: the user's, or the warm-up's choice (``None``: no compression;
        ``"auto"`` before set-up)."""
        if self.algorithm is None:
            return self.quantization_levels
        return getattr(self.algorithm.compressor, "levels", None)

    def warn_before_run(self) -> None:
        """Warn when the participation alone makes the automatic step more than ``PARTICIPATION_WARNING``
        times smaller than with every client (:meth:`~pyro_fed.algorithms.qlsd.Qlsd.participation_noise`):
        with few active clients whose gradients differ, the server's estimate is that noisy, and the chains
        need that many times the iterations of ``participation=1``."""
        chosen = self.adaptation
        if chosen is None or self.step_size is not None or self.participation == 1.0:
            return
        noise = self.settings.participation_noise(chosen, self._run)
        shrink = adaptation.step_shrink(noise, chosen.stiffness)
        if shrink <= PARTICIPATION_WARNING:
            return
        b, p = self.potential.network.num_clients, self.participation
        active = b * p / -math.expm1(b * math.log1p(-p))
        messages.warn(
            f"{type(self).__name__}: with participation={p:.3g} and {b} clients the server's gradient "
            f"comes from {active:.3g} clients per iteration on average, scaled by b/|A|; their gradients "
            f"differ, and the random set alone makes the automatic step {shrink:.3g} times smaller than "
            f"with every client (participation noise {noise:.3g} against a curvature of "
            f"{chosen.stiffness:.3g}, preconditioned): the chains need {shrink:.3g} times the iterations of "
            "participation=1 for the same accuracy. A larger participation, or a control variate "
            "(control_variate='fixed_point' or 'svrg'), which leaves the random set only the clients' "
            "gradients' changes from the mode, reduces it.",
        )
