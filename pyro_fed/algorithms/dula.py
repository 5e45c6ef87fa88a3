r"""D-ULA — decentralized unadjusted Langevin over a graph of agents, with no server.

Agent :math:`i` of :math:`n` holds :math:`w_i` and its potential :math:`U_i` (its data's negative
log-likelihood and a :math:`1/n` share of the prior). All agents update at once:

.. math::

    w \leftarrow ((I - \beta_k L) \otimes I_d)\, w - \alpha_k\, n\, g(w) + \sqrt{2 \alpha_k}\, v,
    \qquad v_i \sim N(0, n I_d),

with :math:`g_i(w) = \hat\nabla U_i(w_i)`, :math:`L` the graph's Laplacian (:mod:`pyro_fed.network.graphs`)
and steps :math:`\alpha_k`, :math:`\beta_k`: constant, or the paper's decaying ones
:math:`\alpha_k = a / (k_0 + k + 1)^{\delta_2}`, :math:`\beta_k = b / (k + 1)^{\delta_1}`. Since
:math:`\mathbf 1^\top L = 0`, the agents' average takes an exact Langevin step on :math:`U = \sum_i U_i`,
:math:`\bar w \leftarrow \bar w - \alpha_k \sum_i \nabla U_i(w_i) + \sqrt{2\alpha_k}\, \bar v` with
:math:`\bar v \sim N(0, I)`, evaluated at the agents' own points; the consensus step keeps them close. The
draw is :math:`\bar w`. With ``consensus_rounds`` :math:`K > 1` the agents exchange :math:`K` times before
each step, :math:`(I - \beta_k L)^K` in place of :math:`I - \beta_k L` (:math:`K` times the bits, no more
gradients; a departure from the paper, whose :math:`K` is 1): the disagreement along the Laplacian's
eigenvector of eigenvalue :math:`\lambda` is multiplied by :math:`(1 - \beta \lambda)^K` per step.

The agents disagree: each receives its own noise, and with heterogeneous data each is pulled toward its own
posterior. Their gradients, evaluated at their own points, then sum to something else than
:math:`\nabla U(\bar w)`: :mod:`pyro_fed.algorithms.dula_step` finds the constant step at which that costs the
average little.

Tensors carry a leading chain dimension ``C``; the noise and the iteration number are inputs of
:func:`step`, so that the decaying steps are computed inside a compiled chunk.

**Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
NeurIPS 2020 (the step sizes' condition :math:`1/2 + \delta_1 < \delta_2 < 1`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..network.graphs import Graph, make_graph
from .base import Algorithm
from .dispersion import held_moments, mean_and_dispersion
from .dula_step import finish_step
from .langevin import langevin_step, scale_step


class DulaState(NamedTuple):
    clients: torch.Tensor  #: the agents' iterates :math:`w_i`, ``[C, n, d]``


def init(positions: torch.Tensor, num_agents: int) -> DulaState:
    """Every agent of chain ``c`` starts at ``positions[c]`` (``[C, d]``)."""
    return DulaState(positions[:, None, :].expand(-1, num_agents, -1).clone())


def position(state: DulaState, network) -> torch.Tensor:
    """The reported draw: the agents' average :math:`\\bar w`, ``[C, d]``."""
    return network.average(state.clients)


def step_sizes(
    iteration: torch.Tensor, step_size, consensus_size, *, step_decay, consensus_decay, step_offset
):
    """:math:`(\\alpha_k, \\beta_k)` at iteration ``k`` (a tensor: computed inside a compiled chunk)."""
    alpha = scale_step(step_size, (step_offset + iteration + 1.0) ** -step_decay)
    beta = consensus_size / (iteration + 1.0) ** consensus_decay
    return alpha, beta


def laplacian_rows(network, graph) -> torch.Tensor:
    """The held agents' rows of the graph's Laplacian :math:`L`, on the columns of the agents that
    :meth:`~pyro_fed.network.base.Network.neighbours` brings (``[b_h, m]``, float64): computed once per run,
    since every mixing reads them."""
    return graph.laplacian[network.held(graph.num_agents)][:, network.neighbour_agents(graph)]


