r"""D-ULA's automatic constant step: the warm-up's step (each agent's local step stable on its own potential,
checked by the pilot run), cut until the agents' disagreement costs their average little.

Two measures bound it: in a diagonal quadratic model of the agents at the mode (:func:`consensus_analysis`:
their curvatures and gradients there, the graph's Laplacian), the average's stationary variance within
``VARIANCE_TARGET`` of the posterior's and its mean within ``CONSENSUS_MEAN_TARGET`` posterior sds in every
coordinate; then, with the agents' real gradients at the warm-up's typical points and their reflections
through the mode, the drift of the average that their disagreement causes (:func:`disagreement_drift`): the
disagreement that their own noise makes on a curved potential, and the offsets their data pull them to
(:func:`data_pulls`), which move a coordinate whose curvature depends on another's (a noise scale's on the
coefficients' residuals). A step cut so far that the run's draws cannot be independent is reported
(:func:`step_problem`), before the run and by its end-of-run checks.

**Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
NeurIPS 2020 (the algorithm; the step's choice is pyro_fed's).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from .. import messages
from . import adaptation, convergence
from .adaptation import Adaptation
from .base import Algorithm, Run

#: the largest gap, in posterior sds, between the average's stationary mean and the mode that the automatic
#: constant step allows in the agents' quadratic model (see
#: :func:`consensus_analysis`)
CONSENSUS_MEAN_TARGET = 0.1
#: antithetic pairs of disagreement draws at each typical point, and steps tried at most, for the drift
#: that the agents' disagreement causes (see :func:`within_disagreement`)
DISAGREEMENT_PAIRS, DISAGREEMENT_CHECKS = 16, 12
#: the factor by which :func:`consensus_analysis` shrinks a step that misses its targets, and how many
#: times, at most
CONSENSUS_SHRINK, CONSENSUS_SHRINKS = 0.8, 60
#: graphs larger than this are not analysed by :func:`consensus_analysis` (its solves cost :math:`n^3`), nor
#: more coordinates than this
CONSENSUS_AGENTS, CONSENSUS_COORDINATES = 300, 64


class ConsensusAnalysis(NamedTuple):
    """What :func:`consensus_analysis` found: the step, and the targets' state there."""

    step: float  #: the largest step tried that meets the targets, or the last (smallest) one tried
    met: bool  #: whether the targets are met at ``step`` (``True`` for a graph too large to analyse)
    mean: float  #: the largest gap of the average's stationary mean at ``step``, in posterior sds
    variance: float  #: the largest relative error of the average's stationary variance at ``step``
    coordinate: int  #: the coordinate of the largest gap or error relative to its target (-1: none)


