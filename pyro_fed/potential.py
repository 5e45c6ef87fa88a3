"""Federated potentials: a Pyro model whose likelihood is a plate over data, split into clients.

With ``b`` clients, client ``i`` owning ``N_i`` points of the data plate, the potential (negative log
posterior in the unconstrained space) of the model is split as

.. math::

    U(x) = \\sum_{i=1}^b U^i(x), \\qquad
    U^i(x) = \\varpi^i U^0(x) + \\sum_{j \\le N_i} U^i_j(x),

where :math:`U^0` is the negative log prior plus the negative log-det-Jacobian of the unconstrained
transforms, :math:`U^i_j` the negative log-likelihood of datum ``j`` of client ``i`` and
:math:`\\sum_i \\varpi^i = 1`. A minibatch ``S`` of client ``i`` gives the unbiased estimate
:math:`\\hat\\nabla U^i(x; S) = \\varpi^i \\nabla U^0(x) + (N_i/|S|) \\sum_{j \\in S} \\nabla U^i_j(x)`.

The model is evaluated with each client's minibatch indices injected into the data plate, and all clients
are evaluated at once with :func:`torch.func.vmap` (one vectorised model evaluation per call, never a
Python loop over clients).

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pyro
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to
from torch.fx.experimental.proxy_tensor import make_fx

from .partition import to_index_lists

GRADIENT_MODES = ("traced", "compiled", "eager")


def check_gradient_mode(gradient_mode: str) -> str:
    if gradient_mode not in GRADIENT_MODES:
        raise ValueError(f"gradient_mode={gradient_mode!r}: use one of {GRADIENT_MODES}.")
    return gradient_mode


class LatentSite(NamedTuple):
    """A global latent site: its slice of the flat unconstrained vector and its transform."""

    name: str
    start: int
    stop: int
    shape: torch.Size  # unconstrained shape
    transform: torch.distributions.Transform


class ClientBatches(NamedTuple):
    """Padded per-client data indices: ``indices[i, :n_i]`` are client ``i``'s, the rest padding.

    ``datum_weights[i, j]`` is ``N_i / n_i`` on real entries and 0 on padding, so that
    ``sum_j datum_weights[i, j] * loglik[indices[i, j]]`` estimates client ``i``'s log-likelihood.
    """

    indices: torch.Tensor  # [b, n] long
    datum_weights: torch.Tensor  # [b, n] float


def _find_data_plate(trace, plate: str | None) -> str:
    candidates = []
    for site in trace.nodes.values():
        if site["type"] == "sample" and site["is_observed"]:
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


class FederatedPotential:
    """The potential of a Pyro model split into client potentials, with batched gradients.

    :param model: a Pyro model whose likelihood is a plate over data (declared at full size).
    :param tuple model_args: positional arguments of the model.
    :param dict model_kwargs: keyword arguments of the model.
    :param clients: a LongTensor of length ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index
        tensors (see :mod:`pyro_fed.partition`).
    :param str plate: name of the data plate; found automatically when exactly one plate holds observed
        sites.
    :param prior_weights: ``"proportional"`` (:math:`\\varpi^i = N_i/N`), ``"uniform"`` (``1/b``) or a
        tensor of ``b`` non-negative weights summing to one.
    :param init_strategy: a Pyro init strategy giving the initial latent values (default
        :func:`~pyro.infer.autoguide.initialization.init_to_median`).
    :param str gradient_mode: how the batched gradient runs. ``"traced"`` (default): traced once per input
        shape into a graph of tensor operations, which removes the Python overhead of the model (2-3x
        faster than ``"eager"``). ``"compiled"``: that graph compiled by TorchInductor, the compiler
        behind :func:`torch.compile` (several times faster again, after seconds of compilation per shape,
        tens of seconds on a machine's first compilation: for long runs). ``"eager"``: the Pyro
        model runs at every evaluation.
    """

    def __init__(
        self,
        model: Callable,
        model_args: tuple = (),
        model_kwargs: dict | None = None,
        *,
        clients,
        plate: str | None = None,
        prior_weights: str | torch.Tensor = "proportional",
        init_strategy: Callable = init_to_median,
        gradient_mode: str = "traced",
    ):
        self.model = model
        self.model_args = tuple(model_args)
        self.model_kwargs = dict(model_kwargs or {})
        trace = poutine.trace(InitMessenger(init_strategy)(model)).get_trace(
            *self.model_args, **self.model_kwargs
        )
        self.plate = _find_data_plate(trace, plate)
        plate_site = trace.nodes[self.plate]
        self.num_data = int(plate_site["fn"].size)
        if plate_site["fn"].subsample_size is not None and plate_site["fn"].subsample_size < self.num_data:
            raise ValueError(
                f"The data plate {self.plate!r} is declared with subsample_size: pyro_fed chooses each "
                "client's minibatch itself. Declare the plate at full size, without subsample_size, and "
                "read the data through the plate's indices (pyro.subsample or `as idx`)."
            )
        self._classify_sites(trace)
        self.client_indices = to_index_lists(clients, self.num_data)
        self.num_clients = len(self.client_indices)
        self.device = self._initial_flat.device
        self.dtype = self._initial_flat.dtype
        self.client_sizes = torch.tensor([len(ix) for ix in self.client_indices], device=self.device)
        self.prior_weights = self._make_prior_weights(prior_weights)
        self._check_model_reads_plate_indices()
        self._vmapped_grad = torch.func.vmap(torch.func.grad(self._client_potential))
        self.gradient_mode = check_gradient_mode(gradient_mode)
        self._gradient_functions: dict[tuple, Callable] = {}
        self._vmapped_value = torch.func.vmap(self._client_potential)
        self.full_batches = self.batches(self.client_indices)

    # ----------------------------------------------------------------- set-up
    def _classify_sites(self, trace) -> None:
        self.latent_sites: list[LatentSite] = []
        self.global_observed: list[str] = []
        self.likelihood_sites: list[str] = []
        flat, start = [], 0
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site_is_subsample(site):
                continue
            in_plate = any(f.name == self.plate for f in site["cond_indep_stack"])
            if site["is_observed"]:
                (self.likelihood_sites if in_plate else self.global_observed).append(name)
                if in_plate:
                    self.plate_dim = next(f.dim for f in site["cond_indep_stack"] if f.name == self.plate)
                continue
            if in_plate:
                raise ValueError(
                    f"Site {name!r} is a latent variable inside the data plate {self.plate!r}: pyro_fed "
                    "samples global parameters only. Move it out of the plate, or marginalise it."
                )
            fn = site["fn"]
            if fn.support.is_discrete or site["infer"].get("enumerate"):
                raise ValueError(
                    f"Site {name!r} is a discrete latent variable: Langevin samplers need continuous "
                    "parameters. Marginalise it out of the model (or observe it)."
                )
            transform = biject_to(fn.support)
            unconstrained = transform.inv(site["value"].detach())
            stop = start + unconstrained.numel()
            self.latent_sites.append(LatentSite(name, start, stop, unconstrained.shape, transform))
            flat.append(unconstrained.reshape(-1))
            start = stop
        if not self.latent_sites:
            raise ValueError("The model has no continuous global latent site to sample.")
        self._initial_flat = torch.cat(flat)
        self.dim = start

    def _make_prior_weights(self, prior_weights) -> torch.Tensor:
        b = self.num_clients
        if isinstance(prior_weights, str):
            if prior_weights == "proportional":
                return self.client_sizes.to(self.dtype) / self.num_data
            if prior_weights == "uniform":
                return torch.full((b,), 1.0 / b, dtype=self.dtype, device=self.device)
            raise ValueError(
                f"prior_weights={prior_weights!r}: use 'proportional', 'uniform' or a tensor of {b} "
                "non-negative weights summing to 1."
            )
        weights = torch.as_tensor(prior_weights, dtype=self.dtype, device=self.device)
        if weights.shape != (b,) or (weights < 0).any() or abs(float(weights.sum()) - 1.0) > 1e-6:
            raise ValueError(
                f"prior_weights must be a tensor of {b} non-negative weights summing to 1 (one per "
                f"client); got shape {tuple(weights.shape)} and sum {float(weights.sum()):.6g}."
            )
        return weights

    def _check_model_reads_plate_indices(self) -> None:
        n = min(2, self.num_data - 1) if self.num_data > 1 else 1
        probe = torch.arange(n, device=self.device)
        try:
            with pyro.validation_enabled(False):
                trace = self._trace(self.constrained(self._initial_flat)[0], probe)
        except Exception as error:
            raise ValueError(
                f"The model failed when run on a subsample of {n} indices of plate {self.plate!r} "
                f"({type(error).__name__}: {error}). pyro_fed injects each client's minibatch indices into "
                "the plate, so the model must read its data through them: `pyro.subsample(data, "
                f"event_dim=...)` or `with pyro.plate({self.plate!r}, N) as idx: ... data[idx]`."
            ) from error
        for name in self.likelihood_sites:
            site = trace.nodes[name]
            fn, value = site["fn"], site["value"]
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

    # ----------------------------------------------------------- flat vector
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
        """Split a flat unconstrained vector into Pyro's ``{site: unconstrained value}`` dict."""
        return {s.name: flat[s.start : s.stop].reshape(s.shape) for s in self.latent_sites}

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`unconstrained_params`."""
        return torch.cat([params[s.name].reshape(-1) for s in self.latent_sites])

    @property
    def transforms(self) -> dict[str, torch.distributions.Transform]:
        """Pyro's convention (as :func:`~pyro.infer.mcmc.util.initialize_model`): constrained ->
        unconstrained, so that ``MCMC`` maps draws back with ``transforms[name].inv``."""
        return {s.name: s.transform.inv for s in self.latent_sites}

    @property
    def initial_flat(self) -> torch.Tensor:
        return self._initial_flat

    # ------------------------------------------------------------ evaluation
    def _trace(self, values: dict[str, torch.Tensor], indices: torch.Tensor):
        conditioned = poutine.condition(self.model, data={**values, self.plate: indices})
        return poutine.trace(conditioned).get_trace(*self.model_args, **self.model_kwargs)

    def _log_prior_and_likelihood(self, trace, num_indices: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the global log-densities, and the per-datum log-likelihood ``[num_indices]``."""
        log_prior = 0.0
        for site in self.latent_sites:
            node = trace.nodes[site.name]
            log_prior = (
                log_prior
                + scale_and_mask(node["fn"].log_prob(node["value"]), node["scale"], node["mask"]).sum()
            )
        for name in self.global_observed:
            node = trace.nodes[name]
            log_prior = (
                log_prior
                + scale_and_mask(node["fn"].log_prob(node["value"]), node["scale"], node["mask"]).sum()
            )
        log_lik = 0.0
        for name in self.likelihood_sites:
            log_lik = log_lik + self._datum_log_prob(trace.nodes[name], num_indices)
        return log_prior, log_lik

    def _datum_log_prob(self, node, num_indices: int) -> torch.Tensor:
        """Log-density of one observed site per datum of the plate, ``[num_indices]``."""
        # the plate scales by N / |S|; the client weights N_i / n_i are applied by the caller instead
        scale = node["scale"] * num_indices / self.num_data
        lp = scale_and_mask(node["fn"].log_prob(node["value"]), scale, node["mask"])
        lp = lp.expand(node["fn"].batch_shape).movedim(self.plate_dim, 0)
        return lp.reshape(num_indices, -1).sum(-1)

    def _client_potential(
        self, flat: torch.Tensor, indices: torch.Tensor, datum_weights: torch.Tensor, prior_weight
    ) -> torch.Tensor:
        values, log_det = self.constrained(flat)
        trace = self._trace(values, indices)
        log_prior, log_lik = self._log_prior_and_likelihood(trace, indices.shape[0])
        return -(prior_weight * (log_prior + log_det) + (datum_weights * log_lik).sum())

    def batches(self, indices: Sequence[torch.Tensor]) -> ClientBatches:
        """Pad one index tensor per client into a :class:`ClientBatches` with weights ``N_i / n_i``."""
        n = max(len(ix) for ix in indices)
        padded = torch.zeros(len(indices), n, dtype=torch.long, device=self.device)
        weights = torch.zeros(len(indices), n, dtype=self.dtype, device=self.device)
        for i, ix in enumerate(indices):
            padded[i, : len(ix)] = ix
            weights[i, : len(ix)] = float(self.client_sizes[i]) / len(ix)
        return ClientBatches(padded, weights)

    def client_grads(self, points: torch.Tensor, batches: ClientBatches) -> torch.Tensor:
        """Minibatch gradients :math:`\\hat\\nabla U^i(x_i; S_i)` of every client, ``[..., b, d]``.

        :param points: ``[b, d]`` one point per client, or ``[m, b, d]`` for ``m`` points per client
            evaluated on the same minibatch (control variates).
        :param batches: the clients' minibatches (padded indices and weights, ``[b, n]``).
        """
        lead = points.shape[:-2]
        flat_points = points.reshape(-1, self.dim)
        m = flat_points.shape[0] // self.num_clients
        args = (flat_points, *batches, self.prior_weights)
        if m > 1:  # the same minibatch at every point
            args = (flat_points, *(a.repeat(m, *[1] * (a.dim() - 1)) for a in args[1:]))
        with pyro.validation_enabled(False):
            grads = self._gradient_function(args)(*args)
        return grads.reshape(*lead, self.num_clients, self.dim)

    def _gradient_function(self, args: tuple[torch.Tensor, ...]) -> Callable:
        """The vmapped gradient for inputs of these shapes, prepared once per shape (see ``gradient_mode``).

        Tracing (:func:`torch.fx.experimental.proxy_tensor.make_fx`) removes the Python overhead of running
        the Pyro model. It is as safe as :func:`torch.func.vmap` itself: the points and indices are
        batched, so the model cannot branch on their values, and the data are constants of the run.
        Compiling the traced graph with TorchInductor (the compiler behind :func:`torch.compile`) fuses its
        operations. If a step fails, the previous one is used, with a warning.
        """
        key = tuple(a.shape for a in args)
        if key in self._gradient_functions:
            return self._gradient_functions[key]
        function = self._vmapped_grad
        try:
            if self.gradient_mode in ("traced", "compiled"):
                function = make_fx(lambda *a: self._vmapped_grad(*a))(*args)
            if self.gradient_mode == "compiled":
                # the graph is already traced to tensor operations: TorchInductor compiles it as it is
                # (torch.compile would trace it again with Dynamo and check guards at every call, which
                # costs more than the compiled gradient itself here)
                import torch._inductor  # imported only when needed: it takes seconds

                function = torch._inductor.compile(function, list(args))
        except Exception as error:  # a model or platform that cannot be traced/compiled keeps what works
            fallback = "eager" if function is self._vmapped_grad else "traced"
            warnings.warn(
                f"pyro_fed could not prepare the model's gradient in gradient_mode={self.gradient_mode!r} "
                f"({type(error).__name__}: {error}); using the {fallback} gradient instead, which is slower.",
                stacklevel=3,
            )
        self._gradient_functions[key] = function
        return function

    def full_client_grads(self, point: torch.Tensor) -> torch.Tensor:
        """Full local gradients :math:`\\nabla U^i(y)` of every client at one common point, ``[b, d]``."""
        return self.client_grads(point.expand(self.num_clients, self.dim), self.full_batches)

    def client_potentials(self, point: torch.Tensor) -> torch.Tensor:
        """Full local potentials :math:`U^i(x)` of every client at one common point, ``[b]``."""
        idx, w = self.full_batches
        with pyro.validation_enabled(False):
            return self._vmapped_value(point.expand(self.num_clients, self.dim), idx, w, self.prior_weights)

    def potential(self, point: torch.Tensor) -> torch.Tensor:
        """The full-data potential :math:`U(x) = \\sum_i U^i(x)`."""
        return self.client_potentials(point).sum()

    # ------------------------------------------------- per-draw evaluations
    def _map_draws(self, fn: Callable, values: dict[str, torch.Tensor], chunk_size: int | None, **vmap_kw):
        """Apply ``fn`` (one draw's constrained values -> dict of tensors) to draws with a leading dimension,
        vectorised over chunks of draws.

        Some samplers of ``torch.distributions`` (e.g. ``Normal.sample``) fill an unbatched tensor in place,
        which :func:`torch.func.vmap` cannot give independent randomness per draw: those chunks run draw by
        draw instead.
        """
        num_draws = next(iter(values.values())).shape[0]
        chunk_size = chunk_size or max(1, 2**22 // max(self.num_data, 1))
        mapped = torch.func.vmap(fn, **vmap_kw)

        def one_by_one(chunk):
            outputs = [
                fn({k: v[i] for k, v in chunk.items()}) for i in range(next(iter(chunk.values())).shape[0])
            ]
            return {k: torch.stack([o[k] for o in outputs]) for k in outputs[0]}

        chunks = []
        with pyro.validation_enabled(False), torch.no_grad():
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

    def pointwise_log_likelihood(
        self, values: dict[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Log-likelihood of every datum, per observed site: ``{site: [M, N]}``.

        :param values: constrained latent values with a leading dimension of ``M`` draws.
        """
        indices = torch.arange(self.num_data, device=self.device)

        def one_draw(draw):
            trace = self._trace(draw, indices)
            return {
                name: self._datum_log_prob(trace.nodes[name], self.num_data) for name in self.likelihood_sites
            }

        return self._map_draws(one_draw, values, chunk_size)

    def posterior_predictive(
        self, values: dict[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """One replicate of every observed site of the plate per draw: ``{site: [M, N, ...]}``.

        Randomness comes from the global torch RNG, as in :class:`pyro.infer.Predictive`.
        """
        indices = torch.arange(self.num_data, device=self.device)
        unconditioned = poutine.uncondition(self.model)

        def one_draw(draw):
            conditioned = poutine.condition(unconditioned, data={**draw, self.plate: indices})
            trace = poutine.trace(conditioned).get_trace(*self.model_args, **self.model_kwargs)
            return {name: trace.nodes[name]["value"] for name in self.likelihood_sites}

        return self._map_draws(one_draw, values, chunk_size, randomness="different")

    def observed_data(self) -> dict[str, torch.Tensor]:
        """The observed values of the plate's sites, in data order."""
        values = self.constrained(self._initial_flat)[0]
        trace = self._trace(values, torch.arange(self.num_data, device=self.device))
        return {name: trace.nodes[name]["value"].detach() for name in self.likelihood_sites}