def mix(
    agents: torch.Tensor, rows: torch.Tensor, graph, network, consensus_size: torch.Tensor
) -> torch.Tensor:
    r"""One round of neighbour exchange: :math:`w_i - \beta \sum_j a_{ij} (w_i - w_j)` for the held agents
    ``[..., b_h, d]``, i.e. their rows of :math:`((I - \beta L) \otimes I_d)\, w`, all agents' old values
    read (a simultaneous update). The held agents' rows of :math:`L` (``rows``, :func:`laplacian_rows`) read
    only them and their neighbours, which the network brings
    (:meth:`~pyro_fed.network.base.Network.neighbours`)."""
    return agents - consensus_size * (rows.to(agents) @ network.neighbours(graph, agents))


def step(
    state: DulaState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    graph,
    rows: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    network,
    rounds: int = 1,
) -> DulaState:
    """One D-ULA iteration.

    :param gradients: maps the agents' points ``[C, n, d]`` to their gradient estimates.
    :param noise: standard Gaussian noise ``[C, n, d]`` (scaled here to :math:`N(0, n I)`).
    :param graph: a :class:`~pyro_fed.network.graphs.Graph`.
    :param rows: the held agents' rows of its Laplacian (:func:`laplacian_rows`).
    :param alpha: :math:`\\alpha_k`, a step of :func:`~pyro_fed.algorithms.langevin.langevin_step` (a
        scalar, per coordinate, or a dense preconditioned step with its root).
    :param beta: :math:`\\beta_k`.
    :param network: the :class:`~pyro_fed.network.base.Network` that exchanges the agents' iterates over
        ``graph``.
    :param int rounds: :math:`K`, the rounds of exchange before the step (:func:`mix` ``K`` times: the
        agents' iterates are multiplied by :math:`(I - \\beta L)^K`; the paper's is 1).
    """
    w = state.clients
    n = network.num_clients  # all the agents, wherever they are held
    mixed = w
    for _ in range(rounds):
        mixed = mix(mixed, rows, graph, network, beta)
    # w_mix - alpha n g + sqrt(2 alpha n) v: the Langevin step of size alpha on n g, from the mixed point,
    # the gradients at the agents' own points
    return DulaState(langevin_step(mixed, n * gradients(w), alpha, math.sqrt(n) * noise))


