"""The bits the algorithms send, counted on the host from their coins: the formulas several share.

Each returns per-iteration counts ``[K, C]`` (summed over the clients): the bits uploaded, the bits
downloaded and, where it decides them, whether each iteration was a communication round. An algorithm's
:meth:`~pyro_fed.algorithms.base.Algorithm.traffic` applies its formula to its coins; the network only adds
them up (:meth:`~pyro_fed.network.base.Network.record`).
"""

from __future__ import annotations

import numpy as np

from ..network.base import BITS_PER_FLOAT


def averages(averaged: np.ndarray, num_clients: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``averaged`` (``[K, C]``) averages of ``d`` floats: each of the ``b`` clients uploads its vector
    and downloads the average (FALD's rounds, VR-FALD⋆'s refreshes). ``(uploaded, downloaded)``."""
    bits = np.asarray(averaged, np.int64) * BITS_PER_FLOAT * dim * num_clients
    return bits, bits


def server(
    active: np.ndarray, upload_bits: float, num_clients: int, dim: int, broadcasts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A server's iterations (QLSD, pSGLD): ``active`` (``[K, C]``) clients each upload a message of
    ``upload_bits`` and download the server's ``d`` floats; ``broadcasts`` (``[K, C]``) times the server
    sends them to all ``b`` clients (QLSD++'s snapshots). ``(uploaded, downloaded, rounds)``, a round being
    an iteration with an active client."""
    uploaded = active * upload_bits
    downloaded = active * BITS_PER_FLOAT * dim
    if broadcasts is not None:
        downloaded = downloaded + broadcasts * BITS_PER_FLOAT * dim * num_clients
    return uploaded, downloaded, active > 0
