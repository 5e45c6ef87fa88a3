"""The unconstrained space of the sampler: one flat vector for all global latent sites.

Langevin samplers move in :math:`\\mathbb{R}^d`. Each global latent site :math:`\\theta_s` with support
:math:`\\mathcal{S}_s` is mapped to an unconstrained value :math:`u_s = T_s^{-1}(\\theta_s)` by
:func:`torch.distributions.biject_to` (as Pyro's own MCMC does), and the values are concatenated into a
flat vector :math:`x \\in \\mathbb{R}^d`. The density of :math:`x` gains the log-det-Jacobian
:math:`\\sum_s \\log |\\det \\partial T_s(u_s) / \\partial u_s|`, which counts with the prior in
:math:`U^0`.

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from pyro.poutine.trace_struct import Trace
from torch.distributions import biject_to


class LatentSite(NamedTuple):
    """A global latent site: its slice of the flat unconstrained vector and its transform."""

    name: str
    start: int
    stop: int
    shape: torch.Size  # unconstrained shape
    transform: torch.distributions.Transform


class UnconstrainedSpace:
    """The flat unconstrained vector of the latent sites ``names`` of ``trace``, and back.

    :param trace: a trace of the model (shapes and supports are read from it).
    :param names: the global latent sites, in the order of the flat vector.
    """

    def __init__(self, trace: Trace, names: Sequence[str]):
        self.latent_sites: list[LatentSite] = []
        start = 0
        for name in names:
            site = trace.nodes[name]
            transform = biject_to(site["fn"].support)
            shape = torch.Size(transform.inv.forward_shape(site["value"].shape))
            stop = start + shape.numel()
            self.latent_sites.append(LatentSite(name, start, stop, shape, transform))
            start = stop
        self.dim = start

    def flat_values(self, trace: Trace) -> torch.Tensor:
        """The flat unconstrained vector of the latent values of ``trace``, ``[d]``."""
        return torch.cat(
            [s.transform.inv(trace.nodes[s.name]["value"].detach()).reshape(-1) for s in self.latent_sites]
        )

    def constrained(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Map a flat unconstrained vector to constrained site values and the log-det-Jacobian."""
        values, log_det = {}, flat.new_zeros(())
        for site in self.latent_sites:
            u = flat[site.start : site.stop].reshape(site.shape)
            value = site.transform(u)
            values[site.name] = value
            log_det = log_det + site.transform.log_abs_det_jacobian(u, value).sum()
        return values, log_det

    def unconstrained_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split flat unconstrained vectors ``[..., d]`` into Pyro's ``{site: unconstrained value}`` dict,
        each ``[..., *site.shape]``."""
        lead = flat.shape[:-1]
        return {s.name: flat[..., s.start : s.stop].reshape((*lead, *s.shape)) for s in self.latent_sites}

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`unconstrained_params`: ``[..., d]`` from values ``[..., *site.shape]``."""
        parts = []
        for site in self.latent_sites:
            value = params[site.name]
            batch_shape = value.shape[: value.dim() - len(site.shape)]
            parts.append(value.reshape(*batch_shape, -1))
        return torch.cat(parts, -1)

    @property
    def coordinate_names(self) -> list[str]:
        """A name for each coordinate of the flat vector: the site's, with its index in the site's
        unconstrained value when it has several (``"w[3]"``, ``"L[1, 0]"``)."""
        names = []
        for site in self.latent_sites:
            if not site.shape:
                names.append(site.name)
                continue
            for index in itertools.product(*(range(n) for n in site.shape)):
                names.append(f"{site.name}[{', '.join(map(str, index))}]")
        return names

    @property
    def transforms(self) -> dict[str, torch.distributions.Transform]:
        """Pyro's convention (as :func:`~pyro.infer.mcmc.util.initialize_model`): constrained ->
        unconstrained, so that ``MCMC`` maps draws back with ``transforms[name].inv``."""
        return {s.name: s.transform.inv for s in self.latent_sites}