def consensus_analysis(
    step: float,
    curvatures: torch.Tensor,
    gradients: torch.Tensor,
    graph,
    consensus_size: float,
    *,
    variance_target: float,
    mean_target: float,
    exchanges: int = 1,
) -> ConsensusAnalysis:
    r"""The largest constant step :math:`\alpha \le` ``step`` (on the grid ``step`` :math:`\cdot\,
    0.8^j`, ``CONSENSUS_SHRINKS`` shrinks at most) at which, in every coordinate of a diagonal quadratic
    model of the agents, the average's stationary variance is within ``variance_target`` (relative) of the
    posterior's and its mean within ``mean_target`` posterior standard deviations of the posterior's; and
    whether there is one.

    The model: in a coordinate measured in posterior standard deviations, agent :math:`i` has curvature
    :math:`c_i \ge 0` (its share of the Hessian's diagonal, :math:`\sum_i c_i = 1`) and gradient
    :math:`g_i` at the point :math:`\hat x` where they were measured (the mode the warm-up found). The
    model's posterior mode is where the gradients sum to zero, :math:`\hat x + e^\star` with
    :math:`e^\star = -\sum_i g_i / \sum_i c_i`; measured from there, the gradients are :math:`g_i' = g_i +
    c_i e^\star`, which sum to zero. D-ULA's deviations :math:`e` from the mode then follow :math:`e
    \leftarrow A e - \alpha n g' + \sqrt{2 \alpha n}\, z` with the symmetric :math:`A = I - \beta L -
    \alpha n\, \mathrm{diag}(c)`, whose stationary law is exact: mean :math:`-\alpha n (\beta L + \alpha
    n\, \mathrm{diag}(c))^{-1} g'`, covariance :math:`2 \alpha n (I - A^2)^{-1}`; the average reads
    :math:`\mathbf 1 / n` of them. With identical agents this is ULA's law (variance :math:`1 / (1 - \alpha
    / 2)`, no bias): disagreement costs nothing; with heterogeneous ones the bias and the variance's error
    grow with :math:`\alpha` over what the graph's mixing undoes, and vanish as :math:`\alpha \to 0`.

    Measured from :math:`\hat x` itself rather than from the model's mode, the mean would carry
    :math:`e^\star`, the search's own error, at every step: the search stops within a tenth of a posterior
    sd of the mode (``MODE_TOLERANCE``, the Newton decrement, which bounds every coordinate's
    :math:`|e^\star|`), or farther where it stalls (reported only beyond ``MODE_WARNING``, one sd). A
    remainder near the target then cost a much smaller step, and one beyond it any step: the step shrank
    ``CONSENSUS_SHRINKS`` times, to :math:`0.8^{60} \approx 10^{-6}` of the warm-up's, and the chains froze.

    Graphs of more than ``CONSENSUS_AGENTS`` agents are not analysed (``step`` is returned); at most the
    ``CONSENSUS_COORDINATES`` coordinates whose agents differ most are.

    :param curvatures: :math:`c`, ``[n, d]``.
    :param gradients: :math:`g`, ``[n, d]``.
    :param graph: the agents' :class:`~pyro_fed.network.graphs.Graph` (its Laplacian :math:`L`).
    :param consensus_size: :math:`\beta`.
    :param exchanges: :math:`K`, the exchanges per step: :math:`\beta L` becomes :math:`I - (I - \beta L)^K`
        (:meth:`~pyro_fed.network.graphs.Graph.contraction`).
    """
    n = curvatures.shape[0]
    if n > CONSENSUS_AGENTS:
        return ConsensusAnalysis(step, True, math.nan, math.nan, -1)
    # on the host, with the graph: n x n solves of at most CONSENSUS_AGENTS agents, wherever the data are
    dtype, host = torch.float64, torch.device("cpu")
    c = curvatures.T.to(host, dtype).clamp_min(0)  # [d, n]
    g = gradients.T.to(host, dtype)
    # from the model's own mode, where the agents' gradients sum to zero (see above)
    g = g - c * g.sum(1, keepdim=True) / c.sum(1, keepdim=True).clamp_min(1e-300)
    # the coordinates where the agents differ most (identical agents cost nothing), at most
    # CONSENSUS_COORDINATES of them: each costs two n x n solves per step tried
    spread = (n * c - 1).square().sum(1) + g.square().sum(1)
    chosen = spread.argsort(descending=True)[:CONSENSUS_COORDINATES]
    c, g = c[chosen], g[chosen, :, None]
    eye = torch.eye(n, dtype=dtype, device=host)
    # what the exchanges contract, I - (I - beta L)^K, from the graph's eigenbasis
    vectors = graph.eigenbasis[1].to(host, dtype)
    mixing = (vectors * graph.contraction(consensus_size, exchanges).to(host, dtype)) @ vectors.T
    ones = torch.ones(n, 1, dtype=dtype, device=host)
    alpha, last = step, ConsensusAnalysis(step, False, math.inf, math.inf, -1)
    for _ in range(CONSENSUS_SHRINKS):
        local = alpha * n * torch.diag_embed(c)  # [d, n, n]
        transition = eye - mixing - local
        factor, info = torch.linalg.cholesky_ex(eye - transition @ transition)
        if not bool(info.any()):  # |eigenvalues of A| < 1: stationary
            variance = (
                2 * alpha * n * (ones.T @ torch.cholesky_solve(ones.expand(len(c), -1, -1), factor)) / n**2
            ).flatten()
            mean = (-alpha * n * (ones.T @ torch.linalg.solve(mixing + local, g)) / n).flatten()
            error, gap = (variance - 1).abs(), mean.abs()
            worst = torch.maximum(error / variance_target, gap / mean_target).argmax()
            last = ConsensusAnalysis(
                alpha,
                bool((error <= variance_target).all()) and bool((gap <= mean_target).all()),
                float(gap.max()),
                float(error.max()),
                int(chosen[worst]),
            )
            if last.met:
                return last
        else:
            last = ConsensusAnalysis(alpha, False, math.inf, math.inf, -1)
        alpha *= CONSENSUS_SHRINK
    return last


