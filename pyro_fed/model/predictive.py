"""Per-draw evaluations of a model for ArviZ: pointwise log-likelihood, posterior predictive, deterministic
sites, observed data.

For ``M`` posterior draws :math:`\\theta^{(k)}` and the ``N`` data of the plate, these give the matrix
:math:`\\log p(y_j | \\theta^{(k)})` (``M × N``, per observed site) used by ``az.loo`` and ``az.waic``,
one replicate :math:`\\tilde y^{(k)} \\sim p(\\cdot | \\theta^{(k)})` of the plate's observed sites per
draw, and the observed values themselves. Draws are vectorised with :func:`torch.func.vmap`, in chunks.

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .sites import ModelSites


def _needs_own_randomness(error: Exception) -> bool:
    """Some samplers of ``torch.distributions`` (e.g. ``Normal.sample``) fill an unbatched tensor in place,
    which :func:`torch.func.vmap` cannot give independent randomness per draw."""
    return isinstance(error, RuntimeError) and "randomness" in str(error)


def map_draw_chunks(
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    values: dict[str, torch.Tensor],
    chunk_size: int,
    falls_back: Callable[[Exception], bool] = _needs_own_randomness,
    **vmap_kw,
) -> Iterator[dict[str, torch.Tensor]]:
    """``fn`` (one draw's values -> dict of tensors) over draws with a leading dimension, a chunk of
    ``chunk_size`` draws at a time: each chunk's outputs stacked, vectorised with :func:`torch.func.vmap`.
    From the first chunk whose vmap raises an error that ``falls_back`` accepts, the draws run one by one."""
    num_draws = next(iter(values.values())).shape[0]
    mapped = torch.func.vmap(fn, **vmap_kw)

    def one_by_one(chunk):
        outputs = [
            fn({k: v[i] for k, v in chunk.items()}) for i in range(next(iter(chunk.values())).shape[0])
        ]
        return {k: torch.stack([o[k] for o in outputs]) for k in outputs[0]}

    for start in range(0, num_draws, chunk_size):
        chunk = {k: v[start : start + chunk_size] for k, v in values.items()}
        try:
            yield mapped(chunk)
        except Exception as error:
            if mapped is one_by_one or not falls_back(error):
                raise
            mapped = one_by_one
            yield mapped(chunk)


def _map_draws(
    fn: Callable, values: dict[str, torch.Tensor], chunk_size: int | None, num_data: int, **vmap_kw
) -> dict[str, torch.Tensor]:
    """:func:`map_draw_chunks` over all draws (by default about ``2**22`` data evaluations per chunk), the
    outputs concatenated; draw by draw when a sampler needs its own randomness."""
    with torch.no_grad():
        chunks = list(map_draw_chunks(fn, values, chunk_size or max(1, 2**22 // max(num_data, 1)), **vmap_kw))
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


def deterministic_values(
    sites: ModelSites, values: dict[str, torch.Tensor], chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """The deterministic records outside the data plate at each draw: ``{site: [M, ...]}``
    (``ModelSites.deterministic_names``: ``pyro.deterministic`` sites, and the
    value a reparametrizer such as :class:`~pyro.infer.reparam.LocScaleReparam` computes in place of the
    site it replaced), the model run on one datum of the plate (they do not depend on its data)."""
    if not sites.deterministic_names:
        return {}
    # a model read by the rows of its data arguments computes them from its rows: all of them
    one_datum = _all_data(sites, values)[: None if sites.rows is not None else 1]

    def one_draw(draw):
        trace = sites.run(draw, one_datum)
        return {name: trace.nodes[name]["value"] for name in sites.deterministic_names}

    return _map_draws(one_draw, values, chunk_size, len(one_datum))


def observed_data(sites: ModelSites) -> dict[str, torch.Tensor]:
    """The observed values of the plate's sites, in data order."""
    # the initial run has the data plate at full size, without subsample: its data are in data order
    return {name: sites.initial_trace.nodes[name]["value"].detach() for name in sites.likelihood_sites}
