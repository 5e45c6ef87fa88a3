"""ArviZ output: the draws of a federated MCMC run, with the statistics of the federated algorithm.

Works with ArviZ 0.x (returns :class:`arviz.InferenceData`) and ArviZ 1.x (returns the
:class:`xarray.DataTree` built by ``arviz.from_dict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from .. import messages
from ..kernels.base import FederatedKernel
from ..model.potential import FederatedPotential

if TYPE_CHECKING:
    import xarray as xr


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def _by_chain(values: dict[str, torch.Tensor], num_chains: int) -> dict[str, np.ndarray]:
    return {k: v.reshape(num_chains, -1, *v.shape[1:]) for k, v in _numpy(values).items()}


#: how to call :func:`to_inference_data`, said when it is given something else
_USAGE = (
    "to_inference_data takes the pyro.infer.MCMC object that ran the kernel (mcmc = MCMC(kernel, ...); "
    "mcmc.run(...); to_inference_data(mcmc))"
)

#: the fewest draws per chain of split R-hat and of the ESS (Pyro's and ArviZ's)
MIN_DIAGNOSED_DRAWS = 4


def _check_run(mcmc) -> None:
    """``mcmc`` is a :class:`~pyro.infer.MCMC` object after ``run``: anything else is refused saying what to
    pass."""
    if isinstance(mcmc, (FederatedKernel, MCMCKernel)):
        raise TypeError(f"{_USAGE}; got the kernel itself, {_a(type(mcmc).__name__)}.")
    if not isinstance(mcmc, MCMC):
        raise TypeError(f"{_USAGE}; got {_describe(mcmc)}.")
    if getattr(mcmc, "_samples", None) is None:
        raise ValueError(
            f"This MCMC object (kernel {type(mcmc.kernel).__name__}) has not run: call "
            "mcmc.run(*model_args) first, then to_inference_data(mcmc)."
        )


def _a(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _describe(value) -> str:
    """A short description of a wrong argument: its type, and what to do with the usual mistakes."""
    name = type(value).__name__
    if isinstance(value, dict):
        return "a dict (draws by site? arviz.from_dict converts those)"
    if callable(value) and not isinstance(value, type):
        called = getattr(value, "__name__", value)
        return f"{_a(name)}, {called!r} (the model? build a kernel and an MCMC from it)"
    if "InferenceData" in name or "DataTree" in name:
        return f"{_a(name)}, which is already ArviZ data"
    return _a(name)


def _potential(mcmc) -> FederatedPotential:
    kernel = mcmc.kernel
    if isinstance(kernel, FederatedKernel):
        if kernel.potential is None:
            raise ValueError("to_inference_data needs an MCMC object after mcmc.run(...).")
        return kernel.potential
    if getattr(kernel, "model", None) is None or not hasattr(mcmc, "_args"):
        raise TypeError(
            "to_inference_data needs an MCMC run of a pyro_fed kernel, or of a Pyro kernel built from a "
            f"model (NUTS(model), HMC(model)); got {type(kernel).__name__} without a model. Use "
            "arviz.from_pyro."
        )
    # a Pyro kernel on the pooled data (the usual reference): the model split into one client, with the
    # model's arguments read where arviz.from_pyro reads them
    return FederatedPotential(kernel.model, mcmc._args, mcmc._kwargs, clients=1, gradient_mode="eager")


def _is_factor(potential: FederatedPotential, name: str) -> bool:
    """Whether the likelihood site ``name`` is a ``pyro.factor``: a log-density term with no value to
    draw."""
    return isinstance(potential.sites.initial_trace.nodes[name]["fn"], dist.Unit)


def _client_group(potential: FederatedPotential, flat: np.ndarray, client_dim: str) -> xr.Dataset:
    """The clients' unconstrained iterates ``[C, D, n, d]``, constrained: one variable per site, with dims
    ``chain, draw, client_dim`` and ArviZ's default names for the site's own."""
    import xarray as xr

    unconstrained = potential.unconstrained_params(torch.as_tensor(flat, device=potential.device))
    variables = {}
    for site in potential.latent_sites:
        dims = ("chain", "draw", client_dim, *(f"{site.name}_dim_{i}" for i in range(len(site.shape))))
        variables[site.name] = (
            dims,
            potential.transforms[site.name].inv(unconstrained[site.name]).cpu().numpy(),
        )
    return xr.Dataset(variables)


def _chain_diagnostics(mcmc, num_chains: int) -> list[dict]:
    """Each chain's diagnostics as its kernel gave them (``mcmc.diagnostics()`` without the R-hat and ESS
    it adds, which need :data:`MIN_DIAGNOSED_DRAWS` draws per chain)."""
    per_chain = getattr(mcmc, "_diagnostics", None)
    if (
        isinstance(per_chain, list)
        and len(per_chain) == num_chains
        and all(isinstance(d, dict) for d in per_chain)
    ):
        return per_chain
    diagnostics = mcmc.diagnostics()
    return [
        {k: v[f"chain {c}"] for k, v in diagnostics.items() if isinstance(v, dict) and f"chain {c}" in v}
        for c in range(num_chains)
    ]


def _sample_stats(mcmc, num_chains: int, num_draws: int) -> dict[str, np.ndarray]:
    """Per-draw statistics: a pyro_fed kernel's own (see :func:`to_inference_data`); for Pyro's kernels,
    ``diverging`` from the divergent draws that each chain's diagnostics list."""
    if isinstance(mcmc.kernel, FederatedKernel):
        stats = [mcmc.kernel.sample_stats(chain) for chain in range(num_chains)]
        return {k: np.stack([s[k] for s in stats]) for k in stats[0]}
    diagnostics = _chain_diagnostics(mcmc, num_chains)
    diverging = np.zeros((num_chains, num_draws), dtype=bool)
    for c in range(num_chains):
        diverging[c, diagnostics[c].get("divergences", [])] = True
    return {"diverging": diverging}


