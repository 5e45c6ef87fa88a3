"""What crosses the network, and what it costs.

The algorithms never reduce across clients themselves: they ask a network object to average the clients'
uploads and to broadcast the result, and every cross-client quantity (the reported client average, the
dispersion) goes through it too. :class:`InProcessNetwork` simulates all clients in one process as a batched
tensor (the client dimension is the second to last, after any chain dimensions); a ``torch.distributed``
implementation with the same methods will run clients in separate processes.

The tensor operations run inside the compiled iterations, so they count nothing themselves: which messages
an iteration sends is decided by coins drawn on the host, and :meth:`InProcessNetwork.record` counts their
bits from those coins, exactly and without waiting for the device. A float on the wire costs 32 bits.
"""

from __future__ import annotations

import numpy as np
import torch

BITS_PER_FLOAT = 32


class InProcessNetwork:
    """All ``b`` clients of ``num_chains`` independent chains in one process; counts the bits a real network
    would carry, per chain.

    :param int num_clients: number of clients ``b``.
    :param int dim: number of floats in one message (the parameter dimension ``d``).
    :param int num_chains: number of independent chains simulated together.

    Counters, per chain (NumPy integer arrays, so that reading them never waits for the device):

    - ``uploaded_bits``: bits sent by clients to the server, summed over clients;
    - ``downloaded_bits``: bits received by clients from the server, summed over clients;
    - ``rounds``: number of communication rounds (FALD: averaging rounds of the iterates; QLSD: iterations
      with at least one active client).
    """

    def __init__(self, num_clients: int, dim: int, num_chains: int = 1):
        self.num_clients = num_clients
        self.dim = dim
        self.uploaded_bits = np.zeros(num_chains, dtype=np.int64)
        self.downloaded_bits = np.zeros(num_chains, dtype=np.int64)
        self.rounds = np.zeros(num_chains, dtype=np.int64)

    # ------------------------------------------------------------- tensors
    @staticmethod
    def average(uploads: torch.Tensor) -> torch.Tensor:
        """Every client uploads its row of ``uploads`` (``[..., b, d]``); the server's mean ``[..., d]``."""
        return uploads.mean(-2)

    @staticmethod
    def broadcast(value: torch.Tensor, num_clients: int) -> torch.Tensor:
        """The server sends ``value`` (``[..., d]``) to every client: the clients' copies ``[..., b, d]``."""
        return value.unsqueeze(-2).expand(*value.shape[:-1], num_clients, value.shape[-1])

    def average_where(self, communicate: torch.Tensor, clients: torch.Tensor) -> torch.Tensor:
        """Clients of the chains whose coin ``communicate`` (``[C]``, boolean) is set are replaced by their
        average; the others keep their iterates. A select, not a branch: the compiled iteration is the same
        whatever the coins."""
        averaged = self.broadcast(self.average(clients), clients.shape[-2])
        return torch.where(communicate[:, None, None], averaged, clients)

    def dispersion(self, clients: torch.Tensor) -> torch.Tensor:
        r""":math:`V = \frac1b \sum_i \|X^i - \bar X\|^2` per chain (a diagnostic of the simulation)."""
        return self.average((clients - self.average(clients).unsqueeze(-2)).square().sum(-1, keepdim=True))[
            ..., 0
        ]

    # ------------------------------------------------------------- accounting
    def averages_traffic(self, averaged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bits of ``averaged`` (``[K, C]``) rounds of averaging ``d`` floats: every client uploads its
        vector and downloads the average. ``(uploaded, downloaded)``, each ``[K, C]``."""
        bits = np.asarray(averaged, np.int64) * BITS_PER_FLOAT * self.dim * self.num_clients
        return bits, bits

    def record_averages(self, count: int, *, shared: bool = False) -> None:
        """Count ``count`` averages of ``d`` floats made outside the iterations (set-up work: a mode search,
        curvatures, a first refresh); they are not rounds of the iterates. Work done for each chain (its
        first refresh) is counted on every chain; ``shared`` work, done once for all of them (the warm-up's
        adaptation, a mode search), on the first chain only, so that the chains' counts add up to what the
        run sent."""
        chains = len(self.uploaded_bits)
        counts = np.zeros((1, chains), dtype=np.int64)
        counts[0, : 1 if shared else chains] = count
        self.record(*self.averages_traffic(counts), np.zeros((1, chains), dtype=bool))

    def record(
        self, uploaded: np.ndarray, downloaded: np.ndarray, rounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Count the messages of a chunk of iterations.

        :param uploaded: ``[K, C]`` bits each iteration of each chain uploaded (summed over clients).
        :param downloaded: ``[K, C]`` bits each iteration of each chain downloaded (summed over clients).
        :param rounds: ``[K, C]`` whether each iteration was a communication round.
        :returns: ``[K, C]`` cumulative uploaded bits, downloaded bits and rounds per chain after each
            iteration.
        """
        totals = []
        for name, counts in (
            ("uploaded_bits", uploaded),
            ("downloaded_bits", downloaded),
            ("rounds", rounds),
        ):
            cumulative = getattr(self, name) + np.cumsum(
                np.rint(np.asarray(counts, np.float64)).astype(np.int64), 0
            )
            if len(cumulative):
                setattr(self, name, cumulative[-1].copy())
            totals.append(cumulative)
        return tuple(totals)
