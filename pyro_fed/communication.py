"""What crosses the network, and what it costs.

The algorithms never touch the clients' tensors across clients directly: they ask a network object to
average uploads and to broadcast results, and the network counts the bits. :class:`InProcessNetwork`
simulates all clients in one process as a batched tensor (the first dimension is the client); a
``torch.distributed`` implementation with the same methods will run clients in separate processes.

A float on the wire costs 32 bits (``ALGORITHMS.md`` §0).
"""

from __future__ import annotations

import torch

BITS_PER_FLOAT = 32


class InProcessNetwork:
    """All ``b`` clients in one process; counts the bits a real network would carry.

    :param int num_clients: number of clients ``b``.

    Counters (Python integers, so that reading them never waits for the device):

    - ``uploaded_bits``: bits sent by clients to the server, summed over clients;
    - ``broadcast_bits``: bits sent by the server (one broadcast reaches every client);
    - ``rounds``: number of averaging rounds.
    """

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.uploaded_bits = 0
        self.broadcast_bits = 0
        self.rounds = 0

    def average(self, uploads: torch.Tensor) -> torch.Tensor:
        """Every client uploads its row of ``uploads`` (``[b, d]``); the server returns their mean."""
        self.uploaded_bits += BITS_PER_FLOAT * uploads.numel()
        self.rounds += 1
        return uploads.mean(0)

    def broadcast(self, value: torch.Tensor) -> torch.Tensor:
        """The server sends ``value`` (``[d]``) to every client; returns the clients' copies ``[b, d]``."""
        self.broadcast_bits += BITS_PER_FLOAT * value.numel()
        return value.expand(self.num_clients, *value.shape)
