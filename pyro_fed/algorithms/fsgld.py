r"""FSGLD — Federated stochastic gradient Langevin dynamics with conducive gradients.

Before sampling, every client :math:`i` fits a Gaussian **surrogate** of its own potential,

.. math::

    \tilde U^i(x) = \tfrac12 x^\top \Lambda_i x - \eta_i^\top x
    \ \big(= \tfrac12 (x - \mu_i)^\top \Lambda_i (x - \mu_i) + \text{const},\ \eta_i = \Lambda_i \mu_i\big),

in its natural parameters (the precision :math:`\Lambda_i` and the shift :math:`\eta_i`), uploads them once,
and the server sends back their sums :math:`\Lambda = \sum_i \Lambda_i`, :math:`\eta = \sum_i \eta_i`. Then
each **round** the server draws one client :math:`s \sim \mathrm{Cat}(p)` and sends it :math:`x`; the client
takes :math:`K` local Langevin steps with the **conducive gradient**

.. math::

    g(x) = \frac1{p_s} \Big(\hat\nabla U^s(x; S) - \nabla\tilde U^s(x)\Big)
    + \sum_{i=1}^b \nabla\tilde U^i(x), \qquad \nabla\tilde U^i(x) = \Lambda_i x - \eta_i, \qquad
    x \leftarrow x - \gamma\, g(x) + \sqrt{2\gamma}\, Z,

and returns :math:`x` to the server. Over the draw of :math:`s`, :math:`\mathbb E[g(x)] = \sum_i
\hat\nabla U^i(x) - \sum_i \nabla\tilde U^i(x) + \sum_i \nabla \tilde U^i(x)`: an unbiased estimate of
:math:`\nabla U = \sum_i \nabla U^i` whatever the surrogates, whose variance vanishes where they are exact
(with Gaussian clients and exact surrogates, :math:`g = \nabla U` and FSGLD is ULA on :math:`U`). Only the
round's client reads its data; the surrogates' sum stands in for the others.

An **iteration** is one local step; the reported draw is :math:`x` after it. Rounds are :math:`K` iterations
long, the first starting at iteration 0: the client of each round is a host coin drawn at the round's first
iteration (:func:`round_clients`: ``-1`` elsewhere, "the round goes on"), and the state keeps the round's
client, so that a round may straddle chunks. A round sends :math:`x` down to the client (``32 d`` bits) and
back up (``32 d`` bits). Each step's estimate is unbiased; with :math:`K > 1` and surrogates that are not
exact the chain is not (the product of :math:`K` steps with one random client does not average to :math:`K`
steps of the mean drift), which the exact laws of the tests measure on Gaussian clients.

The surrogates need not be proper Gaussians: only their gradients enter :math:`g` (an indefinite or singular
:math:`\Lambda_i` keeps the estimate unbiased). :func:`fit_surrogates` fits them as the second-order Taylor
expansion of each :math:`U^i` at a common point (the mode of :math:`U`); :func:`surrogates_from_moments`
takes them as means and precisions.

Tensors carry a leading chain dimension ``C``; the round coins and the noise are inputs of :func:`step`,
drawn ahead for a chunk, so that one iteration is a fixed sequence of tensor operations.

**Reference:** El Mekkaoui, Mesquita, Blomstedt, Kaski, *Federated stochastic gradient Langevin dynamics*,
UAI 2021, Section 3 (conducive gradients) and Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..engine.randomness import Randomness
from ..network.base import BITS_PER_FLOAT
from . import adaptation
from .base import Algorithm
from .langevin import langevin_step


class FsgldState(NamedTuple):
    server: torch.Tensor  #: the global iterate :math:`x`, ``[C, d]``
    #: the client :math:`s` of the current round (its global index), ``[C, 1]`` (long); ``-1`` before the
    #: first round
    client: torch.Tensor


class Surrogates(NamedTuple):
    r"""The clients' Gaussian surrogates :math:`\tilde U^i(x) = \frac12 x^\top \Lambda_i x - \eta_i^\top x`
    in natural parameters: the held clients' own, and the sums over all clients (what the server broadcasts
    once). The precisions are dense (``[..., d, d]``) or diagonal (``[..., d]``)."""

    precisions: torch.Tensor  #: :math:`\Lambda_i` of the held clients, ``[b, d, d]`` or ``[b, d]``
    shifts: torch.Tensor  #: :math:`\eta_i = \Lambda_i \mu_i` of the held clients, ``[b, d]``
    total_precision: torch.Tensor  #: :math:`\Lambda = \sum_i \Lambda_i`, ``[d, d]`` or ``[d]``
    total_shift: torch.Tensor  #: :math:`\eta = \sum_i \eta_i`, ``[d]``

    @property
    def dense(self) -> bool:
        """Whether the precisions are dense matrices (else diagonals)."""
        return self.precisions.dim() == 3

    def floats_per_client(self) -> int:
        """Floats each client uploads for its surrogate (and downloads of the sums): :math:`d^2 + d` dense,
        :math:`2d` diagonal."""
        d = self.shifts.shape[-1]
        return d * d + d if self.dense else 2 * d

    def to(self, reference: torch.Tensor) -> Surrogates:
        """On the device and of the dtype of ``reference``."""
        return Surrogates(*(t.to(reference) for t in self))


def surrogate_gradient(precision: torch.Tensor, shift: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    r""":math:`\nabla \tilde U(x) = \Lambda x - \eta` for a precision ``[..., d, d]`` (dense) or ``[..., d]``
    (diagonal), a shift ``[..., d]`` and points ``[..., d]``, broadcast together."""
    if precision.dim() == shift.dim() + 1:
        return (precision @ x[..., None])[..., 0] - shift
    return precision * x - shift


def with_totals(precisions: torch.Tensor, shifts: torch.Tensor, network) -> Surrogates:
    """The held clients' surrogates with their sums over all clients (by the ``network``: one meeting at
    set-up)."""
    if precisions.dim() == 3:
        b, d = shifts.shape
        total_precision = network.sum(precisions.reshape(b, d * d)).reshape(d, d)
    else:
        total_precision = network.sum(precisions)
    return Surrogates(precisions, shifts, total_precision, network.sum(shifts))


def fit_surrogates(
    client_gradients: Callable[[torch.Tensor], torch.Tensor],
    point: torch.Tensor,
    num_clients: int,
    network,
    *,
    dense: bool,
) -> Surrogates:
    r"""The surrogates as each client's second-order Taylor expansion at a common ``point`` :math:`\hat x`
    (``[d]``; the kernel takes the mode of :math:`U`):

    .. math::

        \Lambda_i = \nabla^2 U^i(\hat x), \qquad \eta_i = \Lambda_i \hat x - \nabla U^i(\hat x),

    so that :math:`\nabla \tilde U^i(x) = \nabla U^i(\hat x) + \Lambda_i (x - \hat x)`: a Laplace
    approximation of :math:`U^i` centred where the chains go rather than at the client's own mode, whose
    conducive error :math:`\nabla U^i - \nabla \tilde U^i` is :math:`O(\|x - \hat x\|^2)` in the posterior's
    bulk (a client's own mode may lie many posterior sds away), and which needs no search for a mode of
    :math:`U^i` (which a client whose data leave a direction unidentified may not have). Exact for Gaussian
    clients. With ``dense=False`` only the Hessian's diagonal is kept (:math:`2d` floats a client instead of
    :math:`d^2 + d`). Each client's work is local: :math:`d` Hessian-vector products (a full pass over its
    data per ``DIRECTIONS_PER_PASS`` of them, as the warm-up's) and one gradient.

    :param client_gradients: the clients' full gradients, points ``[m, b, d]`` -> ``[m, b, d]``,
        differentiable by :func:`torch.func.jvp`.
    :param network: sums the surrogates over the clients (:func:`with_totals`).
    """
    point = point.detach()
    gradients = client_gradients(point.expand(1, num_clients, -1).contiguous())[0]  # [b, d]
    if dense:
        hessians = adaptation.client_hessian_matrices(client_gradients, point, num_clients)
        precisions = (hessians + hessians.transpose(-1, -2)) / 2  # symmetric up to rounding: exactly
        shifts = (precisions @ point) - gradients
    else:
        precisions, _, _ = adaptation.client_hessians(client_gradients, point, num_clients, network)
        shifts = precisions * point - gradients
    return with_totals(precisions.detach(), shifts.detach(), network)


def surrogates_from_moments(means: torch.Tensor, precisions: torch.Tensor, network) -> Surrogates:
    r"""The surrogates :math:`\frac12 (x - \mu_i)^\top \Lambda_i (x - \mu_i)` of the held clients from their
    means ``[b, d]`` and precisions ``[b, d, d]`` or ``[b, d]`` (diagonal): :math:`\eta_i = \Lambda_i
    \mu_i`."""
    return with_totals(precisions, surrogate_gradient(precisions, torch.zeros_like(means), means), network)


def client_probabilities(sizes: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
    r"""The round's client law :math:`p` over all clients, ``[b]`` in float64: ``given`` normalised, or
    :math:`p_i = N_i / N` from every client's data size ``sizes`` (the paper's default: a client is chosen as
    often as its data would be by a uniform datum)."""
    weights = sizes.double() if given is None else torch.as_tensor(given, dtype=torch.float64)
    return (weights / weights.sum()).cpu()


def round_clients(
    rng: Randomness,
    probabilities: np.ndarray,
    first_iteration: int,
    num_iterations: int,
    num_chains: int,
    local_steps: int,
) -> np.ndarray:
    """``[K, C]`` host coins of the iterations ``first_iteration ..``: at the first iteration of a round (a
    multiple of ``local_steps``) the round's client, drawn from ``probabilities`` (``[b]``, float64) by
    inversion of a uniform per chain; ``-1`` at the others (the round goes on). With one client, no
    randomness is drawn. The uniforms come from the host stream one round at a time, so the clients drawn do
    not depend on how the iterations are split into chunks."""
    iterations = first_iteration + np.arange(num_iterations)
    starts = iterations % local_steps == 0
    clients = np.full((num_iterations, num_chains), -1, dtype=np.int64)
    count = int(starts.sum())
    if count == 0:
        return clients
    if len(probabilities) == 1:
        clients[starts] = 0
        return clients
    cumulative = np.cumsum(probabilities)
    uniforms = rng.host.random((count, num_chains)) * cumulative[-1]  # the sum is 1 up to rounding
    clients[starts] = np.minimum(np.searchsorted(cumulative, uniforms, side="right"), len(probabilities) - 1)
    return clients


def selected_gradient(
    gradients: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, local: torch.Tensor, num_held: int
) -> torch.Tensor:
    r"""The working client's minibatch gradient :math:`\hat\nabla U^s(x)`, ``[C, d]`` (meaningful in the
    chains whose client is held here; the caller zeroes the others), ``local`` (``[C]``) the client's row
    among the ``num_held`` held clients.

    The one place where the clients' gradients are read: the oracle ``gradients`` is asked for every held
    client at ``x`` broadcast to them (``[C, b, d]``) and the working client's row is taken (a gather). The
    oracle evaluates the working client alone (:meth:`Fsgld.working_clients`) and gives the others zeros, so
    an iteration costs one client's minibatch, not ``b`` of them."""
    rows = gradients(x.unsqueeze(-2).expand(*x.shape[:-1], num_held, x.shape[-1]))  # [C, b, d]
    return rows.gather(-2, local.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))[..., 0, :]