def disagreement(
    graph,
    consensus_size: float,
    step: float,
    dim: int,
    num_draws: int,
    generator: torch.Generator,
    exchanges: int = 1,
) -> torch.Tensor:
    r"""``num_draws`` draws ``[R, n, d]`` of the agents' stationary disagreement :math:`e_i = w_i - \bar w`
    driven by their own noises, in the preconditioned coordinates where the posterior's scales are 1.

    Each agent steps :math:`\alpha n` on its share :math:`U_i \approx U / n` with noise :math:`\sqrt{2 \alpha
    n}\, z_i`, so in the graph's eigenbasis :math:`(\lambda_k, u_k)` the disagreement mode :math:`k \ge 2`
    follows :math:`\xi_k \leftarrow (1 - \beta \lambda_k - \alpha)\, \xi_k + \sqrt{2 \alpha n}\, z`: a
    Gaussian of variance :math:`2 \alpha n / (1 - \rho_k^2)`, :math:`\rho_k = 1 - \beta\lambda_k - \alpha`,
    and :math:`e = \sum_{k \ge 2} u_k \xi_k`. Each agent is about :math:`\sqrt{2 \alpha n}` posterior sds from
    the average even on a complete graph: its noise is the one the average needs, times :math:`\sqrt n`.
    With ``exchanges`` :math:`K` per step, :math:`1 - \beta \lambda_k` becomes :math:`(1 - \beta
    \lambda_k)^K`.

    :param graph: a :class:`~pyro_fed.network.graphs.Graph`: its Laplacian's eigenbasis, computed once.
    """
    vectors = graph.eigenbasis[1]
    rho = 1.0 - graph.contraction(consensus_size, exchanges)[1:] - step
    variance = 2 * step * graph.num_agents / (1 - rho.square()).clamp_min(1e-12)
    modes = torch.randn(num_draws, len(rho), dim, generator=generator, dtype=torch.float64, device="cpu")
    return vectors[:, 1:] @ (variance.sqrt()[:, None] * modes)


def finish_step(settings: Algorithm, chosen: Adaptation, run: Run) -> tuple[Adaptation, Algorithm, list[str]]:
    """D-ULA's last word on what the warm-up chose, for the algorithm's ``settings``
    (:meth:`pyro_fed.algorithms.dula.Dula.finish_adaptation`): with an automatic constant step, the largest at
    most the warm-up's at which the agents' disagreement costs the average little (:func:`consensus_analysis`,
    from each agent's curvature and gradient at the mode: one more round of uploads; then the drift that their
    disagreement causes on the curved potential, :func:`within_disagreement`), the thinning with it; the
    settings with the run's graph and consensus step resolved; and a step cut so far that the run's draws
    cannot be independent (:func:`step_problem`), reported with a warning now, before the run, and again by
    the end-of-run checks."""
    if run.step_size is not None or settings.schedule != "constant" or run.network.num_clients == 1:
        return chosen, settings, []
    pot, network = run.potential, run.network
    graph = settings.agents_graph(network.num_clients)
    consensus_size = settings.consensus_for(graph)
    # each coordinate in the Laplace approximation's posterior sds: its curvature shares and gradients
    total = adaptation.floored_curvature(chosen.curvature)
    # the analysis reads every agent's share, wherever the agents are held
    gradients = network.gather(pot.full_client_grads(chosen.mode)) / total.sqrt()
    network.record_averages(1, shared=True)
    shares = network.gather(chosen.client_curvatures) / total
    consensus = consensus_analysis(
        chosen.step_size,
        shares,
        gradients,
        graph,
        consensus_size,
        variance_target=adaptation.VARIANCE_TARGET,
        mean_target=CONSENSUS_MEAN_TARGET,
        exchanges=settings.consensus_rounds,
    )
    step, rounds, drift = within_disagreement(
        graph, consensus_size, chosen, consensus.step, run, settings.consensus_rounds
    )
    thinning, relaxation = chosen.thinning, adaptation.relaxation_time(step, chosen.slowest)
    if run.thinning is None:
        thinning = adaptation.thinning_for(step, chosen.slowest)
    # "this ring", "this complete graph", "this graph" (one given as a matrix)
    name = settings.graph if isinstance(settings.graph, str) else "graph"
    if name not in ("ring", "path", "star", "graph"):
        name = f"{name.replace('_', '-')} graph"
    report = step_problem(name, graph, chosen, consensus, drift, step, thinning, shares, run)
    if report is not None:
        messages.warn(f"pyro_fed: {report}.")
    finished = chosen._replace(
        step_size=step, thinning=thinning, rounds=chosen.rounds + 1 + rounds, relaxation=relaxation
    )
    # the graph and the consensus step, resolved here, kept for the run (Dula.resolve keeps them as given)
    resolved = dataclasses.replace(settings, graph=graph, consensus_size=consensus_size)
    return finished, resolved, [] if report is None else [report]


