"""Reading a Pyro model's sites: the data plate, the global latent sites and the observed sites.

pyro_fed splits the likelihood of a model across clients along one plate, the *data plate* of ``N``
points. The sites of the model fall in three classes:

- the global latent sites :math:`\\theta`, continuous and outside the data plate: the sampled parameters;
- the global observed sites (and factors) outside the plate, which count with the prior :math:`U^0`;
- the likelihood sites, observed inside the plate, whose log-densities are summed per datum into
  :math:`-U^i_j(\\theta)` for datum ``j`` of client ``i``.

Every evaluation injects a subsample of indices into the data plate, so the model must read its data
through the plate's indices; :class:`ModelSites` checks this once, with clear errors, when it reads the
model.

Validation is switched off while the model runs inside pyro_fed's evaluations: its checks of argument and
sample values branch on tensor values, which :func:`torch.func.vmap` and tracing cannot do. Distributions
that the model builds while it runs follow Pyro's global switch; distributions built beforehand (the
priors of a :class:`~pyro.nn.PyroModule`, a prior created at import time) carry their own flag, so each
sample site gets a copy of its distribution with validation off (:func:`without_validation`).

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to

#: half-width of the box of the unconstrained space where a site that cannot be sampled starts (Stan's and
#: Pyro's :func:`~pyro.infer.autoguide.initialization.init_to_uniform` default)
INITIAL_RADIUS = 2.0


def without_validation(fn: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """``fn`` with ``_validate_args`` off, itself and in the distributions it wraps (``base_dist`` of
    :class:`~torch.distributions.Independent`, ``ExpandedDistribution``, ``MaskedDistribution``..., the
    components of a mixture): shallow copies where needed, ``fn`` itself when its own flags are already off.
    The user's objects are never modified."""
    wrapped = {
        key: without_validation(value)
        for key, value in vars(fn).items()
        if isinstance(value, torch.distributions.Distribution)
    }
    changed = {key: value for key, value in wrapped.items() if value is not vars(fn)[key]}
    # a distribution built without validate_args follows the global switch at each call: its copy gets its own
    # flag, so that its log_prob does not validate even outside pyro.validation_enabled(False)
    if vars(fn).get("_validate_args", True) is False and not changed:
        return fn
    fn = copy.copy(fn)
    vars(fn).update(changed)
    # after the update: Pyro's Independent passes its flag on to its base_dist, which must be the copy
    fn._validate_args = False
    return fn


def unconstrained_uniform(site: dict, radius: float = INITIAL_RADIUS) -> torch.Tensor:
    """An initial value for the sample ``site`` that does not sample its distribution: uniform in
    :math:`(-r, r)` on the unconstrained space of its support, mapped back (Stan's default initialisation).
    For an improper prior (:class:`~pyro.distributions.ImproperUniform`, a flat prior on its support), which
    cannot be sampled; in the default dtype and device, as the parameters of a prior written with Python
    numbers (``dist.Normal(0.0, 1.0)``)."""
    fn = site["fn"]
    transform = biject_to(fn.support)
    shape = transform.inv.forward_shape(fn.batch_shape + fn.event_shape)
    return transform((torch.rand(shape) * 2 - 1) * radius).detach()


def sampling_free(init_strategy: Callable) -> Callable:
    """``init_strategy``, with :func:`unconstrained_uniform` for the sites whose distribution cannot be
    sampled (Pyro's strategies, ``init_to_median`` or ``init_to_uniform``, all sample the prior first: an
    improper flat prior raises ``NotImplementedError`` there). A site the strategy gives a value keeps it."""

    def strategy(site: dict) -> torch.Tensor:
        try:
            return init_strategy(site)
        except NotImplementedError:
            return unconstrained_uniform(site)

    return strategy


class _WithoutValidation(Messenger):
    """Replaces each sample site's distribution by :func:`without_validation` of it."""

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], torch.distributions.Distribution):
            msg["fn"] = without_validation(msg["fn"])