def conducive_gradient(
    x: torch.Tensor,
    client: torch.Tensor,
    own_gradient: Callable[[torch.Tensor], torch.Tensor],
    surrogates: Surrogates,
    inverse_probabilities: torch.Tensor,
    held: slice,
    network,
) -> torch.Tensor:
    r"""The conducive gradient :math:`g(x) = \frac1{p_s} (\hat\nabla U^s(x) - \nabla\tilde U^s(x)) +
    \Lambda x - \eta`, ``[..., d]``.

    :param x: the points ``[..., d]``.
    :param client: the working client :math:`s` of each point (global indices, ``[...]``).
    :param own_gradient: maps the working client's row among the held clients (``[...]``) to its gradient
        estimate at ``x``, ``[..., d]`` (:func:`selected_gradient`).
    :param surrogates: the held clients' :class:`Surrogates` and their sums.
    :param inverse_probabilities: :math:`1/p_i` of the held clients, ``[b]``.
    :param held: the global indices of the clients held here.
    :param network: where the working client's term, computed where it is held, meets the others (a sum of
        zeros but one).
    """
    here = (client >= held.start) & (client < held.stop)
    local = (client - held.start).clamp(0, held.stop - held.start - 1)
    difference = own_gradient(local) - surrogate_gradient(
        surrogates.precisions[local], surrogates.shifts[local], x
    )
    term = torch.where(here[..., None], inverse_probabilities[local][..., None] * difference, 0.0)
    return network.sum(term.unsqueeze(-2)) + surrogate_gradient(
        surrogates.total_precision, surrogates.total_shift, x
    )


