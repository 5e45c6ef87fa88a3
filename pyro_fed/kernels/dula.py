"""D-ULA and centralized SGLD as Pyro MCMC kernels."""

from __future__ import annotations

import warnings

import torch

from ..algorithms import adaptation, convergence, dula
from ..network.graphs import make_graph
from .arguments import check_positive
from .base import FederatedKernel

#: the largest gap, in posterior sds, between the average's stationary mean and the mode that the automatic
#: constant step allows in the agents' quadratic model (see
#: :func:`pyro_fed.algorithms.dula.consensus_analysis`)
CONSENSUS_MEAN_TARGET = 0.1
#: antithetic pairs of disagreement draws at each typical point, and steps tried at most, for the drift
#: that the agents' disagreement causes (see ``DulaKernel._within_disagreement``)
DISAGREEMENT_PAIRS, DISAGREEMENT_CHECKS = 16, 12


class DulaKernel(FederatedKernel):
    r"""D-ULA: decentralized Langevin over a graph of clients (agents), with no server.

    .. math::

        w \leftarrow ((I - \beta_k L) \otimes I_d)\, w - \alpha_k\, n\, m \odot \hat g(w)
        + \sqrt{2 \alpha_k m} \odot v, \quad v_i \sim N(0, n I),

    (see :mod:`pyro_fed.algorithms.dula`; :math:`m` is the preconditioner), with constant steps
    :math:`\alpha_k = a`, :math:`\beta_k = b` (``schedule="constant"``, the default) or the paper's decaying
    ones (``schedule="decaying"``) :math:`\alpha_k = a / (k_0 + k + 1)^{\delta_2}`,
    :math:`\beta_k = b / (k + 1)^{\delta_1}`. Each draw is the agents' average :math:`\bar w`;
    ``sample_stats`` records ``consensus_error`` :math:`\frac1n \sum_i \|w_i - \bar w\|^2` and the bits sent
    along the graph's edges (``d`` floats per directed edge and iteration, counted as uploaded and as
    downloaded).

    The automatic constant step is the warm-up's (as for the other kernels: each agent's local step
    :math:`\alpha n` stable on its own potential, checked by the pilot run), shrunk until the agents'
    disagreement costs the average little: in a diagonal quadratic model of the agents at the mode (their
    curvatures and gradients there, the graph's Laplacian;
    :func:`~pyro_fed.algorithms.dula.consensus_analysis`), the average's stationary variance within 10% of
    the posterior's and its mean within a tenth of a posterior standard deviation in every coordinate.
    Identical agents cost nothing (their disagreement cancels in the average); heterogeneous ones on a
    slowly mixing graph (a long ring) cost a smaller step.
    The decaying schedule makes a long run mix ever more slowly; the end of the run says so when its steps
    covered too few relaxation times for its draws to be independent.

    **Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
    NeurIPS 2020.

    :param graph: ``"ring"`` (default), ``"complete"``, ``"star"``, ``"path"``, ``"erdos_renyi"``, an
        adjacency matrix ``[n, n]`` or a :class:`~pyro_fed.network.graphs.Graph` (validated: symmetric, no
        self-loops, connected).
    :param float step_size: :math:`a` (default: chosen, see above; with ``"decaying"`` the first step
        :math:`\alpha_0` is the warm-up's).
    :param str schedule: ``"constant"`` (default) or ``"decaying"`` (the paper's).
    :param float step_decay: :math:`\delta_2` (``"decaying"`` only; default 0.55).
    :param float consensus_size: :math:`b` (default :math:`1/\lambda_{\max}(L)`).
    :param float consensus_decay: :math:`\delta_1` (``"decaying"`` only; default 0.04, as in the paper's
        Gaussian-mixture experiment: with :math:`\delta_2 = 0.55` it satisfies the condition below strictly).
    :param float step_offset: :math:`k_0` (``"decaying"`` only; default 0): slows the decay.
    :param bool record_agents: also keep every agent's iterate :math:`w_i` at each draw (``n d`` numbers per
        draw): :func:`~pyro_fed.to_inference_data` puts them, constrained, in an ``agents`` group with an
        ``agent`` dimension, for per-agent summaries and R-hat (default ``False``).

    The conditions of the decaying schedule's convergence theory, :math:`1/2 + \delta_1 < \delta_2 < 1`, are
    checked with a warning (the paper's own experiments sit on the boundary). Prior weights default to
    ``"uniform"`` (:math:`1/n` each). The other arguments are those of :class:`~pyro_fed.FederatedKernel`.
    """

    client_iterates = {"agents": "agent"}  # record_agents=True
    #: the schedules of the steps
    SCHEDULES = ("constant", "decaying")
    #: the decaying schedule's defaults: (step_decay, consensus_decay, step_offset)
    DECAYING = (0.55, 0.04, 0.0)

    def __init__(
        self,
        model,
        clients=None,
        *,
        graph="ring",
        schedule: str = "constant",
        step_decay: float | None = None,
        consensus_size: float | None = None,
        consensus_decay: float | None = None,
        step_offset: float | None = None,
        record_agents: bool = False,
        prior_weights="uniform",
        **kwargs,
    ):
        super().__init__(model, clients, prior_weights=prior_weights, **kwargs)
        self.record_agents = bool(record_agents)
        # why the automatic step leaves too few independent draws (finish_adaptation)
        self._step_report = None
        self.graph_spec = graph
        #: the agents' :class:`~pyro_fed.network.graphs.Graph`, built at set-up
        self.graph = None
        if schedule not in self.SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: use one of {self.SCHEDULES}.")
        self.schedule = schedule
        given = {"step_decay": step_decay, "consensus_decay": consensus_decay, "step_offset": step_offset}
        if schedule == "constant" and any(v is not None for v in given.values()):
            named = ", ".join(k for k, v in given.items() if v is not None)
            raise ValueError(
                f"{named}: a parameter of the decaying schedule; the steps are constant by default. Pass "
                'schedule="decaying" to make them decay.'
            )
        step_decay, consensus_decay, step_offset = (
            default if value is None else value
            for value, default in zip(given.values(), self.DECAYING, strict=True)
        )
        for name, value in (("step_decay", step_decay), ("consensus_decay", consensus_decay)):
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1); got {value!r}.")
        if schedule == "decaying" and not 0.5 + consensus_decay < step_decay < 1 and step_decay > 0:
            warnings.warn(
                "D-ULA's convergence theory needs 1/2 + consensus_decay < step_decay < 1; got "
                f"consensus_decay={consensus_decay} and step_decay={step_decay}.",
                stacklevel=2,
            )
        if schedule == "constant":
            step_decay = consensus_decay = 0.0
        self.step_decay, self.consensus_decay = float(step_decay), float(consensus_decay)
        self.consensus_size = (
            None if consensus_size is None else check_positive("consensus_size", consensus_size)
        )
        if not isinstance(step_offset, (int, float)) or step_offset < 0:
            raise ValueError(f"step_offset must be a non-negative number; got {step_offset!r}.")
        self.step_offset = float(step_offset)

    def _graph(self):
        """The graph over all the run's agents, built once for their number."""
        n = self.network.num_clients
        if self.graph is None or self.graph.num_agents != n:
            self.graph = make_graph(self.graph_spec, n)
        return self.graph

    def _consensus_size(self) -> float:
        r""":math:`b`: the user's, or :math:`1 / \lambda_{\max}(L)` (0 for one agent)."""
        if self.consensus_size is not None:
            return self.consensus_size
        lambda_max = self._graph().lambda_max
        return 1.0 / lambda_max if lambda_max > 0 else 0.0

    def make_algorithm(self, **common) -> dula.Dula:
        self._consensus = self._consensus_size()
        return dula.Dula(
            graph=self._graph(),
            consensus_size=self._consensus,
            step_decay=self.step_decay,
            consensus_decay=self.consensus_decay,
            step_offset=self.step_offset,
            record_agents=self.record_agents,
            **common,
        )

    def chosen_step(self, client_step: float) -> float:
        """:math:`a` such that the first step :math:`\\alpha_0 = a / (k_0 + 1)^{\\delta_2}` is
        :math:`\\gamma / n`, from the adaptation's client step :math:`\\gamma` (each agent steps with
        :math:`\\alpha n` on its share)."""
        return client_step / self.network.num_clients * (self.step_offset + 1.0) ** self.step_decay

    def finish_adaptation(self, chosen):
        """With an automatic constant step: the largest at most the warm-up's at which the agents'
        disagreement costs the average little (:func:`~pyro_fed.algorithms.dula.consensus_analysis`, from
        each agent's curvature and gradient at the mode: one more round of uploads; then the drift that
        their disagreement causes on the curved potential), the thinning with it. A step cut so far that the
        run's draws cannot be independent (``_step_problem``) is reported with a warning now, before the
        run, and again by the end-of-run checks."""
        pot = self.potential
        self._step_report = None
        if self.step_size is not None or self.schedule != "constant" or self.network.num_clients == 1:
            return chosen
        graph = self._graph()
        # each coordinate in the Laplace approximation's posterior sds: its curvature shares and gradients
        total = adaptation.floored_curvature(chosen.curvature)
        # the analysis reads every agent's share, wherever the agents are held
        gradients = self.network.gather(pot.full_client_grads(chosen.mode)) / total.sqrt()
        self.network.record_averages(1, shared=True)
        shares = self.network.gather(chosen.client_curvatures) / total
        consensus = dula.consensus_analysis(
            chosen.step_size,
            shares,
            gradients,
            graph.laplacian,
            self._consensus_size(),
            variance_target=adaptation.VARIANCE_TARGET,
            mean_target=CONSENSUS_MEAN_TARGET,
        )
        step, rounds, drift = self._within_disagreement(chosen, consensus.step)
        thinning = chosen.thinning
        if self.thinning is None:
            thinning = adaptation.thinning_for(step, chosen.slowest)
        self._step_report = self._step_problem(chosen, consensus, drift, step, thinning, shares)
        if self._step_report is not None:
            warnings.warn(f"pyro_fed: {self._step_report}.", stacklevel=2)
        return chosen._replace(step_size=step, thinning=thinning, rounds=chosen.rounds + 1 + rounds)

    def _step_problem(self, chosen, consensus, drift, step: float, thinning: int, shares) -> str | None:
        r"""A sentence saying why the automatic step leaves the run too few independent draws, or ``None``.

        The average's slowest direction (curvature :math:`\lambda`, ``chosen.slowest``, in the
        preconditioned coordinates) relaxes in :math:`1 / (a \lambda)` iterations at the step :math:`a`;
        the run's sampling iterations cover :math:`T = a \lambda K` relaxation times, about :math:`T / 2`
        independent draws per chain (as for the decaying schedule's check). Reported when that is below
        ``ESS_PER_CHAIN`` while the thinning is the user's or at its cap (``MAX_THINNING``), so that the
        step, not ``num_samples``, is what limits the draws, or when a target the step is cut for was met by
        no step tried (the graph and the split leave no usable step)."""
        num_samples = self.plan.num_samples
        covered = step * chosen.slowest * thinning * (num_samples or 0)
        unmet = not consensus.met or not drift[0]
        short = (
            num_samples is not None
            and covered / 2 < convergence.ESS_PER_CHAIN
            and self.thinning is None
            and thinning >= adaptation.MAX_THINNING
        )
        if not (unmet or short) or step >= chosen.step_size:
            return None
        n, names = self.network.num_clients, self.potential.space.coordinate_names
        eigenvalues = torch.linalg.eigvalsh(self._graph().laplacian)
        gap, largest = float(eigenvalues[1]), float(eigenvalues[-1])
        graph = self.graph_spec if isinstance(self.graph_spec, str) else "graph"
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
                f"the drift of the average that the agents' disagreement causes on the curved potential is "
                f"{value:.3g} posterior sds at {step:.3g}, {'within' if met else 'still above'} its "
                f"target of {CONSENSUS_MEAN_TARGET:g}"
            )
        sentence = (
            f"D-ULA's automatic step is {step:.3g}, the warm-up's {chosen.step_size:.3g} (stable for each "
            f"agent) cut {chosen.step_size / step:.3g}-fold on this {graph} of {n} agents (the Laplacian's "
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
            "whose data are alike, or a step_size of your own (at the cost of the bias these targets bound)"
            + ("" if unmet else ", or more num_samples")
        )

    def warmup_problems(self) -> list[str]:
        problems = super().warmup_problems()
        if self._step_report is not None and self.adaptation is not None:
            problems.append(self._step_report)
        return problems + self._decaying_problems()

    def _within_disagreement(self, chosen, step: float) -> tuple[float, int, tuple[bool, float, bool]]:
        r"""The step, shrunk until the agents' gradients at their own, disagreeing points drift the average
        by at most ``CONSENSUS_MEAN_TARGET`` posterior sds, the rounds of uploads it cost, and whether the
        target was met, the drift at the step returned and whether any step was cut for it.

        The quadratic model of :func:`~pyro_fed.algorithms.dula.consensus_analysis` is blind to it: the
        agents sit about :math:`\sqrt{2\alpha n}` posterior sds from their average (:func:`~pyro_fed.
        algorithms.dula.disagreement`), where a curved potential's gradients no longer average to the
        gradient at the average. Measured with the agents' real gradients at the typical points, with the
        disagreement drawn in antithetic pairs :math:`\pm e` (the linear term cancels exactly, leaving the
        curvature's), as the drift error :math:`\frac12 E[G(x + e) + G(x - e)] - \nabla U(x)`, :math:`G(z)
        = \sum_i \nabla U_i(z_i)`, averaged over the points, in the preconditioned coordinates (a mean
        shift in posterior sds). The step is halved until the drift is within the target, then bisected
        (geometrically) twice between the last step that missed it and the first that met it: the drift
        grows with the disagreement, which grows with the step until the graph's slow modes saturate."""
        missed, met, rounds, drifts = None, None, 0, {}
        for _ in range(DISAGREEMENT_CHECKS):
            rounds += 1  # the agents upload their gradients at all the draws together
            drifts[step] = self._disagreement_drift(chosen, step)
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

    def _disagreement_drift(self, chosen, step: float) -> float:
        """The largest drift of the average, in posterior sds, from the agents' disagreement at ``step``
        (see :meth:`_within_disagreement`)."""
        pot, root, points = (
            self.potential,
            adaptation.square_root(chosen.preconditioner),
            chosen.typical_points,
        )
        generator = torch.Generator().manual_seed(0)  # the same draws for every step tried: a smooth search
        draws = dula.disagreement(
            self.graph.laplacian, self._consensus_size(), step, pot.dim, DISAGREEMENT_PAIRS, generator
        )
        # the disagreement of all the agents (drawn alike wherever they are held), of which each process
        # evaluates its own agents' gradients: the sum over all of them is the same for any split
        offsets = adaptation.whiten(root, draws[:, self.network.held(self.network.num_clients)].to(points))
        agents = points[:, None, None, :] + torch.cat([offsets, -offsets])[None]  # [P, 2R, b, d]
        summed = self.network.sum(pot.full_client_grads(agents.reshape(-1, pot.num_clients, pot.dim)))
        drift = summed.reshape(len(points), -1, pot.dim).mean(1) - pot.total_gradient(points)
        return float(adaptation.whiten(root, drift.mean(0)).abs().max())

    def _decaying_problems(self) -> list[str]:
        """The decaying schedule's check: the relaxation times its shrinking steps covered."""
        problems = []
        if self.schedule != "decaying" or self.adaptation is None or self._iterations_needed is None:
            # a step of the user's, in the model's own units, has no known curvature to be measured against:
            # Stan's checks speak for it
            return problems
        # the relaxation times of the slowest direction that the sampling's steps covered (in the
        # preconditioned coordinates): about twice the number of independent draws they can give
        slowest = self.adaptation.slowest
        first = self._warmup_steps * self.current_thinning
        iterations = torch.arange(first, self._iterations_needed, dtype=torch.float64)
        factors = (self.step_offset + iterations + 1.0) ** -self.step_decay
        covered = float(self.current_step_size * slowest * factors.sum())
        if covered / 2 < convergence.ESS_PER_CHAIN:
            shrunk = float(factors[-1] * (self.step_offset + 1.0) ** self.step_decay)
            problems.append(
                f"D-ULA's decaying steps, down to {shrunk:.2g} times the first by the last iteration, "
                f"covered {covered:.3g} relaxation times of the slowest direction after warm-up: at most "
                f"about {covered / 2:.3g} independent draws per chain. The chains barely move; "
                'schedule="constant" (the default) keeps the step, a larger step_offset slows the decay'
            )
        return problems


