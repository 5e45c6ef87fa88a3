"""The Langevin step and the client noise shared by every sampler."""

from __future__ import annotations

import math

import torch

from .rng import Randomness


def langevin_step(x: torch.Tensor, grad: torch.Tensor, step_size: float, noise: torch.Tensor) -> torch.Tensor:
    r"""One unadjusted Langevin step :math:`x - \gamma g + \sqrt{2\gamma}\, Z`.

    :param x: current point(s).
    :param grad: (estimate of) the potential's gradient at ``x``.
    :param float step_size: :math:`\gamma > 0`.
    :param noise: standard Gaussian noise :math:`Z` of the shape of ``x``.
    """
    return x - step_size * grad + math.sqrt(2.0 * step_size) * noise


def correlated_client_noise(
    rng: Randomness, num_clients: int, dim: int, noise_corr: float, dtype: torch.dtype
) -> torch.Tensor:
    r"""Client noises :math:`Z^i = \sqrt{\tau/b}\,\tilde Z + \sqrt{1-\tau}\,\tilde Z^i`, ``[b, d]``.

    :math:`\tilde Z` is shared by all clients (a common seed) and :math:`\tilde Z^i` private, so the client
    average always receives noise of variance :math:`1/b` per coordinate, for every :math:`\tau \in [0, 1]`
    (``ALGORITHMS.md`` §1: the paper's synchronous coupling requires :math:`\sqrt{\tau/b}`).

    **Reference:** Plassier et al., AISTATS 2023, eq. (6).
    """
    noise = rng.normal(num_clients, dim, dtype=dtype)
    if noise_corr == 0.0:
        return noise
    shared = rng.normal(1, dim, dtype=dtype)
    return math.sqrt(noise_corr / num_clients) * shared + math.sqrt(1.0 - noise_corr) * noise