def step(
    state: FsgldState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    chosen: torch.Tensor,
    surrogates: Surrogates,
    inverse_probabilities: torch.Tensor,
    held: slice,
    network,
    *,
    step_size: torch.Tensor,
) -> FsgldState:
    """One FSGLD iteration: the round's client (a new one where ``chosen`` says so) takes a Langevin step
    from :math:`x` with the conducive gradient.

    :param gradients: maps client points ``[C, b, d]`` (the held clients') to this iteration's minibatch
        gradients.
    :param noise: :math:`Z`, ``[C, d]``.
    :param chosen: ``[C]`` (long): the new round's client, or ``-1`` where the round goes on.
    :param step_size: :math:`\\gamma`, a tensor (see :func:`~pyro_fed.algorithms.langevin.langevin_step`).

    The other arguments are those of :func:`conducive_gradient`.
    """
    client = torch.where(chosen >= 0, chosen, state.client[:, 0])
    b = held.stop - held.start

    def own(local: torch.Tensor) -> torch.Tensor:
        return selected_gradient(gradients, state.server, local, b)

    grad = conducive_gradient(state.server, client, own, surrogates, inverse_probabilities, held, network)
    return FsgldState(langevin_step(state.server, grad, step_size, noise), client[:, None])


def estimate_noise(
    minibatch_gradients: Callable,
    points: torch.Tensor,
    surrogates: Surrogates,
    probabilities: torch.Tensor,
    network,
    local_steps: int,
) -> torch.Tensor:
    r"""``[R, P, 1, d]`` draws of the server's conducive gradient at ``P`` typical points ``points``, for the
    warm-up's measure of the gradient noise (the estimate is the server's: one "client"): on each of ``R``
    minibatches (``minibatch_gradients`` maps ``[P, d]`` to ``[R, P, b, d]``) a client drawn from
    ``probabilities`` (all clients', ``[b]``), from a stream of seed 0 that every holder of clients shares,
    so that the step chosen is the same however they are split.

    A round's client stays for ``local_steps`` :math:`K` iterations: its error is as persistent, and acts on
    the stationary law as a noise of :math:`K` times the variance (the long-run variance of a noise that is
    constant over rounds of :math:`K` iterations) while :math:`K` steps move little against the slowest
    relaxation: the draws' deviations from their mean are scaled by :math:`\sqrt K` (an upper bound, the
    minibatches' own part being fresh at every iteration)."""
    estimates = minibatch_gradients(points)  # [R, P, b, d]
    r, p, b, d = estimates.shape
    streams = Randomness(0, points.device)
    cumulative = probabilities.to(points.device, torch.float64).cumsum(0)
    uniforms = streams.uniform(r, p, dtype=torch.float64) * cumulative[-1]
    client = torch.searchsorted(cumulative, uniforms, right=True).clamp(max=len(cumulative) - 1)
    held = network.held(len(cumulative))
    inverse = (1.0 / probabilities[held]).to(points)

    def own(local: torch.Tensor) -> torch.Tensor:
        return estimates.gather(-2, local.view(r, p, 1, 1).expand(r, p, 1, d))[..., 0, :]

    at = points.expand(r, p, d)
    draws = conducive_gradient(at, client, own, surrogates, inverse, held, network)
    mean = draws.mean(0, keepdim=True)
    return (mean + local_steps**0.5 * (draws - mean))[..., None, :]


