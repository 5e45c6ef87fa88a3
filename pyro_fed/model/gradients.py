"""The clients' potentials and their gradients, as pure tensor functions batched with :func:`torch.func.vmap`.

With ``b`` clients, client ``i`` owning ``N_i`` points of the data plate, the potential (negative log
posterior in the unconstrained space) is split as

.. math::

    U(x) = \\sum_{i=1}^b U^i(x), \\qquad
    U^i(x) = \\varpi^i U^0(x) + \\sum_{j \\le N_i} U^i_j(x),

where :math:`U^0` is the negative log prior plus the negative log-det-Jacobian of the unconstrained
transforms, :math:`U^i_j` the negative log-likelihood of datum ``j`` of client ``i`` and
:math:`\\sum_i \\varpi^i = 1`. A minibatch ``S`` of client ``i`` gives the unbiased estimate
:math:`\\hat\\nabla U^i(x; S) = \\varpi^i \\nabla U^0(x) + (N_i/|S|) \\sum_{j \\in S} \\nabla U^i_j(x)`.

The model is evaluated on each client's minibatch (its indices injected into the data plate, or its rows of
the data arguments for a model written for NUTS: :mod:`pyro_fed.model.sites`), and all clients
are evaluated at once with :func:`torch.func.vmap` (one vectorised model evaluation per call, never a
Python loop over clients). The functions here are neither traced nor compiled: they can be traced inside
larger functions (see :mod:`pyro_fed.engine.compile`), and they switch validation off themselves. A model that
:func:`torch.func.vmap` cannot batch (a Python ``if`` on a parameter's value, an in-place write of a
parameter into a tensor made inside the model) is evaluated one client at a time instead, with a warning.

**Reference:** Plassier et al., *Federated Averaging Langevin Dynamics: Toward a unified theory and new
algorithms*, AISTATS 2023, Section 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .. import messages
from ..data.partition import pad_indices
from .sites import ModelSites, error_reason
from .unconstrained import UnconstrainedSpace

# full gradients evaluate the data in chunks of at most this many per-datum gradient entries (m * chunk * d),
# minibatch gradients their rows in groups of at most this many per-datum entries (rows * n * datum_entries)
_CHUNK_ELEMENTS = 2**24
#: data per block of the full gradients, at most
_BLOCK_SIZE = 64


class ClientBatches(NamedTuple):
    """Padded per-client data indices: ``indices[i, :n_i]`` are client ``i``'s, the rest padding.

    ``datum_weights[i, j]`` is ``N_i / n_i`` on real entries and 0 on padding, so that
    ``sum_j datum_weights[i, j] * loglik[indices[i, j]]`` estimates client ``i``'s log-likelihood.
    """

    indices: torch.Tensor  # [b, n] long
    datum_weights: torch.Tensor  # [b, n] float


def pad_batches(
    indices: Sequence[torch.Tensor], client_sizes: torch.Tensor, dtype: torch.dtype
) -> ClientBatches:
    """Pad one index tensor per client into a :class:`ClientBatches` with weights ``N_i / n_i``."""
    table, lengths = pad_indices(indices, client_sizes.device)
    real = torch.arange(table.shape[1], device=table.device) < lengths[:, None]
    weights = torch.where(real, (client_sizes / lengths).to(dtype)[:, None], torch.zeros((), dtype=dtype))
    return ClientBatches(table, weights.to(dtype))


def make_prior_weights(
    prior_weights: str | torch.Tensor, client_sizes: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The prior weights :math:`\\varpi^i`: ``"proportional"`` (:math:`N_i/N`), ``"uniform"`` (``1/b``),
    ``"server"`` (all 0: the server holds the prior) or a user's tensor of ``b`` non-negative weights summing
    to one (checked)."""
    b, device = len(client_sizes), client_sizes.device
    if isinstance(prior_weights, str):
        if prior_weights == "server":
            return torch.zeros(b, dtype=dtype, device=device)
        if prior_weights == "proportional":
            return client_sizes.to(dtype) / client_sizes.sum()
        if prior_weights == "uniform":
            return torch.full((b,), 1.0 / b, dtype=dtype, device=device)
        raise ValueError(
            f"prior_weights={prior_weights!r}: use 'proportional', 'uniform' or a tensor of {b} "
            "non-negative weights summing to 1."
        )
    weights = torch.as_tensor(prior_weights, dtype=dtype, device=device)
    if weights.shape != (b,) or (weights < 0).any() or abs(float(weights.sum()) - 1.0) > 1e-6:
        raise ValueError(
            f"prior_weights must be a tensor of {b} non-negative weights summing to 1 (one per "
            f"client); got shape {tuple(weights.shape)} and sum {float(weights.sum()):.6g}."
        )
    return weights