def to_inference_data(
    mcmc,
    *,
    log_likelihood: bool = True,
    posterior_predictive: bool = False,
    chunk_size: int | None = None,
    coords: dict | None = None,
    dims: dict | None = None,
):
    """Convert a finished :class:`~pyro.infer.MCMC` run of a pyro_fed kernel to ArviZ data.

    A run of Pyro's own ``NUTS(model)`` or ``HMC(model)`` on the pooled data converts too, with the same
    groups (its ``sample_stats`` hold ``diverging``): the reference for a federated run, comparable with
    ``az.compare``. (:func:`arviz.from_pyro` computes the log-likelihood by running the model vectorised over
    the draws, which a model that reads its data through ``pyro.subsample``, or multiplies a batched weight
    as ``x @ w``, cannot do: it leaves the group out.)

    Groups:

    - ``posterior``: the constrained draws of every global latent site, and the values at each draw of the
      model's deterministic sites outside the data plate: ``pyro.deterministic``, and the sites a
      reparametrizer replaced (``a`` beside the sampled ``a_decentered`` of
      :class:`~pyro.infer.reparam.LocScaleReparam`), as NumPyro gives them (Pyro's own ``get_samples``
      leaves them to :class:`~pyro.infer.Predictive`);
    - ``sample_stats``: per draw, ``diverging`` (non-finite or exploded step, reverted), ``uploaded_bits``
      and ``downloaded_bits`` (cumulative bits sent and received by clients, summed over clients, counted
      from the start of warm-up) and the algorithm's own statistics (FALD: ``communicated``, whether the
      server averaged, and ``dispersion`` :math:`V_k = \\frac1b \\sum_i \\|X^i_k - \\bar X_k\\|^2`;
      VR-FALD⋆ also ``refreshed``; QLSD ``active_clients`` and ``snapshot``; D-ULA ``consensus_error``);
    - ``log_likelihood``: pointwise, ``chain × draw ×`` the observed site's batch shape (``× N`` for one
      datum per plate entry), the plain ``log_prob`` as :func:`arviz.from_pyro` gives it, for
      ``az.loo``/``az.waic``; the data an ``obs_mask`` marks missing are left out of this group, of
      ``observed_data`` and of ``posterior_predictive``, and the others are indexed by their position in
      the data (a dimension ``{site}_{plate}``); a ``pyro.factor`` in the plate gives its value (a true
      pointwise log-likelihood for LOO when the factor is a normalised log-density);
    - ``observed_data``: the observed sites of the plate (left out where clients are held in other
      processes, as are the two groups of the data points: each process has only its own data), factors
      left out;
    - ``posterior_predictive`` (when asked): one replicate of the observed sites per draw (a factor has no
      value to draw: left out with a warning; a likelihood of factors only is refused);
    - ``agents`` (D-ULA with ``record_agents=True``): every agent's iterate at each draw, constrained,
      ``chain × draw × agent ×`` the site's shape.

    A run of fewer than 4 draws per chain converts with a warning: split R-hat and the ESS need 4 per chain
    (:func:`arviz.summary` gives NaN for them).

    :param mcmc: a :class:`~pyro.infer.MCMC` object after ``run``, whose kernel is a pyro_fed kernel, or
        Pyro's ``NUTS``/``HMC`` built from a model (the kernel itself, or an MCMC object not run, is
        refused saying what to pass).
    :param bool log_likelihood: include the pointwise log-likelihood.
    :param bool posterior_predictive: draw and include posterior predictive replicates.
    :param int chunk_size: number of draws evaluated at once (memory: ``chunk_size × N``).
    :param dict coords: extra ArviZ coordinates.
    :param dict dims: extra ArviZ dimensions per variable (the plate's axis of each observed site gets the
        plate's name, wherever the plate sits among the site's dimensions).
    :returns: :class:`arviz.InferenceData` (ArviZ 0.x) or :class:`xarray.DataTree` (ArviZ 1.x).
    """
    _check_run(mcmc)
    potential = _potential(mcmc)
    # with clients held in other processes, this one has only its own clients' data
    elsewhere = len(potential.all_client_sizes) - potential.num_clients
    if elsewhere and (log_likelihood or posterior_predictive):
        raise ValueError(
            f"{elsewhere} of the run's {len(potential.all_client_sizes)} clients are held in other "
            "processes: the pointwise log-likelihood and the posterior predictive here would cover only this "
            "process's data. Pass log_likelihood=False (and no posterior_predictive): the posterior and the "
            "sample_stats are the whole run's, the same in every process."
        )
    # a pyro.factor has a log-density (its value, in log_likelihood) but no value to observe or to draw
    factors = [name for name in potential.likelihood_sites if _is_factor(potential, name)]
    if posterior_predictive and len(factors) == len(potential.likelihood_sites):
        raise ValueError(
            f"posterior_predictive=True needs observed sample sites in the plate {potential.plate!r}, but "
            f"its likelihood is pyro.factor only ({', '.join(map(repr, factors))}): a factor is a "
            "log-density with no value to draw. Pass posterior_predictive=False (log_likelihood holds the "
            "factors' values), or write the likelihood as pyro.sample(..., obs=...)."
        )
    samples = mcmc.get_samples(group_by_chain=True)
    num_chains, num_draws = next(iter(samples.values())).shape[:2]
    if num_draws < MIN_DIAGNOSED_DRAWS:
        messages.warn(
            f"The run has {num_draws} draw{'s' if num_draws != 1 else ''} per chain: converted, but split "
            f"R-hat and the ESS need at least {MIN_DIAGNOSED_DRAWS} per chain (arviz.summary gives NaN for "
            "them, Pyro's mcmc.summary() fails). Run more draws (num_samples) to diagnose the chains.",
        )
    flat_draws = {k: v.reshape(-1, *v.shape[2:]) for k, v in samples.items()}
    deterministic = _by_chain(potential.deterministic_values(flat_draws, chunk_size), num_chains)
    groups = {
        "posterior": {**_numpy(samples), **deterministic},
        "sample_stats": _sample_stats(mcmc, num_chains, num_draws),
    }
    # statistics holding every client's iterate (D-ULA's record_agents): a group of their own
    iterates = getattr(mcmc.kernel, "client_iterates", {})
    clients = {name: groups["sample_stats"].pop(name) for name in iterates if name in groups["sample_stats"]}
    if log_likelihood:
        groups["log_likelihood"] = _by_chain(
            potential.pointwise_log_likelihood(flat_draws, chunk_size), num_chains
        )
    if not elsewhere:
        groups["observed_data"] = {
            k: v for k, v in _numpy(potential.observed_data()).items() if k not in factors
        }
    if posterior_predictive:
        groups["posterior_predictive"] = _posterior_predictive(
            potential, flat_draws, chunk_size, num_chains, factors
        )
    # the plate's axis in each observed site (not always the leftmost); axes before it get ArviZ-style names
    data_dims, coords = {}, dict(coords or {})
    for name in potential.likelihood_sites:
        axis = potential.sites.plate_axis(name)
        if axis is None:
            continue
        plate = potential.plate
        mask = potential.sites.observed_mask(name)
        if mask is not None:
            # masked data (obs_mask) are not observations: left out of every group, the others keep their
            # positions in the data as the coordinate of their own dimension
            plate = f"{name}_{potential.plate}"
            coords[plate] = np.flatnonzero(mask.cpu().numpy())
            _keep(groups, name, mask.cpu().numpy(), axis)
        data_dims[name] = [f"{name}_dim_{i}" for i in range(axis)] + [plate]
    data_dims.update(dims or {})
    # ArviZ and xarray are imported here, not with pyro_fed: they take seconds
    import arviz as az
    import xarray as xr

    arviz_1 = int(az.__version__.split(".")[0]) >= 1
    if arviz_1:
        data = az.from_dict(groups, coords=coords, dims=data_dims)
    else:
        data = az.from_dict(**groups, coords=coords, dims=data_dims, library=__import__("pyro"))
    for name, flat in clients.items():
        group = _client_group(potential, flat, iterates[name])
        if arviz_1:
            data[name] = xr.DataTree(group)
        else:
            data.add_groups({name: group}, warn_on_custom_groups=False)
    return data


def _posterior_predictive(
    potential: FederatedPotential,
    flat_draws: dict,
    chunk_size: int | None,
    num_chains: int,
    factors: list[str],
) -> dict[str, np.ndarray]:
    """Replicates of the plate's observed sites, ``pyro.factor`` sites left out with a warning naming
    them."""
    drawn = [name for name in potential.likelihood_sites if name not in factors]
    if factors:
        messages.warn(
            f"posterior_predictive: the pyro.factor site{'s' if len(factors) > 1 else ''} "
            f"{', '.join(map(repr, factors))} of the plate {potential.plate!r} left out (a factor has no "
            f"value to draw); replicates of {', '.join(map(repr, drawn))} only.",
        )
    replicates = potential.posterior_predictive(flat_draws, chunk_size)
    return _by_chain({k: v for k, v in replicates.items() if k in drawn}, num_chains)


def _keep(groups: dict, name: str, mask: np.ndarray, axis: int) -> None:
    """Keep the observed entries of site ``name`` along its plate ``axis`` in every group holding it (after
    the chain and draw dimensions where the group has them)."""
    for group, values in groups.items():
        if name in values:
            offset = 0 if group == "observed_data" else 2
            values[name] = np.compress(mask, values[name], axis=offset + axis)
