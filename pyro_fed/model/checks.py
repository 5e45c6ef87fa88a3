"""Set-up checks of a model's potential for what no run would notice: a gradient that does not follow the
potential (a parameter's value taken out of torch), and, where the clients are held in several processes, a
model that is not the same in all of them (a parameter or a prior made from the data a process holds). Each
either warns or raises in every process alike; none changes the potential.
"""

from __future__ import annotations

import math

import torch

from .. import messages

#: the latent sites whose gradient :func:`gradient_follows_potential` compares with the potential's
#: differences, at most
GRADIENT_CHECK_SITES = 16


def same_model_everywhere(pot) -> None:
    """Where the clients are held in several processes, each runs the model on the data it holds: a global
    latent site that the model sizes from them (a parameter per datum or per group of the data plate, as
    eight schools' effects from ``len(y)``) is then another parameter in each process, and the sum of
    their potentials a wrong posterior, without a word; so is a prior computed from them (a scale from
    ``y.std()``). Refused where the latent sites' shapes differ between the processes, or the prior's
    potential at two points; warned where they agree but a site has as many entries along a dimension as
    this process holds data points, fewer than the whole data's (a parameter sized from the data the
    processes hold in equal numbers, or a coincidence).

    :param pot: the :class:`~pyro_fed.model.potential.FederatedPotential` being built (its clients'
        gradients made)."""
    network = pot.network
    if not network.remote:
        return
    here = [[site.name, list(site.shape)] for site in pot.latent_sites]
    first, differs = network.compare_with_first(here)
    if differs:  # every process refuses, none left waiting for the others
        raise ValueError(
            f"The model's latent sites have other shapes in the processes holding the clients: {first} "
            f"in the first, {here} in this one. A latent site sized from the data a process holds (a "
            "parameter per datum or per group of the data plate, as eight schools' effects from "
            "len(y)) is another parameter in each process; size it from the whole data (pass the "
            "number of data points or groups to the model) and read it through the plate's indices."
        )
    # the prior (with the transforms' Jacobian) at two points of the unconstrained space
    points = torch.stack([torch.zeros(pot.dim), torch.full((pot.dim,), 0.5)])
    try:
        prior = pot.prior(points.to(pot.device, pot.dtype), gradient=False).double().cpu()
    except Exception:  # a model that cannot be run there: nothing to compare, but every process meets
        prior = torch.full((2,), math.nan, dtype=torch.float64)
    first, differs = network.compare_with_first(prior, _different_priors)
    if differs:
        raise ValueError(
            f"The model's prior differs between the processes holding the clients: its potential at the "
            f"same two points is {first.tolist()} in the first, {prior.tolist()} in this one. A prior "
            "computed from the data a process holds (a scale from y.std(), as rstanarm's autoscaled "
            "priors) is another prior in each process; compute it from the whole data and pass it to the "
            "model alike in every process."
        )
    total = int(pot.all_client_sizes.sum())
    sized = [site.name for site in pot.latent_sites if pot.num_data in site.shape]
    sized = sized if pot.num_data != total else []
    if sized:
        messages.warn(
            f"pyro_fed: latent site(s) {sized} have a dimension of {pot.num_data}, the data points this "
            f"process holds of {total} in all: if the model sizes them from its data (a parameter per "
            "datum or group of the data plate), each process samples another parameter and the posterior "
            "is wrong; size them from the whole data (pass the number of data points or groups to the "
            "model) and read them through the plate's indices.",
        )


def _different_priors(first: torch.Tensor, mine: torch.Tensor) -> bool:
    """Whether two processes' prior potentials at the same points differ beyond rounding (where both are
    finite: a model that cannot be run there compares nothing)."""
    compared = bool(mine.isfinite().all()) and bool(first.isfinite().all())
    return compared and not torch.allclose(first, mine, rtol=1e-5, atol=1e-6)


def gradient_follows_potential(pot, point: torch.Tensor) -> None:
    """Warn where the model's gradient disagrees with how its potential changes, along one random
    direction within each latent site, at ``point`` and half a unit away along those directions (a
    second point: where a site's derivative vanishes at one, it does not at the other): a model that
    takes a parameter's value out of torch (``float()``, ``.item()``, ``.tolist()``) computes with it as a
    constant, no gradient flows through it, and every gradient-based sampler (NUTS too) samples another
    posterior; the run goes on.

    Central differences at the steps :math:`h` and :math:`h / 2` (in the unconstrained coordinates):
    flagged only where the gradient misses the finer one by half its size or more, and by more than ten
    times the differences' own error (their change between the two steps, a kink crossed or the
    curvature's, and the potential's rounding), so that a smooth model is never flagged. The first
    ``GRADIENT_CHECK_SITES`` sites are checked (each costs eight evaluations of the potential).

    :param pot: a :class:`~pyro_fed.model.potential.FederatedPotential`.
    :param point: the first chain's initial point ``[d]`` (unconstrained)."""
    generator = torch.Generator().manual_seed(0)
    sites = pot.latent_sites[:GRADIENT_CHECK_SITES]
    directions = torch.zeros(len(sites), pot.dim, dtype=torch.float64)
    for row, site in zip(directions, sites, strict=True):
        block = torch.randn(site.stop - site.start, generator=generator, dtype=torch.float64)
        row[site.start : site.stop] = block / block.norm()
    directions = directions.to(point)
    centres = torch.stack([point, point + 0.5 * directions.sum(0)])  # [2, d]
    gradients = pot.total_gradient(centres)
    h = 1e-2 if point.dtype == torch.float32 else 1e-4
    steps = torch.tensor([h, -h, h / 2, -h / 2], dtype=point.dtype, device=point.device)
    points = centres[:, None, None] + steps[:, None, None] * directions  # [2, 4, S, d]
    values = pot.total_potentials(points.reshape(-1, pot.dim)).reshape(2, 4, -1).double()
    coarse, fine = (values[:, 0] - values[:, 1]) / (2 * h), (values[:, 2] - values[:, 3]) / h
    slope = gradients.double() @ directions.double().T  # [2, S]
    rounding = 100 * torch.finfo(point.dtype).eps * values.abs().amax(1) / h
    error = (coarse - fine).abs() + rounding
    missed = (slope - fine).abs()
    flagged = (
        (missed > 0.5 * fine.abs().maximum(slope.abs()))
        & (missed > 10 * error)
        & values.isfinite().all(1)
        & gradients.isfinite().all(1, keepdim=True)
    )
    worst = missed.argmax(0)  # the point where each site's gradient misses most
    if bool(flagged.any()):
        shown = "; ".join(
            f"{site.name}: {float(fine[worst[k], k]):.4g} by differences, "
            f"{float(slope[worst[k], k]):.4g} by the gradient"
            for k, site in enumerate(sites)
            if flagged[:, k].any()
        )
        messages.warn(
            "pyro_fed: the model's gradient disagrees with how its potential changes near the initial "
            f"point, along a direction within each of these sites ({shown}). A model that takes a "
            "parameter's value out of torch (float(), .item(), .tolist(), NumPy) computes with it as a "
            "constant, no gradient flows through it, and the draws (NUTS's too) are of another "
            "posterior: write those steps with torch operations.",
        )
