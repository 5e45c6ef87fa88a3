r"""Client drift: what rare averaging rounds do to the draws of FALD and VR-FALD⋆, in a quadratic model of the
clients at the mode, and the communication setting that keeps it small.

Near the mode :math:`\hat x` client :math:`i`'s gradient is :math:`\nabla U^i(\hat x + y) \approx g_i + H_i
y`. In the coordinates the preconditioner whitens (:math:`R R^\top = M`, the step is the plain
:math:`\gamma` there) write :math:`A_i = R H_i R`, :math:`\bar A = \frac1b \sum_i A_i`, :math:`\Delta_i = A_i
- \bar A`, and split the client iterates into their average and their disagreements, :math:`X^i = \bar X +
e_i`. The average moves as

.. math::

    \bar X' = \bar X - \gamma \big(\bar A (\bar X - \hat x) + \tfrac1b \textstyle\sum_i \Delta_i e_i\big)
    + \sqrt{2\gamma / b}\, \xi,

Langevin with step :math:`\gamma / b` on :math:`U` but for the disagreements, which the averaging rounds
(probability :math:`p_c` per iteration) reset to zero. Between rounds each client's gradient error pushes
its disagreement: FALD's by :math:`\Delta_i (\bar X - \hat x) + g_i - \bar g` (its own posterior pulls it),
VR-FALD⋆'s by :math:`\Delta_i (\bar X - Y)` only (the control variates cancel the rest at the reference
point :math:`Y`, refreshed to :math:`\bar X` with probability :math:`q_c`). Averaged over the iterations
since the last round (geometric), :math:`E[e_i] = -\gamma \Phi_i (\Delta_i \delta + \dots)`, with
:math:`\Phi_i = (1 - p_c) E_i^{-1}`, :math:`E_i = I - (1 - p_c)(I - \gamma A_i)`, so that the average feels

- FALD: a shift of its mean, the *drift bias* (:func:`drift_bias`, the exact stationary mean of the
  quadratic model);
- both: a push *away* from the reference, :math:`+\gamma G (\bar X - Y)` with :math:`G = \frac\gamma b
  \sum_i \Delta_i \Phi_i \Delta_i \succeq 0` (FALD: :math:`Y = \hat x`): heterogeneous client curvatures
  weaken the curvature the average feels, and widen the draws. To first order in :math:`G` the average's
  stationary covariance :math:`P_0 + P_1` has :math:`P_0 = \frac{2\gamma}{b} (I - D^2)^{-1}`, :math:`D = I -
  \gamma \bar A`, and :math:`P_1` solves :math:`P_1 = D P_1 D + \gamma (W G + G W)`, :math:`W = D P_0 (I -
  B)`, :math:`B = \mathrm{Cov}(Y, \bar X) P_0^{-1} = q_c D (I - (1 - q_c) D)^{-1}` for VR-FALD⋆ (the reference
  is the average of a geometric number of iterations ago) and :math:`B = 0` for FALD (:func:`drift_spread`);
- the clients' private noise (noise correlation :math:`\tau < 1`), which the disagreements carry into the
  average through :math:`\Delta_i`: the noise rate :math:`\frac{1}{b^2} \sum_i (\gamma^2 \Delta_i \Phi_i Q
  \Phi_i \Delta_i - \gamma (\Delta_i \Phi_i Q + Q \Phi_i \Delta_i))`, :math:`Q = 2\gamma(1 - \tau) I`,
  added to :math:`P_1`'s equation.

The drift error of a coordinate (:meth:`ClientQuadratics.error`) is the Wasserstein-2 distance between the
Gaussian marginals of the draws and of the chain without drift, in the latter's standard deviations:
:math:`\sqrt{\delta^2 + (r - 1)^2}`, :math:`\delta` the mean's offset in sds and :math:`r = (1 -
\epsilon)^{-1/2}` the sd's ratio, :math:`\epsilon = (P_1)_{jj} / (P_0)_{jj}` the first order's excess of the
variance, resummed (exact for a reference that never moves, whose average feels the curvature :math:`\bar
A - G`; no stationary law where :math:`\epsilon \ge 1`). On Gaussian clients, which are their own quadratic
model, the mean is exact; where the sd is at most 6% too wide, the predicted ratio was within a third of the
excess below the exact law's and 2.5 times it above (``tests/algorithms/test_drift.py``): it errs toward
more rounds. Stale references make VR-FALD⋆ widen the draws without moving their mean: on posteriordb's
kidiq regression split by the response into 10 clients, averaging every tenth iteration and refreshing every
hundredth, the noise scale's sd came out 1.6 times the reference's (predicted: 1.3, a drift error of 0.29
sd); with the refresh probability chosen by the model (0.27), 1.02.

**Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a unified
theory and new algorithms*, AISTATS 2023, Sections 2-4 (the drift of FALD, the control variates of
VR-FALD⋆).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import messages
from ..data.minibatch import client_batch_sizes
from . import adaptation

if TYPE_CHECKING:
    from .adaptation import Adaptation
    from .base import Algorithm, Run

#: the drift error (posterior sds, see :meth:`ClientQuadratics.error`) an automatic communication setting
#: keeps to (:func:`choose_communication`): half the kernels' warning threshold, where the first-order
#: spread is accurate
COMMUNICATION_TARGET = 0.05
#: the averaging probabilities an automatic setting chooses from: halvings from 1 (every iteration)
COMM_PROBS = tuple(2.0**-k for k in range(11))


class DriftError(NamedTuple):
    """The drift error of each coordinate (:meth:`ClientQuadratics.error`)."""

    worst: float  #: the largest over the coordinates (``inf`` where the model has no stationary law)
    mean_offsets: torch.Tensor  #: the mean's offset in sds, ``[d]``
    sd_ratios: torch.Tensor  #: the sd's ratio to the chain's without drift, ``[d]``


def whitened(hessians: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """:math:`R H_i R` of each client's Hessian (``[b, d, d]``), ``root`` :math:`R` symmetric (``[d]`` for a
    diagonal preconditioner, ``[d, d]``)."""
    hessians = hessians.double()
    if root.dim() == 1:
        r = root.double()
        return r[:, None] * hessians * r
    r = root.double()
    return r @ hessians @ r


def drift_bias(
    step: torch.Tensor, comm_prob: float, hessians: torch.Tensor, gradients: torch.Tensor, network
) -> torch.Tensor:
    r"""The stationary bias of the reported draw's mean from client drift, ``[d]``, in a quadratic model of
    the clients at the mode: client :math:`i`'s gradient :math:`H_i y + g_i` (``hessians`` ``[b, d, d]`` and
    ``gradients`` ``[b, d]`` of the held clients, the sums over clients by the ``network``; :math:`y` the
    offset from the mode) and the preconditioned step ``step`` :math:`\gamma M` (``[d, d]``). With
    :math:`A_i = I - \gamma M H_i` the client means follow :math:`m_i = (1 - p_c)(A_i m_i - \gamma M g_i) +
    p_c\, c`, :math:`c = \frac1b \sum_j (A_j m_j - \gamma M g_j)` (the expectation over the coins is
    linear), and every draw's mean is :math:`c`, the solution of

    .. math::

        \Big(I - \frac{p_c}{b} \sum_i A_i E_i^{-1}\Big) c = -\frac1b \sum_i E_i^{-1} \gamma M g_i,
        \qquad E_i = I - (1 - p_c) A_i:

    0 at :math:`p_c = 1` (the mode's :math:`\sum_i g_i = 0`), the average of the clients' own modes'
    offsets :math:`-\frac1b \sum_i H_i^{-1} g_i` as :math:`p_c \to 0`. In float64."""
    b, d = network.num_clients, gradients.shape[-1]
    identity = torch.eye(d, dtype=torch.float64, device=gradients.device)
    moves = identity - step.double() @ hessians.double()  # A_i
    inverses = torch.linalg.inv(identity - (1 - comm_prob) * moves)  # E_i^-1
    kept = network.sum((moves @ inverses).reshape(-1, d * d)).reshape(d, d)
    pushed = network.sum((inverses @ (step.double() @ gradients.double()[..., None]))[..., 0])
    return torch.linalg.solve(identity - comm_prob / b * kept, -pushed / b)


class ClientQuadratics(NamedTuple):
    r"""The quadratic model of the held clients at the mode: their Hessians :math:`H_i` and gradients
    :math:`g_i` there, and the preconditioner's root :math:`R` (symmetric; :math:`R R = M`) that whitens
    them, :math:`A_i = R H_i R`. Sums over clients are the ``network``'s."""

    hessians: torch.Tensor  #: :math:`H_i`, ``[b_h, d, d]``
    gradients: torch.Tensor  #: :math:`g_i`, ``[b_h, d]``
    root: torch.Tensor  #: :math:`R`, ``[d]`` (diagonal) or ``[d, d]``
    whitened: torch.Tensor  #: :math:`A_i`, ``[b_h, d, d]``, float64
    network: object

    @classmethod
    def at_mode(cls, hessians: torch.Tensor, gradients: torch.Tensor, root: torch.Tensor, network):
        """The model of clients whose Hessians and gradients at the mode are ``hessians`` and
        ``gradients``, for the preconditioner whose root is ``root``."""
        return cls(hessians, gradients, root, whitened(hessians, root), network)

    def error(
        self,
        step: float,
        comm_prob: float,
        *,
        refresh_prob: float | None = None,
        noise_corr: float = 1.0,
        drift: bool = True,
    ) -> DriftError:
        r"""The drift error of every coordinate: :math:`\sqrt{\delta_j^2 + (r_j - 1)^2}` with
        :math:`\delta_j` FALD's :func:`drift_bias` (``drift``; VR-FALD⋆'s mean has none) and :math:`r_j` the
        sd ratio of :func:`drift_spread` (VR-FALD⋆ with ``refresh_prob`` :math:`q_c`, FALD with ``None``),
        both in the sds of the chain without drift, in the original coordinates."""
        d = self.whitened.shape[-1]
        laws = drift_spread(
            step, comm_prob, self.whitened, self.network, refresh_prob=refresh_prob, noise_corr=noise_corr
        )
        if laws is None:
            infinite = torch.full((d,), math.inf, dtype=torch.float64)
            return DriftError(math.inf, infinite, infinite)
        r = self.root.double()
        matrix = torch.diag(r) if r.dim() == 1 else r
        spread, first_order = (matrix @ law @ matrix for law in laws)
        variances = spread.diagonal()
        # the first order's excess resummed, 1 / (1 - excess): exact for a reference that never moves (the
        # average then feels the curvature A - G), and no stationary law where the excess reaches 1
        excess = first_order.diagonal() / variances
        ratios = torch.where(excess < 1, (1 - excess).clamp_min(1e-300).rsqrt(), math.inf)
        offsets = torch.zeros_like(ratios)
        if drift and comm_prob < 1:
            # the step of the original coordinates is gamma M = gamma R R
            bias = drift_bias(step * matrix @ matrix, comm_prob, self.hessians, self.gradients, self.network)
            offsets = bias.to(variances.device) / variances.sqrt()
        errors = (offsets.square() + (ratios - 1).square()).sqrt()
        return DriftError(float(errors.max()), offsets.cpu(), ratios.cpu())


def drift_spread(
    step: float,
    comm_prob: float,
    whitened_hessians: torch.Tensor,
    network,
    *,
    refresh_prob: float | None = None,
    noise_corr: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    r"""The stationary covariance of the reported draw in the whitened coordinates without drift, :math:`P_0`,
    and the drift's first-order part :math:`P_1` (both ``[d, d]``, see the module's documentation): for
    VR-FALD⋆ with ``refresh_prob`` :math:`q_c`, for FALD with ``refresh_prob=None`` (its reference is the
    mode). ``whitened_hessians`` are the held clients' :math:`A_i` (:func:`whitened`), summed over all
    clients by the ``network``. ``None`` where the quadratic model has no stationary law: a client whose
    curvature is negative enough to run off between rounds (:math:`E_i` not positive), or an average whose
    step is unstable (:math:`\gamma \bar A` outside :math:`(0, 2)`)."""
    b, d = network.num_clients, whitened_hessians.shape[-1]
    flat = d * d
    identity = torch.eye(d, dtype=torch.float64, device=whitened_hessians.device)
    mean_hessian = network.sum(whitened_hessians.reshape(-1, flat)).reshape(d, d) / b
    deviations = whitened_hessians - mean_hessian
    kept = (1 - comm_prob) * (identity - step * whitened_hessians)
    renewal = identity - kept  # E_i
    # a client runs off between rounds where its own steps are unstable in mean square ((1 - p) (1 - gamma
    # a)^2 >= 1 for a curvature a of A_i) or E_i is not positive; every holder decides alike
    local = 1 - step * torch.linalg.eigvalsh((whitened_hessians + whitened_hessians.mT) / 2)
    runs_off = bool(
        ((1 - comm_prob) * local.square() >= 1).any() or (torch.linalg.eigvalsh(renewal) <= 0).any()
    )
    if network.agree(runs_off):
        return None
    carried = (1 - comm_prob) * torch.linalg.inv(renewal)  # Phi_i
    carried = (carried + carried.mT) / 2
    weakening = step / b * network.sum((deviations @ carried @ deviations).reshape(-1, flat)).reshape(d, d)
    curvatures, basis = torch.linalg.eigh((mean_hessian + mean_hessian.T) / 2)
    moves = 1 - step * curvatures  # the eigenvalues of D
    if not bool((moves.abs() < 1).all()):
        return None
    spread = 2 * step / b / (1 - moves.square())  # P_0, in the eigenbasis of the mean curvature
    reference = (
        torch.zeros_like(moves)
        if refresh_prob is None
        else moves * refresh_prob / (1 - (1 - refresh_prob) * moves)
    )
    lagged = moves * spread * (1 - reference)  # W
    pushed = basis.T @ weakening @ basis
    source = step * (lagged[:, None] * pushed + pushed * lagged[None, :])
    if noise_corr < 1:
        private = 2 * step * (1 - noise_corr)  # Q = private * I
        crossed = deviations @ carried
        rate = private * (step**2 * crossed @ crossed.mT - step * (crossed + crossed.mT))
        rate = network.sum(rate.reshape(-1, flat)).reshape(d, d) / b**2
        source = source + basis.T @ ((rate + rate.T) / 2) @ basis
    first_order = source / (1 - moves[:, None] * moves[None, :])
    return basis @ torch.diag(spread) @ basis.T, basis @ first_order @ basis.T


class Communication(NamedTuple):
    """A communication setting of FALD or VR-FALD⋆ and what it costs and predicts
    (:func:`choose_communication`)."""

    comm_prob: float  #: :math:`p_c`
    refresh_prob: float | None  #: :math:`q_c` (``None`` for FALD)
    error: float  #: the predicted drift error (:meth:`ClientQuadratics.error`), posterior sds
    #: the expected rounds of uploads of ``d`` floats per iteration: :math:`p_c`, and :math:`2 q_c` more
    #: for VR-FALD⋆'s refreshes
    rounds: float


def setting(
    quadratics: ClientQuadratics,
    step: float,
    comm_prob: float,
    refresh_prob: float | None,
    noise_corr: float,
) -> Communication:
    """The :class:`Communication` of a setting: its predicted drift error (FALD's mean included, where
    ``refresh_prob`` is ``None``) and its rounds per iteration."""
    error = quadratics.error(
        step, comm_prob, refresh_prob=refresh_prob, noise_corr=noise_corr, drift=refresh_prob is None
    ).worst
    rounds = comm_prob + (0.0 if refresh_prob is None else 2 * refresh_prob)
    return Communication(comm_prob, refresh_prob, error, rounds)


def least_refresh(
    quadratics: ClientQuadratics,
    step: float,
    comm_prob: float,
    floor: float,
    ceiling: float,
    noise_corr: float,
    target: float = COMMUNICATION_TARGET,
) -> Communication | None:
    """VR-FALD⋆'s least refresh probability in ``[floor, ceiling]`` whose drift error at ``comm_prob`` is
    within ``target`` (bisected on its logarithm to 5%; the error falls as the reference follows the
    average more closely), or ``None`` where even ``ceiling`` is not."""
    low = setting(quadratics, step, comm_prob, floor, noise_corr)
    if low.error <= target:
        return low
    high = setting(quadratics, step, comm_prob, ceiling, noise_corr)
    if not high.error <= target:
        return None
    while high.refresh_prob / low.refresh_prob > 1.05:
        middle = setting(
            quadratics, step, comm_prob, (low.refresh_prob * high.refresh_prob) ** 0.5, noise_corr
        )
        low, high = (low, middle) if middle.error <= target else (middle, high)
    return high


def choose_communication(
    quadratics: ClientQuadratics,
    step: float,
    *,
    refreshes: bool,
    refresh_floor: float = 0.0,
    refresh_ceiling: float = 1.0,
    noise_corr: float = 1.0,
    target: float = COMMUNICATION_TARGET,
) -> Communication:
    r"""The setting of least rounds per iteration among the averaging probabilities ``COMM_PROBS`` below 1
    (with VR-FALD⋆'s least refresh probability for each, ``refreshes``, in ``[refresh_floor,
    refresh_ceiling]``: :func:`least_refresh`) whose drift error at ``step`` is within ``target``; averaging
    at every iteration (:math:`p_c = 1`, no drift, the refreshes at ``refresh_floor``) where none is."""
    best = Communication(1.0, refresh_floor if refreshes else None, 0.0, 1.0 + 2 * refresh_floor * refreshes)
    for comm_prob in COMM_PROBS[1:]:
        if refreshes:
            found = least_refresh(
                quadratics, step, comm_prob, refresh_floor, refresh_ceiling, noise_corr, target
            )
        else:
            found = setting(quadratics, step, comm_prob, None, noise_corr)
            found = found if found.error <= target else None
        if found is not None and found.rounds < best.rounds:
            best = found
    return best


#: the drift error (posterior sds) of a run's communication setting above which the kernel warns before the
#: draws
DRIFT_WARNING = 0.1
#: how many times at most an automatic step is cut for the drift of a communication setting the user chose
#: (the chains then need as many times the iterations); beyond, the kernel keeps that cut and warns
STEP_CUT_LIMIT = 4.0
#: the least automatic refresh probability of an automatic communication setting, as a share of the rule of
#: :func:`~pyro_fed.algorithms.adaptation.refresh_probability` (whose refreshes take a tenth of the data
#: evaluations): the quadratic model, which sees the reference's staleness, chooses above it
AUTOMATIC_REFRESH_FLOOR = 1 / 16
#: the most entries of the clients' Hessians (``b d^2``) held for the quadratic model: beyond, the setting
#: is chosen without it (averaging at every iteration) and nothing is predicted
MODEL_ELEMENTS = 2**24


def refresh_bounds(chosen: Adaptation, run: Run) -> tuple[float, float, bool]:
    """VR-FALD⋆'s automatic refresh probabilities: the least (refreshes take ``REFRESH_SHARE`` of the
    iterations' data evaluations, :func:`~pyro_fed.algorithms.adaptation.refresh_probability`), the most
    (refreshes evaluate at most as much data as the iterations: at most twice the work; any with full local
    batches), and whether the minibatches are the clients' full data, for the warm-up's minibatch."""
    sizes = run.potential.all_client_sizes
    used = sizes if chosen.batch_size is None else client_batch_sizes(chosen.batch_size, sizes)
    exact = bool((used == sizes).all())
    iteration_data = (1 if exact else 2) * int(used.sum())
    full_data = int(sizes.sum())
    floor = adaptation.refresh_probability(iteration_data, full_data)
    return floor, max(floor, min(1.0, iteration_data / full_data)), exact


def client_model(chosen: Adaptation, run: Run, root: torch.Tensor) -> ClientQuadratics | None:
    """The quadratic model of the held clients at the warm-up's mode (every client's Hessian from ``d``
    Hessian-vector products, its gradient from one full-data pass; one round of uploads of ``d^2`` floats
    and one of ``d``), or ``None`` where the Hessians would not be gathered (``d`` above
    ``DENSE_DIMENSIONS``) or held (``b d^2`` above ``MODEL_ELEMENTS``)."""
    pot, network = run.potential, run.network
    if pot.dim > adaptation.DENSE_DIMENSIONS or network.num_clients * pot.dim**2 > MODEL_ELEMENTS:
        return None
    hessians = adaptation.client_hessian_matrices(pot.full_gradient_fn, chosen.mode, pot.num_clients)
    gradients = run.full_gradients(chosen.mode[None])[0]
    network.record_averages(pot.dim + 1, shared=True)
    return ClientQuadratics.at_mode(hessians, gradients, root, network)


def finish_communication(
    settings: Algorithm, chosen: Adaptation, run: Run, *, refreshes: bool
) -> tuple[Adaptation, Algorithm, list[str]]:
    r"""FALD's and VR-FALD⋆'s last word on what the warm-up chose (``refreshes``: VR-FALD⋆'s, with a
    refresh probability), for the algorithm's ``settings``: the communication setting and the step, from the
    clients' quadratic model at the mode (:class:`ClientQuadratics`).

    The warm-up sets the step for the clients' average (one Langevin step of :math:`\gamma / b` on
    :math:`U`, as with an average at every iteration). Between averaging rounds each client also steps on its
    own potential: the step is kept at most ``STABLE_PRODUCT`` over the largest stiffness of a client (at the
    mode and the warm-up's typical points), and the drift error (:meth:`ClientQuadratics.error`) within
    ``COMMUNICATION_TARGET``:

    - ``comm_prob=None`` (automatic): the setting of least rounds per unit of Langevin time (rounds per
      iteration over the step) among those within the target (:func:`choose_communication`, at the step the
      clients' stability allows), or an average at every iteration at the warm-up's step where that costs
      fewer; VR-FALD⋆'s automatic refresh probability is at most ``refresh_bounds``' ceiling;
    - a ``comm_prob`` of the user's: VR-FALD⋆'s least refresh probability within the target (at most the
      ceiling) and, with an automatic step, the step cut (at most ``STEP_CUT_LIMIT``-fold) until the target
      is met; where it is not, a warning before the run names the predicted error, its cause and the
      ``comm_prob`` that meets it at the uncut step.

    Without a model (``d`` above ``DENSE_DIMENSIONS``) an automatic ``comm_prob`` is 1 and a user's keeps
    the step the clients' own stiffness allows (:func:`~pyro_fed.algorithms.adaptation.step_size` for it)."""
    if settings.comm_prob == 1.0 or chosen is None:
        return chosen, settings, []
    found, step, problem = _communication(settings, chosen, run)
    b = run.network.num_clients
    thinning, relaxation = chosen.thinning, chosen.relaxation
    if step != chosen.step_size:
        relaxation = adaptation.relaxation_time(step / b, chosen.slowest)
        if run.thinning is None:
            thinning = adaptation.thinning_for(step / b, chosen.slowest)
    return (
        _chosen(settings, chosen, found, step, thinning, relaxation),
        settings,
        [problem] if problem else [],
    )


def finish_window(settings: Algorithm, algorithm: Algorithm, chosen: Adaptation, run: Run) -> Adaptation:
    """What the warm-up measured again from the chains' draws (``chosen``), for the run's ``algorithm`` of
    FALD's family (built from ``settings``): the communication setting chosen again where it is automatic
    (the run's ``algorithm`` takes it for the iterations still to come), the new automatic step bounded as
    :func:`finish_communication` bounds it, the thinning kept."""
    if settings.comm_prob == 1.0 or run.step_size is not None:
        return chosen._replace(comm_prob=algorithm.comm_prob)
    found, step, _ = _communication(settings, chosen, run)
    relaxation = adaptation.relaxation_time(step / run.network.num_clients, chosen.slowest)
    renewed = _chosen(settings, chosen, found, step, chosen.thinning, relaxation)
    # the iterations still to come run the setting chosen now (their coins are drawn from it)
    resolved = settings.resolve(dataclasses.replace(run, chosen=renewed, step=step))
    for name in ("comm_prob", "refresh_prob"):
        if name in resolved:
            setattr(algorithm, name, resolved[name])
    return renewed


def _chosen(settings, chosen, found: Communication, step, thinning, relaxation) -> Adaptation:
    """``chosen`` with the communication setting ``found`` and the step, thinning and relaxation time."""
    automatic_refresh = getattr(settings, "refresh_prob", 0.0) is None and found.refresh_prob is not None
    return chosen._replace(
        step_size=step,
        thinning=thinning,
        relaxation=relaxation,
        comm_prob=found.comm_prob,
        refresh_prob=found.refresh_prob if automatic_refresh else math.nan,
        drift_error=found.error,
    )


def _communication(settings, chosen: Adaptation, run: Run) -> tuple[Communication, float, str | None]:
    """The communication setting and the step of :func:`finish_communication`, and the sentence of a user's
    setting whose drift error stays above ``DRIFT_WARNING`` (said in a warning now), or ``None``."""
    comm_prob = settings.comm_prob
    refreshes = hasattr(settings, "refresh_prob")
    floor, ceiling, exact = refresh_bounds(chosen, run) if refreshes else (0.0, 0.0, True)
    root, uncut, own = _client_limits(chosen, run)
    quadratics = client_model(chosen, run, root)
    if comm_prob is None:
        if quadratics is not None:
            best = choose_communication(
                quadratics, uncut, refreshes=refreshes, refresh_floor=floor * AUTOMATIC_REFRESH_FLOOR,
                refresh_ceiling=ceiling, noise_corr=settings.noise_corr,
            )  # fmt: skip
            every = 1.0 + (0.0 if not refreshes or exact else 2 * floor)  # rounds, averaging every iteration
            if best.comm_prob < 1 and best.rounds / uncut < every / chosen.step_size:
                return best, uncut, None
            return Communication(1.0, None, 0.0, every), chosen.step_size, None
        return Communication(1.0, None, math.nan, 1.0), chosen.step_size, None
    if quadratics is None:
        return Communication(comm_prob, None, math.nan, comm_prob), min(uncut, own), None
    found, step = _within_target(
        quadratics, settings, comm_prob, uncut, floor, ceiling, run.step_size is None
    )
    if found.error <= DRIFT_WARNING:
        return found, step, None
    problem = _drift_problem(quadratics, settings, found, step, uncut, floor, run)
    messages.warn(f"pyro_fed: {problem}.")
    return found, step, problem


def _client_limits(chosen: Adaptation, run: Run) -> tuple[torch.Tensor, float, float]:
    """The preconditioner's root, the warm-up's step bounded by every client's own stability (its steps
    between rounds: ``STABLE_PRODUCT`` over the largest client stiffness at the mode and the typical points;
    a user's step as it is), and the step that stiffness sets as for a client alone (the rule of a setting
    without a quadratic model)."""
    pot, network = run.potential, run.network
    root = adaptation.square_root(chosen.preconditioner)
    if run.step_size is not None:
        return root, chosen.step_size, chosen.step_size
    points = chosen.mode[None]
    if chosen.typical_points is not None:
        points = torch.cat([points, chosen.typical_points])
    stiffness, _, _ = adaptation.client_stiffness(
        pot.full_gradient_fn, points, root, pot.num_clients, everywhere=network.everywhere
    )
    stiffness = network.maximum(stiffness).double()
    largest = float(stiffness.max())
    typical = stiffness[1:] if len(stiffness) > 1 else stiffness
    own = adaptation.step_size(adaptation.step_stiffness(typical, largest), chosen.noise, network.num_clients)
    return root, min(chosen.step_size, adaptation.STABLE_PRODUCT / largest), own


def _within_target(quadratics, settings, comm_prob, uncut, floor, ceiling, automatic_step):
    """At a user's ``comm_prob``: the setting (VR-FALD⋆'s least refresh probability, where automatic) and the
    step (``uncut``, or halved at most ``STEP_CUT_LIMIT``-fold, then bisected to 5%, where automatic) whose
    drift error is within ``COMMUNICATION_TARGET``, or the smallest step tried where none is."""
    refresh_given = getattr(settings, "refresh_prob", None)
    refreshes = hasattr(settings, "refresh_prob")

    def at(step: float) -> Communication:
        if refreshes and refresh_given is None:
            found = least_refresh(quadratics, step, comm_prob, floor, ceiling, settings.noise_corr)
            if found is not None:
                return found
            return setting(quadratics, step, comm_prob, ceiling, settings.noise_corr)
        return setting(quadratics, step, comm_prob, refresh_given if refreshes else None, settings.noise_corr)

    found = at(uncut)
    if found.error <= COMMUNICATION_TARGET or not automatic_step:
        return found, uncut
    high, step = uncut, uncut
    while step > uncut / STEP_CUT_LIMIT:
        step = max(step / 2, uncut / STEP_CUT_LIMIT)
        found = at(step)
        if found.error <= COMMUNICATION_TARGET:
            break
        high = step
    else:
        return found, step
    low = step  # within the target at low, not at high
    while high / low > 1.05:
        middle = (low * high) ** 0.5
        trial = at(middle)
        if trial.error <= COMMUNICATION_TARGET:
            low, found = middle, trial
        else:
            high = middle
    return found, low


def _drift_problem(quadratics, settings, found, step, uncut, floor, run) -> str:
    """The sentence of a user's communication setting whose drift error stays above ``DRIFT_WARNING``: the
    worst coordinate's predicted mean offset and sd ratio, the cause, and the least ``comm_prob`` (of
    ``COMM_PROBS``, at least the user's) within ``COMMUNICATION_TARGET`` at the uncut step."""
    refreshes = found.refresh_prob is not None
    names = run.potential.space.coordinate_names
    error = quadratics.error(
        step, found.comm_prob, refresh_prob=found.refresh_prob, noise_corr=settings.noise_corr,
        drift=not refreshes,
    )  # fmt: skip
    per = (error.mean_offsets.square() + (error.sd_ratios - 1).square()).sqrt()
    worst = int(per.nan_to_num(math.inf).argmax())
    remedy = 1.0
    for comm_prob in sorted(p for p in COMM_PROBS if p >= found.comm_prob):
        if comm_prob == 1.0:
            break
        if refreshes:
            if least_refresh(quadratics, uncut, comm_prob, floor, 1.0, settings.noise_corr) is not None:
                remedy = comm_prob
                break
        elif setting(quadratics, uncut, comm_prob, None, settings.noise_corr).error <= COMMUNICATION_TARGET:
            remedy = comm_prob
            break
    kernel = "VrFaldKernel" if refreshes else "FaldKernel"
    where = (
        f"with comm_prob={found.comm_prob:.3g}"
        + (f" and refresh_prob={found.refresh_prob:.3g}" if refreshes else "")
        + (f", at the automatic step cut {uncut / step:.2g}-fold to {step:.3g}" if step < uncut else "")
    )
    if math.isinf(error.worst):
        predicted = "the quadratic model has no stationary law: the clients run off between rounds"
    else:
        offset, ratio = abs(float(error.mean_offsets[worst])), float(error.sd_ratios[worst])
        predicted = (
            f"the draws of {names[worst]} are {offset:.2g} posterior sds off in mean and {ratio:.3g} times "
            f"as wide (a drift error of {error.worst:.2g} posterior sds; the warning's threshold is "
            f"{DRIFT_WARNING})"
        )
    cause = (
        "the clients' curvatures differ, so that between rounds the control variates, exact at the "
        "reference point only, push the clients apart the farther the average is from it"
        if refreshes
        else "each client drifts toward its own posterior between rounds (client drift), and the clients' "
        "curvatures differ"
    )
    fix = (
        f"comm_prob={remedy:.3g} keeps it within {COMMUNICATION_TARGET}"
        + (" (with the automatic refresh_prob)" if refreshes else "; VrFaldKernel's control variates remove "
           "the mean's drift")
        + "; comm_prob=None lets the warm-up choose the least traffic within it"
    )  # fmt: skip
    return (
        f"{kernel} {where}: in a quadratic model of the clients at the mode, {predicted}. The cause: "
        f"{cause}. {fix}"
    )
