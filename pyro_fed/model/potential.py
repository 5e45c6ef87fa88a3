"""Federated potentials: a Pyro model whose likelihood is a plate over data, split into clients.

With ``b`` clients, client ``i`` owning ``N_i`` points of the data plate, the potential (negative log
posterior in the unconstrained space) of the model is split as

.. math::

    U(x) = \\sum_{i=1}^b U^i(x), \\qquad
    U^i(x) = \\varpi^i U^0(x) + \\sum_{j \\le N_i} U^i_j(x),

where :math:`U^0` is the negative log prior plus the negative log-det-Jacobian of the unconstrained
transforms, :math:`U^i_j` the negative log-likelihood of datum ``j`` of client ``i`` and
:math:`\\sum_i \\varpi^i = 1`.

:class:`FederatedPotential` composes four modules: :mod:`pyro_fed.model.sites` reads and checks the model's
sites, :mod:`pyro_fed.model.unconstrained` maps the flat unconstrained vector to site values,
:mod:`pyro_fed.model.gradients` gives the clients' potentials and batched gradients as pure tensor functions,
and :mod:`pyro_fed.model.predictive` the per-draw evaluations for ArviZ. It adds the split of the data into
clients and prepares the gradients (traced, compiled: :mod:`pyro_fed.engine.compile`) once per input shape.

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from pyro.infer.autoguide.initialization import init_to_median

from ..data.minibatch import MinibatchSampler
from ..data.partition import to_index_lists
from ..engine.compile import Prepared, check_mode, prepare
from ..engine.randomness import Randomness
from ..network.base import Network
from ..network.in_process import InProcessNetwork
from . import checks, predictive
from .gradients import ClientBatches, ClientGradients, make_prior_weights, pad_batches
from .sites import ModelSites
from .unconstrained import LatentSite, UnconstrainedSpace

__all__ = ["FederatedPotential"]


class FederatedPotential:
    """The potential of a Pyro model split into client potentials, with batched gradients.

    :param model: a Pyro model whose likelihood is a plate over data (declared at full size).
    :param tuple model_args: positional arguments of the model.
    :param dict model_kwargs: keyword arguments of the model.
    :param clients: a number of clients ``b`` (an i.i.d. split of the data, seed 0), a LongTensor of length
        ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index tensors (see
        :mod:`pyro_fed.data.partition`).
    :param str plate: name of the data plate; found automatically when exactly one plate holds observed
        sites.
    :param prior_weights: ``"proportional"`` (:math:`\\varpi^i = N_i/N`), ``"uniform"`` (``1/b``) or a
        tensor of ``b`` non-negative weights summing to one.
    :param init_strategy: a Pyro init strategy giving the initial latent values (default
        :func:`~pyro.infer.autoguide.initialization.init_to_median`).
    :param str gradient_mode: how :meth:`client_grads` and :meth:`full_client_grads` run, prepared once
        per input shape (:mod:`pyro_fed.engine.compile`). ``"auto"`` (default) and ``"traced"``: traced into a
        graph of tensor operations, which removes the Python overhead of the model (2-3x faster than
        ``"eager"``). ``"compiled"``: then compiled by TorchInductor, the compiler behind
        :func:`torch.compile` — the fastest, after about a second of compilation per shape (tens of seconds
        on a machine's first compilation). ``"eager"``: the Pyro model runs at every evaluation.

    Its parts: ``sites`` (:class:`~pyro_fed.model.sites.ModelSites`), ``space``
    (:class:`~pyro_fed.model.unconstrained.UnconstrainedSpace`) and ``gradients``
    (:class:`~pyro_fed.model.gradients.ClientGradients`).
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
        gradient_mode: str = "auto",
        network: Network | None = None,
    ):
        self.model = model
        #: where the clients' potentials and gradients are summed (:class:`~pyro_fed.network.base.Network`)
        self.network = network or InProcessNetwork()
        self.model_args = tuple(model_args)
        self.model_kwargs = dict(model_kwargs or {})
        self.gradient_mode = check_mode(gradient_mode)
        self.sites = ModelSites(
            model, self.model_args, self.model_kwargs, plate=plate, init_strategy=init_strategy
        )
        self.plate, self.plate_dim = self.sites.plate, self.sites.plate_dim
        self.num_data = self.sites.num_data
        self.likelihood_sites, self.global_observed = self.sites.likelihood_sites, self.sites.global_observed
        self.space = UnconstrainedSpace(self.sites.initial_trace, self.sites.latent_names)
        self.latent_sites: list[LatentSite] = self.space.latent_sites
        self.dim = self.space.dim
        self._initial_flat = self.space.flat_values(self.sites.initial_trace)
        self.device, self.dtype = self._initial_flat.device, self._initial_flat.dtype
        if not self.dtype.is_floating_point or torch.finfo(self.dtype).bits < 32:
            raise ValueError(
                f"The model's latent sites {self.sites.latent_names} take values in {self.dtype}: Langevin "
                "steps need float32 or float64 (a step of noise is lost in half precision). Build the priors "
                "in float32 or float64 (Python numbers, or tensors of that dtype) and pass the data in it."
            )
        self.client_indices = to_index_lists(clients, self.num_data)
        self.num_clients = len(self.client_indices)
        self.client_sizes = torch.tensor([len(ix) for ix in self.client_indices], device=self.device)
        #: every client's data size in the global client order, wherever the clients are held (the held
        #: clients' are ``client_sizes``)
        self.all_client_sizes = self.network.gather(self.client_sizes, -1)
        held = self.network.held(len(self.all_client_sizes))
        self.prior_weights = make_prior_weights(prior_weights, self.all_client_sizes, self.dtype)[held]
        # each datum's client, in the global client order (-1: held elsewhere), for the data checks
        owner = torch.full((self.num_data,), -1, dtype=torch.long)
        for client, indices in zip(range(len(self.all_client_sizes))[held], self.client_indices, strict=True):
            owner[indices.cpu()] = client
        self.sites.check_observed_support(owner)
        #: whether the server holds the prior (``prior_weights="server"``): the clients' potentials are then
        #: their likelihoods alone, and :math:`U = U^0 + \\sum_i U^i`
        self.prior_on_server = isinstance(prior_weights, str) and prior_weights == "server"
        self.gradients = ClientGradients(self.sites, self.space, self.client_indices, self.prior_weights)
        self.gradients.check_vectorizable(self._initial_flat)
        if not self.gradients.vectorized:
            # a trace would freeze the branches the model took at the traced point: run it as written
            self.gradient_mode = "eager"
        checks.same_model_everywhere(self)
        self._prepared: dict[tuple, Prepared] = {}
        #: whether :meth:`check_initial_points` has compared the gradient with the potential's differences
        #: (:func:`~pyro_fed.model.checks.gradient_follows_potential`)
        self._gradient_checked = False
        #: the raw batched minibatch gradient, untraced (a pure tensor function, to trace inside larger
        #: functions): see :meth:`pyro_fed.model.gradients.ClientGradients.gradient_fn`
        self.gradient_fn = self.gradients.gradient_fn
        #: the raw full local gradients, each datum evaluated once, untraced: see
        #: :meth:`pyro_fed.model.gradients.ClientGradients.full_gradient_fn`
        self.full_gradient_fn = self.gradients.full_gradient_fn

    @functools.cached_property
    def full_batches(self) -> ClientBatches:
        """Every client's whole data as one padded batch (for :meth:`client_grads`)."""
        return self.batches(self.client_indices)

    # ----------------------------------------------------------- flat vector
    def constrained(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Map a flat unconstrained vector to constrained site values and the log-det-Jacobian."""
        return self.space.constrained(flat)

    def unconstrained_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a flat unconstrained vector into Pyro's ``{site: unconstrained value}`` dict."""
        return self.space.unconstrained_params(flat)

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`unconstrained_params`."""
        return self.space.flatten(params)

    @property
    def transforms(self) -> dict[str, torch.distributions.Transform]:
        """Pyro's convention: constrained -> unconstrained (``MCMC`` maps draws back with ``.inv``)."""
        return self.space.transforms

    @property
    def initial_flat(self) -> torch.Tensor:
        """The init strategy's draw made at construction, as a flat unconstrained vector ``[d]``."""
        return self._initial_flat

    def draw_initial_flat(self) -> torch.Tensor:
        """A fresh draw of the init strategy as a flat unconstrained vector ``[d]`` (independent chains)."""
        return self.space.flat_values(self.sites.draw_initial_trace())

    # ------------------------------------------------------------ gradients
    def minibatch_sampler(
        self, batch_size: int | float, *, chunk_size: int, num_chains: int, rng: Randomness
    ) -> MinibatchSampler:
        """The held clients' :class:`~pyro_fed.data.minibatch.MinibatchSampler` of ``batch_size`` points
        (or that fraction of each client's data), ``chunk_size`` iterations of ``num_chains`` chains at a
        time, its keys drawn from ``rng`` for all the run's clients wherever they are held."""
        return MinibatchSampler(
            self.client_indices,
            batch_size,
            chunk_size=chunk_size,
            num_chains=num_chains,
            rng=rng,
            dtype=self.dtype,
            all_client_sizes=self.all_client_sizes,
            held=self.network.held(len(self.all_client_sizes)),
        )

    def batches(self, indices: Sequence[torch.Tensor]) -> ClientBatches:
        """Pad one index tensor per client into a :class:`~pyro_fed.model.gradients.ClientBatches` with
        weights ``N_i / n_i``."""
        return pad_batches(indices, self.client_sizes, self.dtype)

    def client_grads(self, points: torch.Tensor, batches: ClientBatches) -> torch.Tensor:
        """Minibatch gradients :math:`\\hat\\nabla U^i(x_i; S_i)` of every client, ``[..., b, d]``.

        :param points: ``[b, d]`` one point per client, or ``[m, b, d]`` for ``m`` points per client
            evaluated on the same minibatch (control variates).
        :param batches: the clients' minibatches (padded indices and weights, ``[b, n]``).
        """
        args = self.minibatch_arguments(points, *batches)
        grads = self._prepared_call(self.gradient_fn, args, "the clients' minibatch gradients")
        return grads.reshape(points.shape)

    def minibatch_arguments(
        self, points: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> tuple:
        """The arguments of :attr:`gradient_fn` for every client's minibatch gradient at ``points``
        (``[..., b, d]``), its minibatch ``indices`` and datum ``weights`` (``[..., b, n]``, broadcast to the
        points' leading shape: the same minibatch at every point they do not tell apart)."""
        shape, n = points.shape[:-1], indices.shape[-1]
        return (
            points.reshape(-1, self.dim),
            indices.expand(*shape, n).reshape(-1, n),
            weights.expand(*shape, n).reshape(-1, n),
            self.prior_weights.expand(shape).reshape(-1),
        )

    def minibatch_gradients(self, points: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
        """Every client's minibatch gradient (:meth:`minibatch_arguments`), untraced: a pure tensor function
        to trace inside a larger one, ``[..., b, d]``."""
        return self.gradient_fn(*self.minibatch_arguments(points, indices, weights)).reshape(points.shape)

    def working_gradients(
        self,
        points: torch.Tensor,
        rows: torch.Tensor,
        indices: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gradient estimates of the working clients alone, zeros for the others: ``[..., C, b, d]``
        (untraced: a pure tensor function to trace inside a larger one).

        :param points: the clients' points ``[..., C, b, d]``.
        :param rows: ``[R]``, the working (chain, client) pairs as indices ``c b + i`` of the flattened
            ``[C b]`` pairs; ``C b`` pads (none). Only these ``R`` pairs are evaluated, at each leading point.
        :param indices: the chains' minibatches ``[C, b, n]`` and their datum ``weights``, or ``None``: each
            client's whole data (:attr:`full_batches`; summed in another order than
            :meth:`full_client_grads`, so equal to rounding).
        """
        b, d = self.num_clients, self.dim
        flat = points.reshape(-1, points.shape[-3] * b, d)  # [L, C b, d]
        pairs, count = flat.shape[1], rows.shape[0]
        taken = rows.clamp(max=pairs - 1)  # padding reads a real pair; its result goes to the dropped row
        if indices is None:
            batches = self.full_batches
            chosen, datum_weights = batches.indices[taken % b], batches.datum_weights[taken % b]
        else:
            chosen = indices.reshape(pairs, -1)[taken]
            datum_weights = weights.reshape(pairs, -1)[taken]
        leading, n = flat.shape[0], chosen.shape[-1]
        grads = self.gradient_fn(
            flat[:, taken].reshape(-1, d),
            chosen.expand(leading, count, n).reshape(-1, n),
            datum_weights.expand(leading, count, n).reshape(-1, n),
            self.prior_weights[taken % b].expand(leading, count).reshape(-1),
        ).reshape(leading, count, d)
        # one row past the pairs takes the padding's results, then is dropped
        spread = flat.new_zeros(leading, pairs + 1, d).index_copy(1, rows, grads)
        return spread[:, :pairs].reshape(points.shape)

    def full_client_grads(self, points: torch.Tensor) -> torch.Tensor:
        """Full local gradients :math:`\\nabla U^i(x_i)` of every client: ``[d]`` (one common point) ->
        ``[b, d]``, ``[b, d]`` -> ``[b, d]`` or ``[m, b, d]`` -> ``[m, b, d]``."""
        points, shape = self._client_points(points)
        grads = self._prepared_call(self.full_gradient_fn, (points,), "the clients' full gradients")
        return grads.reshape(shape)

    def client_potentials(self, points: torch.Tensor) -> torch.Tensor:
        """Full local potentials :math:`U^i(x_i)` of every client: ``[d]`` (one common point) -> ``[b]``,
        ``[b, d]`` -> ``[b]`` or ``[m, b, d]`` -> ``[m, b]``."""
        points, shape = self._client_points(points)
        return self.gradients.full_potential_fn(points).reshape(shape[:-1])

    def potential(self, point: torch.Tensor) -> torch.Tensor:
        """The full-data potential :math:`U(x) = \\sum_i U^i(x)` at one point ``[d]`` (plus :math:`U^0` when
        the server holds the prior)."""
        return self.total_potentials(point[None])[0]

    def gradient(self, point: torch.Tensor) -> torch.Tensor:
        """:math:`\\nabla U` at one point ``[d]``, from the clients' prepared full gradients (traced or
        compiled, see :meth:`full_client_grads`; :meth:`total_gradient` is its untraced twin)."""
        return (
            self.network.sum(self.full_client_grads(point)) + self.server_prior(point[None], gradient=True)[0]
        )

    def total_potentials(self, points: torch.Tensor) -> torch.Tensor:
        """:math:`U` at each of ``m`` points ``[m, d]``: ``[m]``."""
        clients = points[:, None, :].expand(-1, self.num_clients, -1).contiguous()
        potentials = self.network.sum(self.gradients.full_potential_fn(clients), -1)
        return potentials + self.server_prior(points, gradient=False)

    def total_gradient(self, points: torch.Tensor) -> torch.Tensor:
        """:math:`\\nabla U` at each of ``m`` points ``[m, d]``, summed over the clients by the network
        (untraced): ``[m, d]``."""
        clients = points[:, None, :].expand(-1, self.num_clients, -1).contiguous()
        return self.network.sum(self.full_gradient_fn(clients)) + self.server_prior(points, gradient=True)

    def server_prior(self, points: torch.Tensor, *, gradient: bool) -> torch.Tensor:
        """The server's share of the potential at ``m`` points ``[m, d]``: :math:`U^0` (``[m]``) or its
        gradient (``[m, d]``) when the server holds the prior, zeros otherwise."""
        if not self.prior_on_server:
            return points.new_zeros(points.shape if gradient else points.shape[:1])
        return self.prior(points, gradient=gradient)

    def prior(self, points: torch.Tensor, *, gradient: bool) -> torch.Tensor:
        """:math:`U^0`, the whole prior with the transforms' Jacobian, at ``m`` points ``[m, d]`` (``[m]``),
        or its gradient (``[m, d]``), whoever holds it."""
        return self.gradients.prior_share(points, points.new_ones(points.shape[0]), gradient=gradient)

    def _client_points(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
        """Points as ``[m, b, d]``, and the ``[..., b, d]`` shape of the results."""
        if points.dim() == 1:
            points = points.expand(self.num_clients, self.dim)
        return points.reshape(-1, self.num_clients, self.dim), points.shape

    def check_initial_points(self, points: torch.Tensor) -> None:
        """Refuse initial points (``[C, d]``) where the potential or its gradient is not finite, naming the
        site: a sampler started there would never move (every step reverted) or go astray silently."""
        finite = self.total_potentials(points).isfinite()
        grads = self.total_gradient(points)
        if bool(finite.all()) and bool(grads.isfinite().all()):
            if not self._gradient_checked:  # once per run: the first start
                self._gradient_checked = True
                checks.gradient_follows_potential(self, points[0])
            return
        chain = int((~finite | ~grads.isfinite().all(-1)).nonzero()[0])
        values, _ = self.constrained(points[chain])
        for site in self.latent_sites:
            unconstrained = points[chain, site.start : site.stop]
            if not bool(unconstrained.isfinite().all() and values[site.name].isfinite().all()):
                raise ValueError(
                    f"The initial value of site {site.name!r} in chain {chain} is not finite: "
                    f"{values[site.name].tolist()} (unconstrained {unconstrained.tolist()}). Give it a "
                    "finite value in initial_params (unconstrained, Pyro's convention) or init_strategy, or "
                    "leave them out."
                )
        trace = self.sites.run(values, torch.arange(self.num_data, device=self.device))
        trace.compute_log_prob()
        bad = [
            name
            for name, site in trace.nodes.items()
            if site["type"] == "sample"
            and name not in self.sites.missing_sites
            and "log_prob_sum" in site
            and not torch.isfinite(site["log_prob_sum"])
        ]
        if bad:
            name = bad[0]
            value = trace.nodes[name]["value"]
            nan = int(torch.isnan(value).sum()) if trace.nodes[name]["is_observed"] else 0
            raise ValueError(
                f"Site {name!r} has a non-finite log-density at the initial point of chain {chain}"
                + (
                    f": its observed values hold {nan} NaN entries. Remove or mask them (obs_mask)."
                    if nan
                    else ". Check the site's parameters and data, or start elsewhere (init_strategy, "
                    "initial_params)."
                )
            )
        coordinates = (~grads[chain].isfinite()).nonzero().squeeze(-1).tolist()
        sites = sorted({s.name for s in self.latent_sites for j in coordinates if s.start <= j < s.stop})
        raise ValueError(
            f"The potential's gradient is not finite at the initial point of chain {chain} (with respect to "
            f"the sites {sites}), though its value is. Start elsewhere (init_strategy, initial_params) or "
            "check the model's parametrisation there."
        )

    def _prepared_call(self, function: Callable, args: tuple[torch.Tensor, ...], what: str) -> torch.Tensor:
        """``function(*args)``, prepared in ``gradient_mode`` for inputs of these shapes, once per shape, and
        called with them contiguous: a compiled function reads its inputs in the strides it was prepared for
        (:func:`~pyro_fed.engine.compile.layout`)."""
        args = tuple(a.contiguous() for a in args)
        # the requested mode is part of the key: a compilation that fell back is not tried again at each call
        key = (what, self.gradient_mode, *(a.shape for a in args))
        if key not in self._prepared:
            self._prepared[key] = prepare(function, args, self.gradient_mode, what=what)
        return self._prepared[key](*args)

    @property
    def preparation_seconds(self) -> float:
        """Seconds spent tracing and compiling the gradient functions so far."""
        return sum(p.seconds for p in self._prepared.values())

    # ------------------------------------------------- per-draw evaluations
    def pointwise_log_likelihood(
        self, values: dict[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Pointwise log-likelihood per observed site: ``{site: [M, *batch_shape]}``
        (:func:`pyro_fed.model.predictive.pointwise_log_likelihood`).

        :param values: constrained latent values with a leading dimension of ``M`` draws.
        """
        return predictive.pointwise_log_likelihood(self.sites, values, chunk_size)

    def posterior_predictive(
        self, values: dict[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """One replicate of every observed site of the plate per draw: ``{site: [M, N, ...]}``
        (:func:`pyro_fed.model.predictive.posterior_predictive`)."""
        return predictive.posterior_predictive(self.sites, values, chunk_size)

    def deterministic_values(
        self, values: dict[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The deterministic sites outside the data plate at each draw: ``{site: [M, ...]}``
        (:func:`pyro_fed.model.predictive.deterministic_values`)."""
        return predictive.deterministic_values(self.sites, values, chunk_size)

    def observed_data(self) -> dict[str, torch.Tensor]:
        """The observed values of the plate's sites, in data order."""
        return predictive.observed_data(self.sites)
