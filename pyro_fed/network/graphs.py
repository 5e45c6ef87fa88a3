r"""Graphs of clients for decentralized sampling: the communication layer when there is no server.

An undirected graph on ``n`` agents is given by its adjacency matrix :math:`A` (symmetric, non-negative
weights, no self-loops, connected); its Laplacian is :math:`L = \Delta - A` with :math:`\Delta` the diagonal
of the degrees. One round of neighbour exchange moves every agent's vector toward its neighbours',

.. math::

    w_i \leftarrow w_i - \beta \sum_j a_{ij} (w_i - w_j), \qquad\text{i.e.}\qquad
    w \leftarrow ((I - \beta L) \otimes I_d)\, w,

computed for all agents at once (simultaneously, not neighbour by neighbour), and costs ``d`` numbers sent
along every directed edge.

**Reference:** Gürbüzbalaban, Gao, Hu, Zhu, *Decentralized stochastic gradient Langevin dynamics and
Hamiltonian Monte Carlo*, JMLR 2021; Parayil, Bai, George, Gurram, *Decentralized Langevin dynamics for
Bayesian learning*, NeurIPS 2020.
"""

from __future__ import annotations

import functools

import torch

from .base import BITS_PER_FLOAT

GRAPHS = ("ring", "complete", "star", "path", "erdos_renyi")


class Graph:
    """A validated undirected graph of ``n`` agents.

    :param adjacency: ``[n, n]`` symmetric, non-negative, zero diagonal, connected.
    """

    def __init__(self, adjacency: torch.Tensor):
        adjacency = torch.as_tensor(adjacency, dtype=torch.float64).cpu()
        n = adjacency.shape[0] if adjacency.dim() == 2 else 0
        if adjacency.dim() != 2 or adjacency.shape[1] != n or n == 0:
            raise ValueError(
                f"the adjacency matrix must be square [n, n]; got shape {tuple(adjacency.shape)}."
            )
        if not torch.equal(adjacency, adjacency.T):
            raise ValueError("the adjacency matrix must be symmetric (the graph is undirected).")
        if bool((adjacency.diagonal() != 0).any()):
            raise ValueError("the adjacency matrix must have a zero diagonal (no self-loops).")
        if bool((adjacency < 0).any()) or not bool(adjacency.isfinite().all()):
            raise ValueError("the adjacency matrix must hold finite non-negative weights.")
        components = connected_components(adjacency)
        if len(components) > 1:
            raise ValueError(
                f"the graph is not connected: its components are {components}; D-ULA's agents could never "
                "agree. Add edges between the components."
            )
        self.adjacency = adjacency
        self.num_agents = n

    @property
    def laplacian(self) -> torch.Tensor:
        """:math:`L = \\Delta - A`, ``[n, n]``."""
        return torch.diag(self.adjacency.sum(1)) - self.adjacency

    # a graph is not changed once built: its spectrum is computed once, where a run reads it many times
    @functools.cached_property
    def eigenvalues(self) -> torch.Tensor:
        """The Laplacian's eigenvalues, ascending (``[n]``, float64)."""
        return torch.linalg.eigvalsh(self.laplacian)

    @functools.cached_property
    def eigenbasis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The Laplacian's eigenvalues, ascending, and its eigenvectors as columns (float64)."""
        return torch.linalg.eigh(self.laplacian)

    def contraction(self, consensus_size: float, exchanges: int = 1) -> torch.Tensor:
        r"""What ``exchanges`` rounds :math:`K` of mixing with the consensus step :math:`\beta` remove of the
        agents' disagreement along each of the Laplacian's eigenvectors (:attr:`eigenbasis`' order):
        :math:`1 - (1 - \beta\lambda)^K`, ``[n]`` (float64; :math:`\beta\lambda` for one round). The
        matrix :math:`I - (I - \beta L)^K` has these eigenvalues on the same eigenvectors."""
        scaled = consensus_size * self.eigenbasis[0]
        return scaled if exchanges == 1 else 1 - (1 - scaled) ** exchanges

    @property
    def lambda_max(self) -> float:
        """The largest eigenvalue of the Laplacian (0 for a single agent)."""
        return float(self.eigenvalues.max())

    @property
    def spectral_gap(self) -> float:
        """The Laplacian's second-smallest eigenvalue :math:`\\lambda_2` (its algebraic connectivity; 0 for a
        single agent): how fast the slowest disagreement between agents decays."""
        return float(self.eigenvalues[1]) if self.num_agents > 1 else 0.0

    @property
    def directed_edges(self) -> int:
        """Number of (agent, neighbour) pairs: the messages of one exchange."""
        return int((self.adjacency > 0).sum())

    def exchange_bits(self, dim: int) -> int:
        """Bits of one exchange: ``d`` floats along every directed edge."""
        return BITS_PER_FLOAT * dim * self.directed_edges


def connected_components(adjacency: torch.Tensor) -> list[list[int]]:
    """The connected components of a graph, each a sorted list of agents, by breadth-first search."""
    n, seen, components = adjacency.shape[0], set(), []
    neighbours = [set(torch.nonzero(adjacency[i] > 0).flatten().tolist()) for i in range(n)]
    for start in range(n):
        if start in seen:
            continue
        component, frontier = {start}, [start]
        while frontier:
            frontier = [j for i in frontier for j in neighbours[i] if j not in component]
            component.update(frontier)
        seen |= component
        components.append(sorted(component))
    return components


def make_graph(graph, num_agents: int, *, edge_prob: float = 0.5, seed: int = 0) -> Graph:
    r"""A :class:`Graph` from a name (``"ring"``, ``"complete"``, ``"star"``, ``"path"``, ``"erdos_renyi"``
    with ``edge_prob`` and ``seed``), an adjacency matrix, or a :class:`Graph`.

    Example: the D-ULA paper's five agents on a ring, the largest and smallest non-zero eigenvalues of its
    Laplacian (D-ULA's default consensus step is :math:`2 / (\lambda_2 + \lambda_{\max})`):

        >>> ring = make_graph("ring", 5)
        >>> round(ring.lambda_max, 3), round(ring.spectral_gap, 3), ring.directed_edges
        (3.618, 1.382, 10)
    """
    if isinstance(graph, Graph):
        if graph.num_agents != num_agents:
            raise ValueError(f"the graph has {graph.num_agents} agents but there are {num_agents} clients.")
        return graph
    if isinstance(graph, torch.Tensor):
        made = Graph(graph)
        return make_graph(made, num_agents)
    n = num_agents
    a = torch.zeros(n, n, dtype=torch.float64)
    index = torch.arange(n)
    if graph == "complete":
        a = 1.0 - torch.eye(n, dtype=torch.float64)
    elif graph == "ring" and n > 2:
        a[index, (index + 1) % n] = 1.0
        a[(index + 1) % n, index] = 1.0
    elif graph in ("path", "ring"):  # a ring of two agents is a path
        a[index[:-1], index[1:]] = 1.0
        a[index[1:], index[:-1]] = 1.0
    elif graph == "star":
        a[0, 1:] = 1.0
        a[1:, 0] = 1.0
    elif graph == "erdos_renyi":
        generator = torch.Generator().manual_seed(seed)
        upper = torch.triu(
            (torch.rand(n, n, generator=generator, dtype=torch.float64, device="cpu") < edge_prob).double(), 1
        )
        a = upper + upper.T
    else:
        raise ValueError(f"graph={graph!r}: use one of {GRAPHS}, an adjacency matrix [n, n] or a Graph.")
    return Graph(a)
