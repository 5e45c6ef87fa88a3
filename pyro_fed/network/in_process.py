"""All clients in one process: the simulation every kernel runs by default.

:class:`InProcessNetwork` holds every client as a row of one batched tensor (the client axis is the second
to last, after any chain dimensions), so each operation of :class:`~pyro_fed.network.base.Network` is one
tensor reduction over that axis; its accounting counts the bits a real network would carry.
"""

from __future__ import annotations

import torch

from .base import BITS_PER_FLOAT, Network

__all__ = ["BITS_PER_FLOAT", "InProcessNetwork"]


class InProcessNetwork(Network):
    """All ``b`` clients of ``num_chains`` independent chains in one process; counts the bits a real network
    would carry, per chain.

    :param int num_clients: number of clients ``b`` (else given by
        :meth:`~pyro_fed.network.base.Network.attach` at set-up).
    :param int dim: number of floats in one message (the parameter dimension ``d``).
    :param int num_chains: number of independent chains simulated together.
    """

    def __init__(self, num_clients: int | None = None, dim: int | None = None, num_chains: int = 1):
        if num_clients is not None:
            self.attach(num_clients, dim, num_chains)

    def sum(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return values.sum(dim)

    def average(self, uploads: torch.Tensor) -> torch.Tensor:
        return uploads.mean(-2)

    def maximum(self, values: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return values.amax(dim)

    def stacked(self, part: torch.Tensor) -> torch.Tensor:
        return part.unsqueeze(0)

    def everywhere(self, flags: torch.Tensor) -> torch.Tensor:
        return flags

    def held(self, num_clients: int) -> slice:
        return slice(0, num_clients)

    def gather(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return values

    def agree(self, flag: bool) -> bool:
        return bool(flag)

    def share(self, value):
        return value

    def neighbours(self, graph, agents: torch.Tensor) -> torch.Tensor:
        return agents  # every agent is held here

    def neighbour_agents(self, graph) -> torch.Tensor:
        return torch.arange(graph.num_agents, device="cpu")  # indexes the graph, which lives on the host