def step_problem(
    name: str, graph, chosen: Adaptation, consensus, drift, step: float, thinning: int, shares, run: Run
) -> str | None:
    r"""A sentence saying why the automatic step leaves the run too few independent draws, or ``None``.

    The average's slowest direction (curvature :math:`\lambda`, ``chosen.slowest``, in the
    preconditioned coordinates) relaxes in :math:`1 / (a \lambda)` iterations at the step :math:`a`;
    the run's sampling iterations cover :math:`T = a \lambda K` relaxation times, about :math:`T / 2`
    independent draws per chain (as for the decaying schedule's check). Reported when that is below
    ``ESS_PER_CHAIN`` while the thinning is the user's or at its cap (``MAX_THINNING``), so that the
    step, not ``num_samples``, is what limits the draws, or when a target the step is cut for was met by
    no step tried (the graph and the split leave no usable step). ``name`` names the graph."""
    num_samples = run.num_samples
    covered = step * chosen.slowest * thinning * (num_samples or 0)
    unmet = not consensus.met or not drift[0]
    short = (
        num_samples is not None
        and covered / 2 < convergence.ESS_PER_CHAIN
        and run.thinning is None
        and thinning >= adaptation.MAX_THINNING
    )
    if not (unmet or short) or step >= chosen.step_size:
        return None
    n, names = run.network.num_clients, run.potential.space.coordinate_names
    gap, largest = graph.spectral_gap, graph.lambda_max
    reasons = []
    if consensus.coordinate >= 0 and (not consensus.met or consensus.step < chosen.step_size):
        k = consensus.coordinate
        agents = shares[:, k].argsort(descending=True)[:2].tolist()
        held = float(shares[agents, k].sum())
        reasons.append(
            f"in the agents' quadratic model at the mode, the average's stationary mean is within "
            f"{CONSENSUS_MEAN_TARGET:g} posterior sds of the posterior's and its variance within "
            f"{adaptation.VARIANCE_TARGET:.0%} {'only at steps up to' if consensus.met else 'at no step'}"
            f"{'' if consensus.met else ' down to'} {consensus.step:.3g} "
            f"({'there' if consensus.met else 'at that step'}: the mean {consensus.mean:.3g} sds off, "
            f"the variance {consensus.variance:.1%} off; worst in {names[k]}, "
            f"where agents {agents[0]} and {agents[1]} hold {held:.0%} of the curvature)"
        )
    met, value, cut_for_drift = drift
    if cut_for_drift:
        reasons.append(
            "the drift of the average that the agents' disagreement causes (their own noise's and their "
            f"data's pulls) is {value:.3g} posterior sds at {step:.3g}, "
            f"{'within' if met else 'still above'} its target of {CONSENSUS_MEAN_TARGET:g}"
        )
    sentence = (
        f"D-ULA's automatic step is {step:.3g}, the warm-up's {chosen.step_size:.3g} (stable for each "
        f"agent) cut {chosen.step_size / step:.3g}-fold on this {name} of {n} agents (the Laplacian's "
        f"spectral gap {gap:.3g}, its largest eigenvalue {largest:.3g}): "
        f"{'; '.join(reasons)}. An iteration moves the average {step * chosen.slowest:.3g} of a "
        "relaxation time of its slowest direction"
    )
    if num_samples is not None:
        sentence += (
            f"; the {num_samples} draws of {thinning} iterations cover {covered:.3g} relaxation times, "
            f"about {covered / 2:.3g} independent draws per chain"
        )
    what = "the graph and the split leave no usable step" if unmet else "the chains will barely move"
    return (
        f'{sentence}. So {what}: a better-connected graph ("complete" mixes in one exchange), clients '
        "whose data are alike, more consensus_rounds (exchanges per step, at as many times the bits), or a "
        "step_size of your own (at the cost of the bias these targets bound)"
        + ("" if unmet else ", or more num_samples")
    )


