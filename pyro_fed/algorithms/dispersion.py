r"""The clients' mean :math:`\bar X` and dispersion :math:`V = \frac1b \sum_i \|X^i - \bar X\|^2` (FALD's draw
and ``dispersion``, D-ULA's draw and ``consensus_error``) from what each holder of clients computes alone.

Each holder summarises the clients it holds by their mean and their mean squared distance to it
(:func:`held_moments`, inside the iteration, without meeting); the holders' summaries are stacked by the
network (:meth:`~pyro_fed.network.base.Network.stacked`, once per chunk for all its iterations) and weighed
by the holders' client counts :math:`b_r` (:func:`mean_and_dispersion`), as Chan, Golub and LeVeque's
pairwise update of moments does:

.. math::

    \bar X = \sum_r \frac{b_r}{b} \bar X_r, \qquad
    V = \sum_r \frac{b_r}{b} \left(V_r + \|\bar X_r - \bar X\|^2\right).

With one holder (every client in one process) these are its own mean and dispersion.

**Reference:** Chan, Golub, LeVeque, *Algorithms for computing the sample variance: analysis and
recommendations*, The American Statistician 37(3), 1983.
"""

from __future__ import annotations

import torch

from ..network.base import Network


def held_moments(clients: torch.Tensor) -> torch.Tensor:
    """The mean of the clients held here and their mean squared distance to it, side by side: ``[..., b_h,
    d]`` -> ``[..., d + 1]``, the leading axes kept."""
    mean = clients.mean(-2)
    spread = (clients - mean.unsqueeze(-2)).square().sum(-1, keepdim=True).mean(-2)
    return torch.cat([mean, spread], -1)


def mean_and_dispersion(moments: torch.Tensor, network: Network) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Every client's mean :math:`\bar X` (``[..., d]``) and dispersion :math:`V` (``[...]``) from the
    :func:`held_moments` of the clients held here (``[..., d + 1]``: of one iteration, or of a chunk's
    iterations stacked), with one meeting of the holders."""
    stacked = network.stacked(moments)  # [W, ..., d + 1]
    if stacked.shape[0] == 1:
        return stacked[0, ..., :-1], stacked[0, ..., -1]
    sizes = [held.stop - held.start for held in network.holdings(network.num_clients)]
    shape = (-1, *[1] * (stacked.dim() - 1))
    weights = (torch.tensor(sizes, dtype=stacked.dtype) / network.num_clients).to(stacked.device).view(shape)
    means, spreads = stacked[..., :-1], stacked[..., -1:]
    mean = (weights * means).sum(0)
    between = (means - mean).square().sum(-1, keepdim=True)
    return mean, (weights * (spreads + between)).sum(0)[..., 0]


def dispersion(clients: torch.Tensor, network: Network) -> torch.Tensor:
    r""":math:`V = \frac1b \sum_i \|X^i - \bar X\|^2` per chain, the clients ``[..., b_h, d]`` held here
    given: how far all the clients are from their average."""
    return mean_and_dispersion(held_moments(clients), network)[1]