class _FixMissing(Messenger):
    """Gives the missing entries of an ``obs_mask`` site (``{name}_unobserved``) a fixed value: they are
    marginalised out (left out of the potential), so no randomness is drawn for them."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.names:
            try:  # on the distribution's device and dtype
                like = msg["fn"].mean
            except NotImplementedError:
                like = torch.zeros(())
            msg["value"] = torch.zeros(msg["fn"].shape(), dtype=like.dtype, device=like.device)
            msg["is_observed"] = True


def is_random_variable(site: dict) -> bool:
    """A sample site that is a random variable of the model: not a plate's subsample site, and not a
    ``pyro.deterministic`` record (Pyro marks those observed, but they carry no density)."""
    return (
        site["type"] == "sample" and not site_is_subsample(site) and not site["infer"].get("_deterministic")
    )


def find_data_plate(trace: Trace, plate: str | None) -> str:
    """The name of the plate holding the observed sites (``plate`` if given, checked)."""
    candidates = []
    for site in trace.nodes.values():
        if is_random_variable(site) and site["is_observed"]:
            for frame in site["cond_indep_stack"]:
                if frame.vectorized and frame.name not in candidates:
                    candidates.append(frame.name)
    if plate is not None:
        if plate not in candidates:
            raise ValueError(
                f"plate={plate!r}: the model has no plate of that name containing observed sites "
                f"(plates with observed sites: {candidates}). Pass the name of the data plate."
            )
        return plate
    if not candidates:
        raise ValueError(
            "The model has no plate containing observed sites: pyro_fed splits the likelihood plate "
            "across clients. Declare the data as `with pyro.plate('data', N): pyro.sample(..., obs=...)`."
        )
    if len(candidates) > 1:
        raise ValueError(
            f"The model has several plates containing observed sites: {candidates}. "
            "Say which one is the data plate to split across clients with plate='name'."
        )
    return candidates[0]


def _log_density(node: dict, scale: float = 1.0) -> torch.Tensor:
    return scale_and_mask(node["fn"].log_prob(node["value"]), node["scale"] * scale, node["mask"])


class ModelSites:
    """A model's sites, read (and checked) from one run of the model under ``init_strategy``.

    :param model: a Pyro model whose likelihood is a plate over data (declared at full size).
    :param tuple model_args: positional arguments of the model.
    :param dict model_kwargs: keyword arguments of the model.
    :param str plate: name of the data plate; found automatically when exactly one plate holds observed
        sites.
    :param init_strategy: a Pyro init strategy giving the initial latent values.

    Attributes: ``plate``, ``plate_dim`` (its dimension), ``num_data`` (``N``), ``latent_names`` (the
    global latent sites, in the model's order), ``global_observed``, ``likelihood_sites`` and
    ``initial_trace`` (the run of the model under ``init_strategy``).
    """

    def __init__(
        self,
        model: Callable,
        model_args: tuple,
        model_kwargs: dict,
        *,
        plate: str | None,
        init_strategy: Callable,
    ):
        self.model = model
        self.model_args = model_args
        self.model_kwargs = model_kwargs
        self.init_strategy = init_strategy
        self.initial_trace = trace = self.draw_initial_trace()
        self.plate = find_data_plate(trace, plate)
        plate_fn = trace.nodes[self.plate]["fn"]
        self.num_data = int(plate_fn.size)
        if plate_fn.subsample_size is not None and plate_fn.subsample_size < self.num_data:
            raise ValueError(
                f"The data plate {self.plate!r} is declared with subsample_size: pyro_fed chooses each "
                "client's minibatch itself. Declare the plate at full size, without subsample_size, and "
                "read the data through the plate's indices (pyro.subsample or `as idx`)."
            )
        self._classify(trace)
        self._check_model_reads_plate_indices()

    def draw_initial_trace(self) -> Trace:
        """A fresh run of the model with its latent values drawn by the init strategy."""
        tracer = poutine.trace(InitMessenger(sampling_free(self.init_strategy))(self.model))
        try:
            return tracer.get_trace(*self.model_args, **self.model_kwargs)
        except Exception as error:
            # a PyroModule's weights first read inside a plate get its batch shape: the model then fails
            # in its own layers; say why, with the fix
            inside = [
                name
                for name, site in tracer.msngr.trace.nodes.items()
                if site["type"] == "sample" and not site["is_observed"] and site["cond_indep_stack"]
            ]
            if any("." in name for name in inside):
                site_plate = next(
                    f.name for n in inside for f in tracer.msngr.trace.nodes[n]["cond_indep_stack"]
                )
                raise ValueError(
                    f"The model failed ({type(error).__name__}: {error}) after sampling {inside} inside the "
                    f"plate {site_plate!r}." + _module_hint(site_plate)
                ) from error
            raise

    def _classify(self, trace: Trace) -> None:
        self.latent_names: list[str] = []
        self.global_observed: list[str] = []
        self.likelihood_sites: list[str] = []
        #: the missing entries of ``obs_mask`` sites: latent per datum, marginalised out by leaving them out
        self.missing_sites: set[str] = set()
        for name, site in trace.nodes.items():
            if not is_random_variable(site):
                continue
            in_plate = any(f.name == self.plate for f in site["cond_indep_stack"])
            if site["is_observed"]:
                (self.likelihood_sites if in_plate else self.global_observed).append(name)
                if in_plate:
                    self.plate_dim = next(f.dim for f in site["cond_indep_stack"] if f.name == self.plate)
                continue
            base = name.removesuffix("_unobserved")
            if in_plate and base != name and f"{base}_observed" in trace.nodes and base in trace.nodes:
                # pyro.sample(base, ..., obs_mask=...): its missing entries carry no information on the
                # global parameters; leaving them out of the potential integrates them out exactly
                self.missing_sites.add(name)
                continue
            if in_plate:
                raise ValueError(
                    f"Site {name!r} is a latent variable inside the data plate {self.plate!r}: pyro_fed "
                    "samples global parameters only. Move it out of the plate, or marginalise it."
                    + (_module_hint(self.plate) if "." in name else "")
                )
            if site["fn"].support.is_discrete or site["infer"].get("enumerate"):
                raise ValueError(
                    f"Site {name!r} is a discrete latent variable: Langevin samplers need continuous "
                    "parameters. Marginalise it out of the model (or observe it)."
                )
            self.latent_names.append(name)
        if not self.latent_names:
            raise ValueError("The model has no continuous global latent site to sample.")

    def _check_model_reads_plate_indices(self) -> None:
        n = min(2, self.num_data - 1) if self.num_data > 1 else 1
        values = {name: self.initial_trace.nodes[name]["value"] for name in self.latent_names}
        try:
            trace = self.run(values, torch.arange(n, device=values[self.latent_names[0]].device))
        except Exception as error:
            raise ValueError(
                f"The model failed when run on a subsample of {n} indices of plate {self.plate!r} "
                f"({type(error).__name__}: {error}). pyro_fed injects each client's minibatch indices into "
                "the plate, so the model must read its data through them: `pyro.subsample(data, "
                f"event_dim=...)` or `with pyro.plate({self.plate!r}, N) as idx: ... data[idx]`."
            ) from error
        for name in self.likelihood_sites:
            fn, value = trace.nodes[name]["fn"], trace.nodes[name]["value"]
            value_batch = value.shape[: value.dim() - len(fn.event_shape)]
            if not all(
                len(s) >= -self.plate_dim and s[self.plate_dim] == n for s in (fn.batch_shape, value_batch)
            ):
                raise ValueError(
                    f"Observed site {name!r} does not follow the indices of plate {self.plate!r}: with a "
                    f"subsample of {n} indices its distribution has batch shape {tuple(fn.batch_shape)} and "
                    f"its value shape {tuple(value.shape)}. Read the data through "
                    "the plate's indices: `pyro.subsample(data, event_dim=...)` or "
                    f"`with pyro.plate({self.plate!r}, N) as idx: ... data[idx]`."
                )

    # ------------------------------------------------------------ evaluation
    def run(self, values: dict[str, torch.Tensor], indices: torch.Tensor, *, observed: bool = True) -> Trace:
        """Trace the model at the constrained latent ``values``, with ``indices`` as the data plate's
        subsample, validation off (see the module's docstring).

        :param bool observed: ``False`` to sample the observed sites afresh (posterior predictive).
        """
        model = self.model if observed else poutine.uncondition(self.model)
        conditioned = poutine.condition(model, data={**values, self.plate: indices})
        with pyro.validation_enabled(False):
            return poutine.trace(
                _WithoutValidation()(_FixMissing(self.missing_sites)(conditioned))
            ).get_trace(*self.model_args, **self.model_kwargs)

    def global_log_density(self, trace: Trace) -> torch.Tensor:
        """Sum of the log-densities of the global sites, latent and observed: :math:`-U^0` but the
        log-det-Jacobian."""
        return sum(_log_density(trace.nodes[name]).sum() for name in self.latent_names + self.global_observed)

    def plate_axis(self, name: str) -> int | None:
        """The axis of the data plate in the observed value of site ``name`` (``None`` if the value is
        broadcast along it)."""
        node = self.initial_trace.nodes[name]
        axis = node["value"].dim() - len(node["fn"].event_shape) + self.plate_dim
        return axis if axis >= 0 and node["value"].shape[axis] == self.num_data else None

    def observed_mask(self, name: str) -> torch.Tensor | None:
        """For a likelihood site masked along the data plate only (``obs_mask``, ``poutine.mask`` with a
        per-datum mask): which of the ``N`` data it observes, ``[N]`` bool; ``None`` when nothing is masked
        or the mask varies within a datum."""
        node, axis = self.initial_trace.nodes[name], self.plate_axis(name)
        mask = node["mask"]
        if not isinstance(mask, torch.Tensor) or axis is None:
            return None
        mask = mask.expand(node["fn"].batch_shape).movedim(self.plate_dim, 0).reshape(self.num_data, -1)
        if not bool((mask == mask[:, :1]).all()) or bool(mask.all()):
            return None
        return mask[:, 0]

    def pointwise_log_prob(self, trace: Trace, name: str) -> torch.Tensor:
        """The plain ``log_prob`` of the likelihood site ``name`` (masked entries 0, no ``poutine.scale``
        factor), in the layout of the site's batch shape: ArviZ's convention for the log-likelihood."""
        node = trace.nodes[name]
        log_prob = scale_and_mask(node["fn"].log_prob(node["value"]), 1.0, node["mask"])
        return log_prob.expand(node["fn"].batch_shape)

    def datum_log_prob(self, trace: Trace, name: str, num_indices: int) -> torch.Tensor:
        """Log-density of the likelihood site ``name`` per datum of the subsample, ``[num_indices]``, with
        the site's own scale (``poutine.scale`` is part of the potential) but without the plate's
        ``N / num_indices`` (weights are the caller's)."""
        node = trace.nodes[name]
        # the plate scales by N / |S|: undone here, the client weights N_i / n_i are applied by the caller
        lp = _log_density(node, num_indices / self.num_data)
        lp = lp.expand(node["fn"].batch_shape).movedim(self.plate_dim, 0)
        return lp.reshape(num_indices, -1).sum(-1)


def _module_hint(plate: str) -> str:
    return (
        " A PyroModule samples a PyroSample weight where it is first read: read the weights before the "
        "plate, e.g. `weights = (self.linear.weight, self.linear.bias)` on the line before "
        f"`with pyro.plate({plate!r}, N):` (later reads in the plate reuse them)."
    )
