"""D-ULA and centralized SGLD as Pyro MCMC kernels."""

from __future__ import annotations

import warnings

import torch

from .. import messages
from ..algorithms import convergence, dula
from .arguments import check_positive, check_positive_int
from .base import FederatedKernel


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
    disagreement costs the average little (:mod:`pyro_fed.algorithms.dula_step`): in a diagonal quadratic
    model of the agents at the mode (their curvatures and gradients there, the graph's Laplacian), the
    average's stationary variance within 10% of the posterior's and its mean within a tenth of a posterior
    standard deviation in every coordinate; and, with the agents' real gradients at the warm-up's typical
    points, the drift of the average within a tenth of a posterior sd, where each agent sits where its own
    noise and its data put it (an agent pulled toward its own fit sees smaller residuals, and a noise scale
    shrinks). Identical agents cost nothing (their disagreement cancels in the average); heterogeneous ones on
    a slowly mixing graph (a long ring) cost a smaller step. The decaying schedule makes a long run mix ever
    more slowly; the end of the run says so when its steps covered too few relaxation times for its draws to
    be independent.

    **Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
    NeurIPS 2020.

    :param graph: ``"ring"`` (default), ``"complete"``, ``"star"``, ``"path"``, ``"erdos_renyi"``, an
        adjacency matrix ``[n, n]`` or a :class:`~pyro_fed.network.graphs.Graph` (validated: symmetric, no
        self-loops, connected).
    :param float step_size: :math:`a` (default: chosen, see above; with ``"decaying"`` the first step
        :math:`\alpha_0` is the warm-up's).
    :param str schedule: ``"constant"`` (default) or ``"decaying"`` (the paper's).
    :param float step_decay: :math:`\delta_2` (``"decaying"`` only; default 0.55).
    :param float consensus_size: :math:`b` (default :math:`2 / (\lambda_2 + \lambda_{\max})`, with
        :math:`\lambda_2` and :math:`\lambda_{\max}` the Laplacian's smallest non-zero and largest
        eigenvalues: the step that contracts the agents' disagreement fastest, :math:`1 / n` on a complete
        graph; the paper's experiments use :math:`1.01 / \lambda_{\max}`). One of at least :math:`2 /
        \lambda_{\max}`, at which the exchange expands the agents' disagreement, is refused.
    :param int consensus_rounds: :math:`K`, rounds of neighbour exchange per iteration (default 1, the
        paper's): the agents mix by :math:`(I - \beta_k L)^K` before each step, at :math:`K` times the bits
        and no more gradients. On a slowly mixing graph (a ring) their disagreement then decays :math:`K`
        times as fast per step, and the automatic step, cut for that disagreement, grows; a complete graph
        averages in one exchange already.
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
        consensus_rounds: int = 1,
        consensus_decay: float | None = None,
        step_offset: float | None = None,
        record_agents: bool = False,
        prior_weights="uniform",
        **kwargs,
    ):
        self.record_agents = bool(record_agents)
        self.graph_spec = graph
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
            messages.warn(
                "D-ULA's convergence theory needs 1/2 + consensus_decay < step_decay < 1; got "
                f"consensus_decay={consensus_decay} and step_decay={step_decay}.",
            )
        if schedule == "constant":
            step_decay = consensus_decay = 0.0
        self.step_decay, self.consensus_decay = float(step_decay), float(consensus_decay)
        self.consensus_size = (
            None if consensus_size is None else check_positive("consensus_size", consensus_size)
        )
        self.consensus_rounds = check_positive_int("consensus_rounds", consensus_rounds)
        if not isinstance(step_offset, (int, float)) or step_offset < 0:
            raise ValueError(f"step_offset must be a non-negative number; got {step_offset!r}.")
        self.step_offset = float(step_offset)
        algorithm = dula.Dula(
            graph=graph,
            consensus_size=self.consensus_size,
            consensus_rounds=self.consensus_rounds,
            schedule=schedule,
            step_decay=self.step_decay,
            consensus_decay=self.consensus_decay,
            step_offset=self.step_offset,
            record_agents=self.record_agents,
        )
        super().__init__(model, clients, algorithm=algorithm, prior_weights=prior_weights, **kwargs)

    @property
    def graph(self):
        """The agents' :class:`~pyro_fed.network.graphs.Graph` of the current run (``None`` before set-up)."""
        return None if self.algorithm is None else self.algorithm.graph

    def warmup_problems(self) -> list[str]:
        return super().warmup_problems() + self._decaying_problems()

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
        if any(name in kwargs for name in ("consensus_decay", "consensus_size", "consensus_rounds")):
            raise ValueError("SgldKernel has one agent: there is no consensus step to size or decay.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # D-ULA's step-size condition does not concern one agent
            super().__init__(model, 1, graph="complete", **kwargs)