def within_disagreement(
    graph, consensus_size: float, chosen: Adaptation, step: float, run: Run, exchanges: int = 1
) -> tuple[float, int, tuple[bool, float, bool]]:
    r"""The step, shrunk until the agents' gradients at their own, disagreeing points drift the average
    by at most ``CONSENSUS_MEAN_TARGET`` posterior sds, the rounds of uploads it cost, and whether the
    target was met, the drift at the step returned and whether any step was cut for it.

    The quadratic model of :func:`consensus_analysis` is blind to most of it: it sees each coordinate alone,
    at the mode. The agents disagree for two reasons. Their own noise puts each about :math:`\sqrt{2\alpha
    n}` posterior sds from their average (:func:`disagreement`), where a curved potential's gradients no
    longer average to the gradient at the average. Their data pull each toward its own posterior
    (:func:`data_pulls`), and where one coordinate's curvature depends on another (a noise scale's on the
    residuals of the regression coefficients), the agents' offsets and their curvatures move together: an
    agent pulled toward its own fit sees smaller residuals, and the average's scale shrinks. Both are
    measured with the agents' real gradients at the typical points, the noise's disagreement drawn in
    antithetic pairs :math:`\pm e` around the data's offsets :math:`o` (the noise's linear term cancels
    exactly), as the drift error :math:`\frac12 E[G(x + o + e) + G(x + o - e)] - \nabla U(x)`, :math:`G(z) =
    \sum_i \nabla U_i(z_i)`, averaged over the points, in the preconditioned coordinates (a mean shift in
    posterior sds). The two can pull a coordinate in opposite directions (the noise's spread makes residuals
    larger); they act together, and are measured so. The step is halved until the drift is within the
    target, then bisected (geometrically) twice between the last step that missed it and the first that met
    it: the drift grows with the step (the data's offsets in proportion, the noise's until the graph's slow
    modes saturate). ``exchanges``: the rounds of exchange per step (``consensus_rounds``)."""
    pulls = data_pulls(graph, consensus_size, chosen, run, exchanges)
    missed, met, rounds, drifts = None, None, 1, {}  # a round for the gradients of the data's pulls
    for _ in range(DISAGREEMENT_CHECKS):
        rounds += 1  # the agents upload their gradients at all the draws together
        drifts[step] = disagreement_drift(
            graph, consensus_size, chosen, step, run, pulls=pulls, exchanges=exchanges
        )
        if drifts[step] <= CONSENSUS_MEAN_TARGET:
            met = step
            if missed is None:  # the largest step tried: nothing to refine
                break
        else:
            missed = step
        if met is None:
            step /= 2
        elif missed / met <= 1.5:
            break
        else:
            step = (missed * met) ** 0.5
    if met is None:  # the last step tried
        met_step = min(drifts)
        return met_step, rounds, (False, drifts[met_step], True)
    return met, rounds, (True, drifts[met], missed is not None)