class ClientGradients:
    """The clients' potentials :math:`U^i` and gradients of a model, batched over points and clients.

    :param sites: the model's sites (:class:`~pyro_fed.model.sites.ModelSites`).
    :param space: the flat unconstrained vector (:class:`~pyro_fed.model.unconstrained.UnconstrainedSpace`).
    :param client_indices: one index tensor of data points per client.
    :param prior_weights: the prior weights :math:`\\varpi^i`, ``[b]``.
    """

    def __init__(
        self,
        sites: ModelSites,
        space: UnconstrainedSpace,
        client_indices: Sequence[torch.Tensor],
        prior_weights: torch.Tensor,
    ):
        self.sites = sites
        self.space = space
        self.num_clients = len(client_indices)
        #: whether the model is evaluated for all clients at once (see :meth:`check_vectorizable`)
        self.vectorized = True
        #: entries a gradient holds per datum, measured by :meth:`check_vectorizable` (until then, the
        #: dimension); the minibatch gradients' rows are grouped by it
        self.datum_entries = space.dim
        device = prior_weights.device
        sizes = torch.tensor([len(ix) for ix in client_indices], device=device)
        # The full gradients run on blocks of up to B data of one client each, not on clients padded to
        # N_max: every datum is evaluated once, and at most one block per client is partly padding. Blocks
        # (rather than single data) keep the model's per-evaluation operations large enough to be efficient.
        block = max(1, min(_BLOCK_SIZE, int(sizes.median())))
        blocks_per_client = (sizes + block - 1) // block
        datum_client = torch.repeat_interleave(torch.arange(self.num_clients, device=device), sizes)
        in_client = torch.arange(len(datum_client), device=device) - (sizes.cumsum(0) - sizes)[datum_client]
        block_of_datum = (blocks_per_client.cumsum(0) - blocks_per_client)[datum_client] + in_client // block
        num_blocks = int(blocks_per_client.sum())
        self._block_index = torch.zeros(num_blocks, block, dtype=torch.long, device=device)
        self._block_index[block_of_datum, in_client % block] = torch.cat(list(client_indices)).to(device)
        self._block_weights = torch.zeros(num_blocks, block, dtype=prior_weights.dtype, device=device)
        self._block_weights[block_of_datum, in_client % block] = 1.0
        self._block_client = torch.repeat_interleave(
            torch.arange(self.num_clients, device=device), blocks_per_client
        )
        self._prior_weights = prior_weights

    def client_potential(
        self, flat: torch.Tensor, indices: torch.Tensor, datum_weights: torch.Tensor, prior_weight
    ) -> torch.Tensor:
        """:math:`\\varpi U^0(x) - \\sum_j w_j \\log p(y_{k_j} | x)` at one point ``flat`` (``[d]``) for the
        data ``indices`` (``[n]``) with weights ``datum_weights`` (``[n]``); a scalar."""
        values, log_det = self.space.constrained(flat)
        trace = self.sites.run(values, indices)
        prior = self.sites.global_log_density(trace, values) + log_det
        return -prior_weight * prior - self._log_likelihood(trace, indices, datum_weights)

    def client_likelihood(self, flat: torch.Tensor, indices: torch.Tensor, datum_weights: torch.Tensor):
        r""":math:`-\sum_j w_j \log p(y_{k_j} | x)` alone (:meth:`client_potential` without its prior)."""
        values, _ = self.space.constrained(flat)
        return -self._log_likelihood(self.sites.run(values, indices), indices, datum_weights)

    def _log_likelihood(self, trace, indices: torch.Tensor, datum_weights: torch.Tensor) -> torch.Tensor:
        r""":math:`\sum_j w_j \log p(y_{k_j} | x)` of a model's ``trace`` on the data ``indices``."""
        n = indices.shape[0]
        log_lik = sum(self.sites.datum_log_prob(trace, name, n) for name in self.sites.likelihood_sites)
        return (datum_weights * log_lik).sum()

    def potential_fn(
        self,
        points: torch.Tensor,
        indices: torch.Tensor,
        datum_weights: torch.Tensor,
        prior_weights: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`client_potential` of ``m`` evaluations at once: ``points [m, d]``, ``indices [m, n]``,
        ``datum_weights [m, n]``, ``prior_weights [m]`` -> ``[m]``."""
        return self._batched(self.client_potential)(points, indices, datum_weights, prior_weights)

    def gradient_fn(
        self,
        points: torch.Tensor,
        indices: torch.Tensor,
        datum_weights: torch.Tensor,
        prior_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Gradients of :meth:`client_potential` for ``m`` evaluations at once (shapes as
        :meth:`potential_fn`) -> ``[m, d]``: with one row per client and its minibatch, the estimates
        :math:`\\hat\\nabla U^i(x_i; S_i)`."""
        return self._batched(torch.func.grad(self.client_potential))(
            points, indices, datum_weights, prior_weights
        )

    def _batched(self, function: Callable) -> Callable:
        """``function`` over rows: vectorised with :func:`torch.func.vmap`, or one row at a time for a model
        that cannot be vectorised (see :meth:`check_vectorizable`).

        Vectorised, the rows go in groups of at most ``_CHUNK_ELEMENTS / (n e)`` for ``n`` data per row and
        :attr:`datum_entries` ``e``: the model's per-datum terms (the data it reads, its activations, their
        gradients) of the rows evaluated at once stay within ``_CHUNK_ELEMENTS`` entries, however many
        chains and clients (and however large their minibatches) there are. Below the bound it is one call,
        as without groups."""
        if not self.vectorized:
            return lambda *rows: torch.stack([function(*row) for row in zip(*rows, strict=True)])
        vectorised = torch.func.vmap(function)

        def grouped(points, indices, *rows):
            group = max(1, _CHUNK_ELEMENTS // (indices.shape[-1] * self.datum_entries))
            if points.shape[0] <= group:
                return vectorised(points, indices, *rows)
            arguments = (points, indices, *rows)
            starts = range(0, points.shape[0], group)
            return torch.cat([vectorised(*(a[s : s + group] for a in arguments)) for s in starts])

        return grouped

    def check_vectorizable(self, point: torch.Tensor) -> None:
        """Try the gradient on one evaluation at ``point`` (a model that cannot be differentiated, computing
        with a NumPy copy of a parameter, is refused) and measure its :attr:`datum_entries` (the entries its
        forward pass keeps for the backward at two data less those at one), then try it vectorised on two;
        where :func:`torch.func.vmap` cannot batch the model, switch to one evaluation at a time and say why
        and what it costs."""
        indices = self._block_index[:1, :1].expand(2, 1)
        ones = torch.ones(2, 1, dtype=point.dtype, device=point.device)
        gradient = torch.func.grad(self.client_potential)
        try:  # one evaluation first: a model that cannot be differentiated at all is refused
            gradient(point, indices[0], ones[0], ones[0, 0])
        except RuntimeError as error:
            raise ValueError(
                f"The model's gradient cannot be taken (torch.func.grad: {error_reason(error)}). A model "
                "that computes with a NumPy copy of a parameter's value cannot be differentiated, by any "
                "gradient-based sampler: write those steps with torch operations."
            ) from error
        try:
            saved = [self._saved_entries(point, indices[0].expand(n), ones[0].expand(n)) for n in (1, 2)]
            self.datum_entries = max(1, saved[1] - saved[0])
        except RuntimeError:
            # plain autograd refuses what torch.func.grad takes (a Bernoulli of integer labels): the rows
            # are then grouped by the dimension, a bound as safe and less tight
            pass
        try:
            torch.func.vmap(gradient)(
                point.expand(2, -1),
                indices,
                ones,
                torch.zeros(2, dtype=point.dtype, device=point.device),
            )
        except RuntimeError as error:
            self.vectorized = False
            messages.warn(
                "pyro_fed cannot vectorise the model over clients (torch.func.vmap: "
                f"{error_reason(error)}); evaluating the {self.num_clients} clients one at a time instead, "
                f"about {self.num_clients} times slower per iteration, and without tracing or compilation. "
                "Common causes: a Python `if` on a parameter's value (use torch.where) or an in-place write "
                "of a parameter into a tensor made inside the model (build it with torch.cat or "
                "torch.stack).",
            )

    def _saved_entries(self, point: torch.Tensor, indices: torch.Tensor, datum_weights: torch.Tensor) -> int:
        """The entries of the tensors that :meth:`client_potential`'s forward pass at ``point`` on the data
        ``indices`` keeps for its backward pass (by autograd's saved-tensor hooks, which
        :func:`torch.func.grad` does not run): what a gradient holds at once."""
        count = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            count[0] += tensor.numel()
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            self.client_potential(point.detach().requires_grad_(), indices, datum_weights, datum_weights[0])
        return count[0]

    def prior_share(
        self, points: torch.Tensor, prior_weights: torch.Tensor, *, gradient: bool
    ) -> torch.Tensor:
        """:math:`\\varpi U^0` (``[m]``), or its gradient (``[m, d]``), at ``m`` points ``[m, d]`` with the
        prior weights ``[m]``: :meth:`client_potential` on one datum of weight 0."""
        m = points.shape[0]
        index = torch.zeros(m, 1, dtype=torch.long, device=points.device)
        arguments = (points, index, points.new_zeros(m, 1), prior_weights)
        return (self.gradient_fn if gradient else self.potential_fn)(*arguments)

    def full_gradient_fn(self, points: torch.Tensor) -> torch.Tensor:
        """Every client's full local gradient :math:`\\nabla U^i(x_i)` at its own point: ``points [m, b, d]``
        (client ``i`` at ``points[:, i]``) -> ``[m, b, d]``. Costs one full-data gradient per ``m``."""
        return self._sum_over_data(torch.func.grad(self.client_likelihood), points, gradient=True)

    def full_potential_fn(self, points: torch.Tensor) -> torch.Tensor:
        """Every client's full local potential :math:`U^i(x_i)`: ``points [m, b, d]`` -> ``[m, b]``."""
        return self._sum_over_data(self.client_likelihood, points, gradient=False)

    def _sum_over_data(self, likelihood: Callable, points: torch.Tensor, *, gradient: bool) -> torch.Tensor:
        """Each client's prior share :math:`\\varpi^i U^0` (:meth:`prior_share`, or its ``gradient``), once
        per point, plus ``likelihood`` (:meth:`client_likelihood` or its gradient) summed over the client's
        data blocks, every datum evaluated once at each of its client's ``m`` points. Vectorised over the
        blocks and, inside, over the ``m`` points, so that each block's data are read from the data tensors
        once for all ``m`` points (an index into them, under :func:`torch.func.vmap`, copies what it reads:
        reading them per point cost most of the time). The blocks leave the prior out: evaluated with each
        of them (as :math:`\\varpi^i / N_i` per datum), it cost a network of :math:`10^4` weights more than
        half of its gradient's time."""
        m, b, d = points.shape
        num_blocks, block = self._block_index.shape
        prior = self.prior_share(points.reshape(m * b, d), self._prior_weights.repeat(m), gradient=gradient)
        # in the points' dtype: a model may compute its prior in the default dtype, not the data's
        total = prior.reshape(m, b, *prior.shape[1:]).to(points.dtype)
        if self.vectorized:
            per_block = torch.func.vmap(torch.func.vmap(likelihood, in_dims=(0, None, None)))
        else:  # one evaluation at a time (see check_vectorizable)

            def per_block(block_points, *rows):
                return torch.stack(
                    [
                        torch.stack([likelihood(p, *row) for p in ps])
                        for ps, *row in zip(block_points, *rows, strict=True)
                    ]
                )

        # chunks bound the memory of the per-block terms (a traced graph unrolls this loop)
        chunk = max(1, _CHUNK_ELEMENTS // (m * d * block))
        for start in range(0, num_blocks, chunk):
            clients = self._block_client[start : start + chunk]
            terms = per_block(
                points[:, clients].transpose(0, 1),  # [c, m, d]: each block's client's m points
                self._block_index[start : start + chunk],
                self._block_weights[start : start + chunk],
            ).transpose(0, 1)  # [m, c, ...]
            total = total.index_add(1, clients, terms)
        return total
