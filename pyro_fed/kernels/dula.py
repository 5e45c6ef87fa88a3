"""D-ULA and centralized SGLD as Pyro MCMC kernels."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..algorithms import dula
from ..graphs import make_graph
from .arguments import check_positive
from .base import FederatedKernel

#: the ``sample_stats`` entry of the agents' iterates (``record_agents=True``), ``[draws, n, d]`` per chain
AGENTS = "agents"


class DulaKernel(FederatedKernel):
    r"""D-ULA: decentralized Langevin over a graph of clients (agents), with no server.

    .. math::

        w \leftarrow ((I - \beta_k L) \otimes I_d)\, w - \alpha_k\, n\, m \odot \hat g(w)
        + \sqrt{2 \alpha_k m} \odot v, \quad v_i \sim N(0, n I), \quad
        \alpha_k = \frac{a}{(k_0 + k + 1)^{\delta_2}}, \ \beta_k = \frac{b}{(k + 1)^{\delta_1}},

    (see :mod:`pyro_fed.algorithms.dula`; :math:`m` is the preconditioner). Each draw is the agents' average
    :math:`\bar w`; ``sample_stats`` records ``consensus_error`` :math:`\frac1n \sum_i \|w_i - \bar w\|^2` and
    the bits sent along the graph's edges (``d`` floats per directed edge and iteration, counted as uploaded
    and as downloaded).

    **Reference:** Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for Bayesian learning*,
    NeurIPS 2020.

    :param graph: ``"ring"`` (default), ``"complete"``, ``"star"``, ``"path"``, ``"erdos_renyi"``, an
        adjacency matrix ``[n, n]`` or a :class:`~pyro_fed.graphs.Graph` (validated: symmetric, no
        self-loops, connected).
    :param float step_size: :math:`a` (default: chosen from the curvature, as for the other kernels, so that
        the first step :math:`\alpha_0` is stable for every agent; the steps then decay from there, so a long
        run mixes ever more slowly: ``step_offset`` :math:`k_0` slows the decay).
    :param float step_decay: :math:`\delta_2` (default 0.55).
    :param float consensus_size: :math:`b` (default :math:`1/\lambda_{\max}(L)`).
    :param float consensus_decay: :math:`\delta_1` (default 0.04, as in the paper's Gaussian-mixture
        experiment: with the default :math:`\delta_2 = 0.55` it satisfies the condition below strictly).
    :param float step_offset: :math:`k_0` (default 0).
    :param bool record_agents: also keep every agent's iterate :math:`w_i` at each draw (``n d`` numbers per
        draw): :func:`~pyro_fed.to_inference_data` puts them, constrained, in an ``agents`` group with an
        ``agent`` dimension, for per-agent summaries and R-hat (default ``False``).

    The conditions of the convergence theory, :math:`1/2 + \delta_1 < \delta_2 < 1`, are checked with a
    warning (the paper's own experiments sit on the boundary). Prior weights default to ``"uniform"``
    (:math:`1/n` each). The other arguments are those of :class:`~pyro_fed.FederatedKernel`.
    """

    state_type = dula.DulaState

    def __init__(
        self,
        model,
        clients=None,
        *,
        graph="ring",
        step_decay: float = 0.55,
        consensus_size: float | None = None,
        consensus_decay: float = 0.04,
        step_offset: float = 0.0,
        record_agents: bool = False,
        prior_weights="uniform",
        **kwargs,
    ):
        super().__init__(model, clients, prior_weights=prior_weights, **kwargs)
        self.record_agents = bool(record_agents)
        self.graph_spec = graph
        for name, value in (("step_decay", step_decay), ("consensus_decay", consensus_decay)):
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1); got {value!r}.")
        if not 0.5 + consensus_decay < step_decay < 1 and step_decay > 0:
            warnings.warn(
                "D-ULA's convergence theory needs 1/2 + consensus_decay < step_decay < 1; got "
                f"consensus_decay={consensus_decay} and step_decay={step_decay}.",
                stacklevel=2,
            )
        self.step_decay, self.consensus_decay = float(step_decay), float(consensus_decay)
        self.consensus_size = (
            None if consensus_size is None else check_positive("consensus_size", consensus_size)
        )
        if not isinstance(step_offset, (int, float)) or step_offset < 0:
            raise ValueError(f"step_offset must be a non-negative number; got {step_offset!r}.")
        self.step_offset = float(step_offset)

    def init_state(self, positions):
        n = self.potential.num_clients
        self.graph = make_graph(self.graph_spec, n)
        self._consensus = self.consensus_size
        if self._consensus is None:
            self._consensus = 1.0 / self.graph.lambda_max if self.graph.lambda_max > 0 else 0.0
        return dula.init(positions, n)

    def draw_coins(self, num_iterations):
        iteration = self._computed + np.arange(num_iterations)
        return {"iteration": np.repeat(iteration[:, None], self.plan.num_chains, 1)}

    def coin_statistics(self, coins):
        return {}

    def step_inputs(self, num_iterations, coins):
        pot = self.potential
        noise = self.rng.normal(
            num_iterations, self.plan.num_chains, pot.num_clients, pot.dim, dtype=pot.dtype
        )
        return noise, torch.as_tensor(coins["iteration"][:, 0], dtype=pot.dtype, device=pot.device)

    def step(self, state, gradients, inputs, step_size):
        noise, iteration = inputs
        alpha, beta = dula.step_sizes(
            iteration,
            step_size,
            self._consensus,
            step_decay=self.step_decay,
            consensus_decay=self.consensus_decay,
            step_offset=self.step_offset,
        )
        return dula.step(state, gradients, noise, self.graph, alpha, beta)

    def position(self, state):
        return dula.position(state)

    def statistics(self, state):
        stats = {"consensus_error": self.network.dispersion(state.clients)}
        if self.record_agents:
            stats[AGENTS] = state.clients
        return stats

    def traffic(self, coins):
        bits = np.ones_like(coins["iteration"]) * self.graph.exchange_bits(self.potential.dim)
        # every iteration is a round of neighbour exchanges, unless there are no edges (SGLD's one agent)
        return bits, bits, bits > 0

    def chosen_step(self, client_step: float) -> float:
        """:math:`a` such that the first step :math:`\\alpha_0 = a / (k_0 + 1)^{\\delta_2}` is
        :math:`\\gamma / n`, from the adaptation's client step :math:`\\gamma` (each agent steps with
        :math:`\\alpha n` on its share)."""
        return client_step / self.potential.num_clients * (self.step_offset + 1.0) ** self.step_decay


class SgldKernel(DulaKernel):
    r"""Centralized Langevin — ULA with exact gradients, SGLD with ``batch_size`` — on the pooled data:

    .. math::

        x \leftarrow x - \alpha_k\, m \odot \hat\nabla U(x) + \sqrt{2 \alpha_k m} \odot Z, \qquad
        \alpha_k = a / (k_0 + k + 1)^{\delta},

    with a constant step by default (``step_decay=0``). It is D-ULA with a single agent, and the reference
    (``b = 1``) of every federated kernel.

    **Reference:** Welling & Teh, *Bayesian learning via stochastic gradient Langevin dynamics*, ICML 2011.

    :param float step_size: :math:`a` (default: chosen from the curvature).
    :param float step_decay: :math:`\delta \in [0, 1)` (default 0: constant step).
    :param float step_offset: :math:`k_0`.
    """

    def __init__(self, model, *, step_decay: float = 0.0, step_offset: float = 0.0, **kwargs):
        if "clients" in kwargs or "graph" in kwargs:
            raise ValueError("SgldKernel is centralized: it takes no clients and no graph.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # D-ULA's step-size condition does not concern one agent
            super().__init__(
                model, 1, graph="complete", step_decay=step_decay, step_offset=step_offset, **kwargs
            )
