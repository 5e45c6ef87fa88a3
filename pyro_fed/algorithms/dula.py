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
draw is :math:`\bar w`.

The agents disagree: each receives its own noise, and with heterogeneous data each is pulled toward its own
posterior. Their gradients, evaluated at their own points, then sum to something else than
:math:`\nabla U(\bar w)`: :func:`consensus_analysis` finds the constant step at which that costs the average
little, from each agent's curvature and gradient at the mode.

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

from .base import Algorithm
from .dispersion import held_moments, mean_and_dispersion
from .langevin import langevin_step, scale_step

#: the factor by which :func:`consensus_analysis` shrinks a step that misses its targets, and how many
#: times, at most
CONSENSUS_SHRINK, CONSENSUS_SHRINKS = 0.8, 60
#: graphs larger than this are not analysed by :func:`consensus_analysis` (its solves cost :math:`n^3`), nor
#: more coordinates than this
CONSENSUS_AGENTS, CONSENSUS_COORDINATES = 300, 64


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
    laplacian: torch.Tensor,
    consensus_size: float,
    *,
    variance_target: float,
    mean_target: float,
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
    :param laplacian: :math:`L`, ``[n, n]``.
    :param consensus_size: :math:`\beta`.
    """
    n = curvatures.shape[0]
    if n > CONSENSUS_AGENTS:
        return ConsensusAnalysis(step, True, math.nan, math.nan, -1)
    dtype = torch.float64
    c = curvatures.T.to(dtype).clamp_min(0)  # [d, n]
    g = gradients.T.to(dtype)
    # from the model's own mode, where the agents' gradients sum to zero (see above)
    g = g - c * g.sum(1, keepdim=True) / c.sum(1, keepdim=True).clamp_min(1e-300)
    # the coordinates where the agents differ most (identical agents cost nothing), at most
    # CONSENSUS_COORDINATES of them: each costs two n x n solves per step tried
    spread = (n * c - 1).square().sum(1) + g.square().sum(1)
    chosen = spread.argsort(descending=True)[:CONSENSUS_COORDINATES]
    c, g = c[chosen], g[chosen, :, None]
    mixing = consensus_size * laplacian.to(dtype)
    eye = torch.eye(n, dtype=dtype)
    ones = torch.ones(n, 1, dtype=dtype)
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
    laplacian: torch.Tensor,
    consensus_size: float,
    step: float,
    dim: int,
    num_draws: int,
    generator: torch.Generator,
) -> torch.Tensor:
    r"""``num_draws`` draws ``[R, n, d]`` of the agents' stationary disagreement :math:`e_i = w_i - \bar w`
    driven by their own noises, in the preconditioned coordinates where the posterior's scales are 1.

    Each agent steps :math:`\alpha n` on its share :math:`U_i \approx U / n` with noise :math:`\sqrt{2 \alpha
    n}\, z_i`, so in the graph's eigenbasis :math:`(\lambda_k, u_k)` the disagreement mode :math:`k \ge 2`
    follows :math:`\xi_k \leftarrow (1 - \beta \lambda_k - \alpha)\, \xi_k + \sqrt{2 \alpha n}\, z`: a
    Gaussian of variance :math:`2 \alpha n / (1 - \rho_k^2)`, :math:`\rho_k = 1 - \beta\lambda_k - \alpha`,
    and :math:`e = \sum_{k \ge 2} u_k \xi_k`. Each agent is about :math:`\sqrt{2 \alpha n}` posterior sds from
    the average even on a complete graph: its noise is the one the average needs, times :math:`\sqrt n`.
    """
    eigenvalues, vectors = torch.linalg.eigh(laplacian.to(torch.float64))
    rho = 1.0 - consensus_size * eigenvalues[1:] - step
    variance = 2 * step * len(eigenvalues) / (1 - rho.square()).clamp_min(1e-12)
    modes = torch.randn(num_draws, len(rho), dim, generator=generator, dtype=torch.float64)
    return vectors[:, 1:] @ (variance.sqrt()[:, None] * modes)


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
    """
    w = state.clients
    n = network.num_clients  # all the agents, wherever they are held
    # w_mix - alpha n g + sqrt(2 alpha n) v: the Langevin step of size alpha on n g, from the mixed point
    return DulaState(
        langevin_step(mix(w, rows, graph, network, beta), n * gradients(w), alpha, math.sqrt(n) * noise)
    )


@dataclass(kw_only=True)
class Dula(Algorithm):
    """D-ULA as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param graph: the agents' :class:`~pyro_fed.network.graphs.Graph`.
    :param float consensus_size: :math:`b`, the consensus step :math:`\\beta_0`.
    :param float step_decay: :math:`\\delta_2` (0: a constant step).
    :param float consensus_decay: :math:`\\delta_1` (0: a constant consensus step).
    :param float step_offset: :math:`k_0`.
    :param bool record_agents: record every agent's iterate per draw (statistic ``"agents"``).
    """

    graph: object
    consensus_size: float
    step_decay: float = 0.0
    consensus_decay: float = 0.0
    step_offset: float = 0.0
    record_agents: bool = False
    #: the held agents' rows of the Laplacian (:func:`laplacian_rows`), in the state's dtype and device
    laplacian_rows: torch.Tensor = field(init=False, repr=False)

    state_type = DulaState

    def __post_init__(self):
        self.laplacian_rows = laplacian_rows(self.network, self.graph).to(self.device, self.dtype)

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
        return step(state, gradients, noise, self.graph, self.laplacian_rows, alpha, beta, self.network)

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
        # d floats along every directed edge, counted as uploaded and as downloaded; every iteration is a
        # round, unless the graph has no edges (one agent)
        bits = np.ones_like(coins["iteration"]) * self.graph.exchange_bits(self.dim)
        return bits, bits, bits > 0