@dataclass(kw_only=True)
class Fsgld(Algorithm):
    """FSGLD as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param int local_steps: :math:`K`, the iterations of a round.
    :param client_probs: the round's client law as given, ``[b]`` (``None``: :math:`p_i = N_i / N`).
    :param surrogate_moments: the surrogates as given, ``(means, precisions)`` for every client in the global
        order (``None``: fitted at the run's mode).
    :param str surrogate_form: the fitted precisions' form: ``"auto"`` (dense up to
        ``DENSE_DIMENSIONS`` (200) coordinates), ``"dense"`` or
        ``"diagonal"``.

    Resolved for the run (:meth:`resolve`):

    :param surrogates: the held clients' :class:`Surrogates` and their sums.
    :param probabilities: :math:`p`, the round's client law over all clients, ``[b]`` (float64).
    """

    local_steps: int = 1
    client_probs: torch.Tensor | None = None
    surrogate_moments: tuple[torch.Tensor, torch.Tensor] | None = None
    surrogate_form: str = "auto"
    surrogates: Surrogates | None = None
    probabilities: torch.Tensor | None = None

    state_type = FsgldState

    #: the step moves the global iterate on an estimate of the whole potential's gradient
    server_step = True

    def __post_init__(self):
        self._fitted = None  # (potential, point, surrogates): the last surrogates fitted, kept for the run
        if self.network is None:
            return
        self._host_probabilities = self.probabilities.double().cpu().numpy()
        self._inverse = (1.0 / self.probabilities[self.held_clients]).to(self.device, self.dtype)
        self.surrogates = Surrogates(*(t.to(self.device, self.dtype) for t in self.surrogates))

    def resolve(self, run):
        surrogates = self.client_surrogates(run)
        # every client uploads its surrogate and downloads their sums, once for all chains: as many
        # averages of d floats as a surrogate holds
        run.network.record_averages(surrogates.floats_per_client() // run.dim, shared=True)
        return {"surrogates": surrogates, "probabilities": self.round_law(run)}

    def round_law(self, run) -> torch.Tensor:
        """:math:`p` over all the run's clients, ``[b]`` (float64): the given law normalised, or
        :math:`N_i / N`."""
        sizes = run.potential.all_client_sizes
        if self.client_probs is not None and len(self.client_probs) != len(sizes):
            raise ValueError(
                f"client_probs has {len(self.client_probs)} entries; the run has {len(sizes)} clients: give "
                "one positive number per client (in the global client order), or leave it None (p_i = N_i / "
                "N)."
            )
        return client_probabilities(sizes, self.client_probs)

    def client_surrogates(self, run, point: torch.Tensor | None = None) -> Surrogates:
        """The held clients' surrogates and their sums for ``run``: the given ones, or fitted at ``point``
        (default: the run's mode), fitted once per point and run."""
        pot = run.potential
        if self.surrogate_moments is not None:
            return self._given_surrogates(run)
        if point is None:
            # the point the surrogates are fitted at: the warm-up's mode, or one found by L-BFGS
            point = run.mode(
                "FSGLD's surrogates",
                "the surrogates are expanded there, which keeps the conducive gradient unbiased but noisier",
                "Give surrogates",
            )
        fitted = self._fitted
        if fitted is not None and fitted[0] is pot and torch.equal(fitted[1], point):
            return fitted[2]
        form = self.surrogate_form
        dense = form == "dense" or (form == "auto" and run.dim <= adaptation.DENSE_DIMENSIONS)
        surrogates = fit_surrogates(pot.full_gradient_fn, point, pot.num_clients, run.network, dense=dense)
        self._fitted = (pot, point.clone(), surrogates)
        return surrogates

    def _given_surrogates(self, run) -> Surrogates:
        means, precisions = (t.to(run.device, run.dtype) for t in self.surrogate_moments)
        b, d = len(run.potential.all_client_sizes), run.dim
        if means.shape != (b, d) or precisions.shape not in ((b, d, d), (b, d)):
            raise ValueError(
                f"surrogates: means of shape {tuple(means.shape)} and precisions of shape "
                f"{tuple(precisions.shape)}; the run has {b} clients and {d} unconstrained "
                f"coordinates: give means [{b}, {d}] and precisions [{b}, {d}, {d}] (or "
                f"[{b}, {d}], diagonal), for every client in the global order."
            )
        held = run.network.held(b)
        return surrogates_from_moments(means[held], precisions[held], run.network)

    def random_at_full_batch(self, run):
        # the round's client is random: with more than one client the estimate is noisy even on full data
        return run.network.num_clients > 1

    def adaptation_noise(self, minibatch_gradients, mode, points, run):
        return estimate_noise(
            minibatch_gradients,
            points,
            self.client_surrogates(run, mode).to(points),
            self.round_law(run),
            run.network,
            self.local_steps,
        )

    def upload_rate(self, run):
        # one client uploads d floats per round of local_steps iterations: 1 / (b K) of a round in which
        # every client does
        return 1.0 / (run.network.num_clients * self.local_steps)

    def init(self, positions):
        # no round yet: the first iteration's coin names its client
        client = torch.full((positions.shape[0], 1), -1, dtype=torch.long, device=positions.device)
        return FsgldState(positions.clone(), client)

    def coins(self, rng, first_iteration, num_iterations):
        chosen = round_clients(
            rng, self._host_probabilities, first_iteration, num_iterations, self.num_chains, self.local_steps
        )
        # the last iteration of a round: the client returns x
        ends = (first_iteration + np.arange(1, num_iterations + 1)) % self.local_steps == 0
        return {"client": chosen, "returned": np.repeat(ends[:, None], self.num_chains, 1)}

    def inputs(self, rng, coins):
        chosen = coins["client"]
        # the server's noise, the same on every holder (the working client's, in the paper)
        noise = rng.normal(chosen.shape[0], self.num_chains, self.dim, dtype=self.dtype)
        return noise, torch.as_tensor(chosen, device=self.device)

    def step(self, state, gradients, inputs, step_size):
        noise, chosen = inputs
        return step(
            state,
            gradients,
            noise,
            chosen,
            self.surrogates,
            self._inverse,
            self.held_clients,
            self.network,
            step_size=step_size,
        )

    #: one client works per iteration: the oracle evaluates it alone
    selects_clients = True

    def working_clients(self, coins, state):
        # each iteration's client: the round's, carried from the state through the iterations that go on
        chosen = coins["client"]  # [K, C], -1 where the round goes on
        latest = np.where(chosen >= 0, np.arange(len(chosen))[:, None], -1)
        latest = np.maximum.accumulate(latest, 0)  # the iteration that started each iteration's round
        before = np.broadcast_to(state.client[:, 0].cpu().numpy(), chosen.shape)
        client = np.where(latest >= 0, np.take_along_axis(chosen, latest.clip(0), 0), before)
        working = np.zeros((*chosen.shape, self.network.num_clients), dtype=bool)
        np.put_along_axis(working, client.clip(0)[..., None], (client >= 0)[..., None], -1)
        return working

    def points(self, state):
        return state.server.unsqueeze(-2)

    def summary(self, state):
        return {"position": state.server, "client": state.client[:, 0]}

    def traffic(self, coins):
        """A round's first iteration downloads :math:`x` to its client (``32 d`` bits), its last uploads it
        back (``32 d``); a round is a communication round."""
        starts = coins["client"] >= 0
        message = BITS_PER_FLOAT * self.dim
        return coins["returned"] * message, starts * message, starts

    def coin_statistics(self, coins):
        return {"new_round": coins["client"] >= 0}
