r"""Evaluation metrics of the federated Bayesian sampling papers.

So far: the highest-posterior-density level used to compare samplers' accuracy (QLSD paper, Section 5).
Given draws :math:`\theta_1, \dots, \theta_K` of a posterior :math:`\pi \propto e^{-U}`, the HPD region of
level :math:`1 - \alpha` is :math:`\{\theta : U(\theta) \le \eta_\alpha\}` with :math:`\eta_\alpha` the
:math:`(1 - \alpha)` quantile of :math:`U(\theta)` under :math:`\pi`; its estimate is the empirical
quantile of :math:`U(\theta_k)`, and two samplers are compared by the relative error
:math:`|\eta_\alpha - \eta_\alpha^{ref}| / |\eta_\alpha^{ref}|`.

**Reference:** Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic dynamics
for Bayesian federated learning*, AISTATS 2022, Section 5.
"""

from __future__ import annotations

import torch

from .potential import FederatedPotential


def draw_potentials(potential: FederatedPotential, samples: dict[str, torch.Tensor]) -> torch.Tensor:
    r""":math:`U(\theta_k)` of every draw: the full-data potential, prior and Jacobian included, in the
    unconstrained space where the samplers run.

    :param potential: the model's :class:`~pyro_fed.FederatedPotential` (``kernel.potential`` after a run).
    :param samples: constrained draws ``{site: [K, ...]}``, as ``mcmc.get_samples()`` gives them.
    :returns: ``[K]``.
    """
    transforms = potential.transforms
    unconstrained = {name: transforms[name](value) for name, value in samples.items() if name in transforms}
    k = next(iter(unconstrained.values())).shape[0]
    flat = torch.cat([unconstrained[s.name].reshape(k, -1) for s in potential.latent_sites], -1)
    return potential.total_potentials(flat)


def hpd_level(potentials: torch.Tensor, alpha: float = 0.05) -> float:
    r""":math:`\eta_\alpha`: the empirical :math:`(1 - \alpha)` quantile of the draws' potentials ``[K]``."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); got {alpha!r}.")
    return float(torch.quantile(potentials.double(), 1 - alpha))


def relative_hpd_error(level: float, reference: float) -> float:
    r""":math:`|\eta_\alpha - \eta_\alpha^{ref}| / |\eta_\alpha^{ref}|`."""
    return abs(level - reference) / abs(reference)
