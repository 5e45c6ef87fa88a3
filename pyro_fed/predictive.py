"""Per-draw evaluations of a model for ArviZ: pointwise log-likelihood, posterior predictive, observed data.

For ``M`` posterior draws :math:`\\theta^{(k)}` and the ``N`` data of the plate, these give the matrix
:math:`\\log p(y_j | \\theta^{(k)})` (``M × N``, per observed site) used by ``az.loo`` and ``az.waic``,
one replicate :math:`\\tilde y^{(k)} \\sim p(\\cdot | \\theta^{(k)})` of the plate's observed sites per
draw, and the observed values themselves. Draws are vectorised with :func:`torch.func.vmap`, in chunks.

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sites import ModelSites


def _map_draws(
    fn: Callable, values: dict[str, torch.Tensor], chunk_size: int | None, num_data: int, **vmap_kw
) -> dict[str, torch.Tensor]:
    """Apply ``fn`` (one draw's constrained values -> dict of tensors) to draws with a leading dimension,
    vectorised over chunks of draws (by default about ``2**22`` data evaluations per chunk).

    Some samplers of ``torch.distributions`` (e.g. ``Normal.sample``) fill an unbatched tensor in place,
    which :func:`torch.func.vmap` cannot give independent randomness per draw: those chunks run draw by
    draw instead.
    """
    num_draws = next(iter(values.values())).shape[0]
    chunk_size = chunk_size or max(1, 2**22 // max(num_data, 1))
    mapped = torch.func.vmap(fn, **vmap_kw)

    def one_by_one(chunk):
        outputs = [
            fn({k: v[i] for k, v in chunk.items()}) for i in range(next(iter(chunk.values())).shape[0])
        ]
        return {k: torch.stack([o[k] for o in outputs]) for k in outputs[0]}

    chunks = []
    with torch.no_grad():
        for start in range(0, num_draws, chunk_size):
            chunk = {k: v[start : start + chunk_size] for k, v in values.items()}
            try:
                chunks.append(mapped(chunk))
            except RuntimeError as error:
                if "randomness" not in str(error):
                    raise
                mapped = one_by_one
                chunks.append(mapped(chunk))
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


def _all_data(sites: ModelSites, values: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.arange(sites.num_data, device=next(iter(values.values())).device)


def pointwise_log_likelihood(
    sites: ModelSites, values: dict[str, torch.Tensor], chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Pointwise log-likelihood of every observed site of the plate: ``{site: [M, *batch_shape]}`` (``[M,
    N]`` when the plate is the site's only batch dimension): the plain ``log_prob`` of the site's
    distribution, in the layout of its batch shape (a ``poutine.scale`` factor is left out, as in
    :func:`arviz.from_pyro`; masked entries give 0).

    :param values: constrained latent values with a leading dimension of ``M`` draws.
    :param int chunk_size: number of draws evaluated at once.
    """
    indices = _all_data(sites, values)

    def one_draw(draw):
        trace = sites.run(draw, indices)
        return {name: sites.pointwise_log_prob(trace, name) for name in sites.likelihood_sites}

    return _map_draws(one_draw, values, chunk_size, sites.num_data)


def posterior_predictive(
    sites: ModelSites, values: dict[str, torch.Tensor], chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """One replicate of every observed site of the plate per draw: ``{site: [M, N, ...]}``.

    Randomness comes from the global torch RNG, as in :class:`pyro.infer.Predictive`.
    """
    indices = _all_data(sites, values)

    def one_draw(draw):
        trace = sites.run(draw, indices, observed=False)
        return {name: trace.nodes[name]["value"] for name in sites.likelihood_sites}

    return _map_draws(one_draw, values, chunk_size, sites.num_data, randomness="different")


def observed_data(sites: ModelSites) -> dict[str, torch.Tensor]:
    """The observed values of the plate's sites, in data order."""
    # the initial run has the data plate at full size, without subsample: its data are in data order
    return {name: sites.initial_trace.nodes[name]["value"].detach() for name in sites.likelihood_sites}
