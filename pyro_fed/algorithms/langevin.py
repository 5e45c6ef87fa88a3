"""The Langevin step and the client noise shared by every sampler."""

from __future__ import annotations

import math

import torch

from ..engine.randomness import Randomness


def langevin_step(
    x: torch.Tensor, grad: torch.Tensor, step_size: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    r"""One unadjusted Langevin step :math:`x - h g + \sqrt{2h}\, Z`.

    :param x: current point(s), ``[..., d]``.
    :param grad: (estimate of) the potential's gradient at ``x``.
    :param step_size: :math:`h > 0`, a tensor (so that a compiled step does not depend on its value): a
        scalar :math:`\gamma`; per coordinate (``[d]``), :math:`h = \gamma m` for the step preconditioned by
        the diagonal inverse mass :math:`m`; or, for a dense inverse mass :math:`M`, ``[2, d, d]``: the step
        :math:`h = \gamma M` and its symmetric square root :math:`\sqrt\gamma R` (:math:`R R^\top = M`),
        for which the step reads :math:`x - h g + \sqrt 2\, \sqrt\gamma R Z` (one :math:`d \times d`
        product for the gradient; see :mod:`pyro_fed.algorithms.adaptation`).
    :param noise: standard Gaussian noise :math:`Z`, broadcastable to the shape of ``x``.
    """
    if step_size.dim() == 3:
        drift, root = step_size  # gamma M and its root, both symmetric
        return x - grad @ drift + math.sqrt(2.0) * (noise @ root)
    return x - step_size * grad + (2.0 * step_size).sqrt() * noise


def scale_step(step_size: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    r"""The step :math:`c h` of :func:`langevin_step` for a factor :math:`c > 0` (``factor``, a tensor; of a
    dense step ``[2, d, d]``, the root scales by :math:`\sqrt c`)."""
    if isinstance(step_size, torch.Tensor) and step_size.dim() == 3:
        return step_size * torch.stack([factor, factor.sqrt()]).view(2, 1, 1)
    return step_size * factor


def client_noise(
    rng: Randomness,
    leading: tuple[int, ...],
    num_clients: int,
    dim: int,
    noise_corr: float,
    dtype,
    held: slice | None = None,
) -> torch.Tensor:
    r"""Client noises :math:`Z^i = \sqrt{\tau/b}\,\tilde Z + \sqrt{1-\tau}\,\tilde Z^i`, shaped
    ``[*leading, b_h, d]`` for the ``b_h`` clients ``held`` of the run's ``b`` (all by default) — or
    ``[*leading, 1, d]`` when :math:`\tau = 1` (every client receives the same noise, broadcast by the step
    rather than copied).

    :math:`\tilde Z` is shared by all clients (a common seed) and :math:`\tilde Z^i` private (from the
    client's block of :class:`~pyro_fed.engine.randomness.Randomness`, wherever it is held), so the client
    average always receives noise of variance :math:`1/b` per coordinate, for every :math:`\tau \in [0, 1]`
    (the paper's synchronous coupling requires :math:`\sqrt{\tau/b}`). Only the draws that :math:`\tau`
    needs are made.

    **Reference:** Plassier et al., AISTATS 2023, eq. (6).
    """
    held = slice(0, num_clients) if held is None else held

    def private():
        return rng.client_normal(*leading, num_clients=num_clients, held=held, dim=dim, dtype=dtype)

    if noise_corr == 0.0:
        return private()
    shared = rng.normal(*leading, 1, dim, dtype=dtype) * math.sqrt(noise_corr / num_clients)
    if noise_corr == 1.0:
        return shared
    return shared + math.sqrt(1.0 - noise_corr) * private()