class SgldKernel(DulaKernel):
    r"""Centralized Langevin — ULA with exact gradients, SGLD with ``batch_size`` — on the pooled data:

    .. math::

        x \leftarrow x - \alpha_k\, m \odot \hat\nabla U(x) + \sqrt{2 \alpha_k m} \odot Z, \qquad
        \alpha_k = a \ \text{(``schedule="constant"``, the default)}\ \text{ or }\ a / (k_0 + k + 1)^{\delta}.

    It is D-ULA with a single agent, and the reference (``b = 1``) of every federated kernel.

    **Reference:** Welling & Teh, *Bayesian learning via stochastic gradient Langevin dynamics*, ICML 2011.

    :param float step_size: :math:`a` (default: chosen from the curvature).
    :param str schedule: ``"constant"`` (default) or ``"decaying"``.
    :param float step_decay: :math:`\delta \in [0, 1)` (``"decaying"`` only; default 0.55).
    :param float step_offset: :math:`k_0` (``"decaying"`` only; default 0).
    """

    def __init__(self, model, **kwargs):
        if "clients" in kwargs or "graph" in kwargs:
            raise ValueError("SgldKernel is centralized: it takes no clients and no graph.")
        if "consensus_decay" in kwargs or "consensus_size" in kwargs:
            raise ValueError("SgldKernel has one agent: there is no consensus step to size or decay.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # D-ULA's step-size condition does not concern one agent
            super().__init__(model, 1, graph="complete", **kwargs)