def drift_points(chosen: Adaptation) -> torch.Tensor:
    """Where the drift is measured: the warm-up's typical points and their reflections through the mode
    (``[2P, d]``). The drift's average over the posterior is wanted; its part that changes linearly across
    the points (the data's pulls on a Gaussian posterior are affine in the point) cancels exactly between a
    point and its reflection, where four points alone left a Monte Carlo error of the size of the drift."""
    points = chosen.typical_points
    return torch.cat([points, 2 * chosen.mode - points])


def data_pulls(
    graph, consensus_size: float, chosen: Adaptation, run: Run, exchanges: int = 1
) -> torch.Tensor:
    r"""The held agents' offsets from their average that their data cause, per unit of step, at each point
    :math:`x` of :func:`drift_points` (``[2P, b_h, d]``, in the model's coordinates).

    With its gradient held at :math:`g_i = \nabla U_i(x)`, agent :math:`i`'s offset :math:`o_i` settles
    where the consensus step undoes the local one, :math:`\beta L o = -\alpha n\, M (g - \bar g)` in each
    coordinate (:math:`M` the preconditioner): :math:`o = -\alpha n\, (\beta L)^+ M g`, the pseudo-inverse
    acting on the agents' axis (it removes their mean). The local steps' own pull back, :math:`\alpha n\, M
    \nabla^2 U_i`, is left out: on the graphs where the offsets matter it is much smaller than :math:`\beta`
    times the Laplacian's spectral gap, and without it the offsets are, if anything, too large. With
    ``exchanges`` :math:`K` per step, :math:`\beta L` becomes :math:`I - (I - \beta L)^K` (the same
    eigenvectors). Every process reads all the agents' gradients (one gather) and keeps its own agents'
    offsets."""
    pot, network, points = run.potential, run.network, drift_points(chosen)
    gradients = network.gather(pot.full_client_grads(points[:, None, :].expand(-1, pot.num_clients, -1)))
    network.record_averages(1, shared=True)
    preconditioner = chosen.preconditioner.to(gradients)
    scaled = gradients @ preconditioner if preconditioner.dim() == 2 else gradients * preconditioner
    eigenvalues, vectors = graph.contraction(consensus_size, exchanges), graph.eigenbasis[1]
    inverse = torch.where(eigenvalues > 1e-9 * eigenvalues.max(), 1 / eigenvalues, eigenvalues.new_zeros(()))
    spread = (vectors * inverse) @ vectors.T  # (beta L)^+, or (I - (I - beta L)^K)^+
    held = network.held(network.num_clients)
    return -network.num_clients * (spread[held].to(scaled) @ scaled)


def disagreement_drift(
    graph,
    consensus_size: float,
    chosen: Adaptation,
    step: float,
    run: Run,
    *,
    pulls: torch.Tensor | None = None,
    exchanges: int = 1,
) -> float:
    """The largest drift of the average, in posterior sds, from the agents' disagreement at ``step`` on
    ``graph`` with the consensus step ``consensus_size`` and ``exchanges`` per step (see
    :func:`within_disagreement`); ``pulls``: :func:`data_pulls` (computed here if not given)."""
    pot, network = run.potential, run.network
    if pulls is None:
        pulls = data_pulls(graph, consensus_size, chosen, run, exchanges)
    root, points = adaptation.square_root(chosen.preconditioner), drift_points(chosen)
    generator = torch.Generator().manual_seed(0)  # the same draws for every step tried: a smooth search
    draws = disagreement(graph, consensus_size, step, pot.dim, DISAGREEMENT_PAIRS, generator, exchanges)
    # the disagreement of all the agents (drawn alike wherever they are held), of which each process
    # evaluates its own agents' gradients: the sum over all of them is the same for any split
    offsets = adaptation.whiten(root, draws[:, network.held(network.num_clients)].to(points))
    centres = points[:, None, :] + step * pulls  # [P, b, d]
    agents = centres[:, None] + torch.cat([offsets, -offsets])[None]  # [P, 2R, b, d]
    summed = network.sum(pot.full_client_grads(agents.reshape(-1, pot.num_clients, pot.dim)))
    drift = summed.reshape(len(points), -1, pot.dim).mean(1) - pot.total_gradient(points)
    return float(adaptation.whiten(root, drift.mean(0)).abs().max())