@dataclass(kw_only=True)
class Dula(Algorithm):
    """D-ULA as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param graph: the agents' graph: a :class:`~pyro_fed.network.graphs.Graph`, or what
        :func:`~pyro_fed.network.graphs.make_graph` builds one from (a name, an adjacency matrix), built for
        the run's agents (:meth:`resolve`).
    :param float consensus_size: :math:`b`, the consensus step :math:`\\beta_0` (``None``: the fastest
        contraction of the agents' disagreement, :math:`2 / (\\lambda_2 + \\lambda_{\\max})`
        (:meth:`consensus_for`), resolved for the run; one at least :math:`2 / \\lambda_{\\max}`, where the
        exchange expands the agents' disagreement, is refused).
    :param str schedule: ``"constant"`` or ``"decaying"`` (the paper's): the automatic constant step is cut
        for the agents' disagreement (:mod:`pyro_fed.algorithms.dula_step`), the decaying one is not.
    :param float step_decay: :math:`\\delta_2` (0: a constant step).
    :param float consensus_decay: :math:`\\delta_1` (0: a constant consensus step).
    :param float step_offset: :math:`k_0`.
    :param int consensus_rounds: :math:`K`, rounds of neighbour exchange per iteration (1: the paper's).
    :param bool record_agents: record every agent's iterate per draw (statistic ``"agents"``).
    """

    graph: object = "ring"
    consensus_size: float | None = None
    consensus_rounds: int = 1
    schedule: str = "constant"
    step_decay: float = 0.0
    consensus_decay: float = 0.0
    step_offset: float = 0.0
    record_agents: bool = False
    #: the held agents' rows of the Laplacian (:func:`laplacian_rows`), in the state's dtype and device
    laplacian_rows: torch.Tensor = field(init=False, repr=False)

    state_type = DulaState

    #: its last word cuts the automatic constant step for the agents' disagreement
    finishes_adaptation = True

    def __post_init__(self):
        if self.network is not None:
            self.laplacian_rows = laplacian_rows(self.network, self.graph).to(self.device, self.dtype)

    def agents_graph(self, num_agents: int) -> Graph:
        """The graph over ``num_agents`` agents (this one when it is built for them)."""
        return make_graph(self.graph, num_agents)

    def consensus_for(self, graph: Graph) -> float:
        r""":math:`b` on ``graph``: the given one, or the consensus step that contracts the agents'
        disagreement fastest, :math:`2 / (\lambda_2 + \lambda_{\max})` (0 for one agent).

        One exchange multiplies the disagreement along the Laplacian's eigenvector of eigenvalue
        :math:`\lambda` by :math:`1 - \beta \lambda`; the slowest of them, :math:`\max(|1 - \beta
        \lambda_2|, |1 - \beta \lambda_{\max}|)`, is smallest where the two are equal (Xiao & Boyd, *Fast
        linear iterations for distributed averaging*, Systems & Control Letters 2004: the best constant edge
        weight). On a complete graph it is :math:`1 / n`, which averages in one exchange; on a ring of 10
        agents it is 1.8 times the paper's :math:`1 / \lambda_{\max}`, which divides by as much the offsets
        that the agents' own data pull them to (:func:`~pyro_fed.algorithms.dula_step.data_pulls`), and
        allows a step about as many times larger."""
        if self.consensus_size is not None:
            beta, largest = self.consensus_size, graph.lambda_max
            if beta * largest >= 2 - 1e-9:  # at 2, the alternating disagreement never decays
                raise ValueError(
                    f"consensus_size={beta:g} makes the agents' exchange diverge on this graph of "
                    f"{graph.num_agents} agents: along the Laplacian's eigenvector of its largest eigenvalue "
                    f"({largest:.4g}) one exchange multiplies their disagreement by 1 - beta lambda = "
                    f"{1 - beta * largest:.3g}, which never contracts it. Pass a consensus_size below "
                    f"2 / lambda_max = {2 / largest:.4g} (the paper's is 1.01 / lambda_max), or leave it "
                    "out: the automatic one, 2 / (lambda_2 + lambda_max) = "
                    f"{2 / (graph.spectral_gap + largest):.4g}, contracts it fastest."
                )
            return self.consensus_size
        total = graph.spectral_gap + graph.lambda_max
        return 2.0 / total if total > 0 else 0.0

    def resolve(self, run):
        graph = self.agents_graph(run.network.num_clients)
        return {"graph": graph, "consensus_size": self.consensus_for(graph)}

    def chosen_step(self, client_step, run):
        """:math:`a` such that the first step :math:`\\alpha_0 = a / (k_0 + 1)^{\\delta_2}` is
        :math:`\\gamma / n`, from the adaptation's client step :math:`\\gamma` (each agent steps with
        :math:`\\alpha n` on its share)."""
        return client_step / run.network.num_clients * (self.step_offset + 1.0) ** self.step_decay

    def finish_adaptation(self, chosen, run):
        """With an automatic constant step, the largest at most the warm-up's at which the agents'
        disagreement costs the average little: :func:`~pyro_fed.algorithms.dula_step.finish_step`."""
        return finish_step(self, chosen, run)

    def init(self, positions):
        return init(positions, self.num_held)

    def coins(self, rng, first_iteration, num_iterations):
        # no coins: the iteration numbers, for the decaying steps
        iteration = first_iteration + np.arange(num_iterations)
        return {"iteration": np.repeat(iteration[:, None], self.num_chains, 1)}

    def coin_statistics(self, coins):
        return {}

    def inputs(self, rng, coins):
        iterations = coins["iteration"]
        noise = self.client_normal(rng, len(iterations), self.num_chains)
        return noise, torch.as_tensor(iterations[:, 0], dtype=self.dtype, device=self.device)

    def step(self, state, gradients, inputs, step_size):
        noise, iteration = inputs
        alpha, beta = step_sizes(
            iteration,
            step_size,
            self.consensus_size,
            step_decay=self.step_decay,
            consensus_decay=self.consensus_decay,
            step_offset=self.step_offset,
        )
        return step(
            state,
            gradients,
            noise,
            self.graph,
            self.laplacian_rows,
            alpha,
            beta,
            self.network,
            self.consensus_rounds,
        )

    def points(self, state):
        return state.clients

    def summary(self, state):
        held = {"moments": held_moments(state.clients)}
        if self.record_agents:
            held["agents"] = state.clients
        return held

    def report(self, summaries):
        mean, dispersion = mean_and_dispersion(summaries["moments"], self.network)
        stats = {"position": mean, "consensus_error": dispersion}
        if self.record_agents:
            stats["agents"] = summaries["agents"]
        return stats

    def traffic(self, coins):
        # d floats along every directed edge per exchange, counted as uploaded and as downloaded; every
        # iteration is a round, unless the graph has no edges (one agent)
        bits = np.ones_like(coins["iteration"]) * (self.consensus_rounds * self.graph.exchange_bits(self.dim))
        return bits, bits, bits > 0
