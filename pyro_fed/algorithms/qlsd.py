r"""QLSD — Quantised Langevin stochastic dynamics, and its variance-reduced variants.

The server holds :math:`\theta`. Each iteration every client is active with probability :math:`p` (the set
:math:`A`); an active client uploads a compressed gradient estimate, and the server takes one Langevin step:

.. math::

    g_i = Q(H^i - \eta^i), \qquad
    g = \frac{b}{|A|} \sum_{i \in A} g_i + \sum_{i=1}^b \eta^i, \qquad
    \theta \leftarrow \theta - \gamma g + \sqrt{2\gamma}\, Z, \qquad
    \eta^i \leftarrow \eta^i + \alpha g_i \ (i \in A),

where :math:`Q` is a compressor (:mod:`pyro_fed.network.compression`), :math:`\eta^i` a memory the server
mirrors (:math:`\alpha = 0`: none) and :math:`H^i` client :math:`i`'s estimate of :math:`\nabla U^i(\theta)`:

- no control variate (QLSD, QLSD#): :math:`H^i = \hat\nabla U^i(\theta; S^i)`;
- ``"fixed_point"`` (QLSD⋆): :math:`H^i = \hat\nabla U^i(\theta; S^i) - \hat\nabla U^i(\theta_\star; S^i)`,
  biased per client but unbiased in sum since :math:`\nabla U(\theta_\star) = 0`;
- ``"svrg"`` (QLSD++): :math:`H^i = \hat\nabla U^i(\theta; S^i) - \hat\nabla U^i(\zeta; S^i)
  + \nabla U^i(\zeta)` around a snapshot :math:`\zeta` that becomes :math:`\theta` every :math:`l`
  iterations (each client then computes its full local gradient there).

The three are one rule around a reference point :math:`\zeta` (fixed at :math:`\theta_\star`, or the
snapshot) with reference gradients :math:`G^i` (zero for the fixed point, :math:`\nabla U^i(\zeta)` for the
snapshot): :math:`H^i = \hat\nabla U^i(\theta; S) - \hat\nabla U^i(\zeta; S) + G^i`.

**Participation.** :math:`g` is defined only for a set :math:`A` that is not empty: the coins of an iteration
whose set is empty (probability :math:`(1 - p)^b`) are drawn again until one is not, i.e. :math:`A` is drawn
from the law of the independent coins conditioned on :math:`A \neq \emptyset` (:func:`participation_coins`).
Given :math:`|A| = k` the set is still a uniform :math:`k`-subset of the clients, so
:math:`E[\frac{b}{|A|} \sum_{i \in A} g_i \mid |A|] = \sum_i g_i` whatever the law of :math:`|A|`: the
estimate stays unbiased, and no iteration is a step without gradient. (Stepping then with the memories alone,
or with no gradient at all without memory, made the stationary law :math:`1/\sqrt{1 - (1 - p)^b}` times too
wide: 1.44 with 3 clients at :math:`p = 0.2`.) Only the clients of that set upload, and only their memories
move.

Tensors carry a leading chain dimension ``C``; the compressor's uniforms, the participation coins and the
server noise are inputs of :func:`step`, drawn ahead for a chunk (the coins on the host, for every client on
every process: each process knows whether a set is empty without a meeting).

**Reference:** Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic dynamics
for Bayesian federated learning*, AISTATS 2022, Algorithms 1 and 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..engine.randomness import Randomness
from . import levels, traffic
from .adaptation import control_variate_error, square_root, whiten
from .base import Algorithm
from .langevin import langevin_step


class QlsdState(NamedTuple):
    server: torch.Tensor  #: :math:`\theta`, ``[C, d]``
    memory: torch.Tensor  #: :math:`\eta^i`, ``[C, b, d]``
    reference: torch.Tensor  #: :math:`\zeta` (fixed point or snapshot), ``[C, d]``
    reference_grads: torch.Tensor  #: :math:`G^i`, ``[C, b, d]``


def init(positions: torch.Tensor, num_clients: int, reference_grads: Callable | None) -> QlsdState:
    """The server of chain ``c`` at ``positions[c]`` (``[C, d]``), no memory, and the reference point at the
    start (``reference_grads`` maps points ``[C, d]`` to the clients' full gradients ``[C, b, d]``; ``None``
    for no control variate or a fixed point, whose reference is set by :func:`with_reference`)."""
    c, d = positions.shape
    memory = positions.new_zeros(c, num_clients, d)
    grads = memory.clone() if reference_grads is None else reference_grads(positions)
    return QlsdState(positions.clone(), memory, positions.clone(), grads)


def with_reference(state: QlsdState, reference: torch.Tensor, grads: torch.Tensor) -> QlsdState:
    """``state`` with the reference point :math:`\\zeta` (``[C, d]``) and gradients :math:`G^i`
    (``[C, b, d]``)."""
    return state._replace(reference=reference, reference_grads=grads)


def position(state: QlsdState, network) -> torch.Tensor:
    """The reported draw: the server's :math:`\\theta`, ``[C, d]`` (the same wherever clients are held:
    the ``network`` is not needed, and taken for the signature every algorithm shares)."""
    return state.server


def memory_rate(control_variate: str | None, omega: float) -> float:
    """The memories' rate :math:`\\alpha` by default: :math:`1/(\\omega + 1)` for ``"svrg"`` (QLSD++, with
    :math:`\\omega` the compressor's variance bound), else 0 (no memory). Algorithm 2 of the paper."""
    return 1.0 / (omega + 1.0) if control_variate == "svrg" else 0.0


def snapshot(state: QlsdState, full_gradients: Callable) -> QlsdState:
    """QLSD++'s snapshot: the reference point becomes the server's :math:`\\theta` and each client computes
    its full local gradient there (``full_gradients`` maps ``[C, d]`` to ``[C, b, d]``)."""
    return with_reference(state, state.server.clone(), full_gradients(state.server))


def server_gradient(prior_gradient: Callable, state: QlsdState, control_variate: str | None) -> torch.Tensor:
    """The server's own term of :math:`g` when it holds the prior: :math:`\\nabla U^0(\\theta)`
    (``prior_gradient`` maps ``[C, d]`` to ``[C, d]``); with the fixed point's control variate, minus
    :math:`\\nabla U^0(\\theta_\\star)`, because the clients send differences of their likelihoods'
    gradients to the fixed point, whose sum there is :math:`-\\nabla U^0(\\theta_\\star)`, not 0."""
    prior = prior_gradient(state.server)
    if control_variate == "fixed_point":
        prior = prior - prior_gradient(state.reference)
    return prior


def estimates(
    state: QlsdState, gradients: Callable, control_variate: str | None, network, exact_gradients: bool = False
) -> torch.Tensor:
    """The clients' estimates :math:`H^i` of :math:`\\nabla U^i(\\theta)`, ``[C, b, d]``. With
    ``exact_gradients`` (full local batches) the SVRG estimate is :math:`\\nabla U^i(\\theta) - \\nabla
    U^i(\\zeta) + \\nabla U^i(\\zeta) = \\nabla U^i(\\theta)`: one evaluation, not two."""
    b = state.memory.shape[-2]
    server = network.broadcast(state.server, b)
    if control_variate is None or (control_variate == "svrg" and exact_gradients):
        return gradients(server)
    both = gradients(torch.stack([server, network.broadcast(state.reference, b)]))
    return both[0] - both[1] + state.reference_grads


def first_active(uniforms, participation: float, num_clients: int):
    r"""The first active client of a set drawn again because it was empty: the index :math:`J` of the first
    success of ``num_clients`` Bernoulli(:math:`p`) coins conditioned on at least one success,
    :math:`P(J \le j) = (1 - (1 - p)^{j+1}) / (1 - (1 - p)^b)`, by inversion of ``uniforms`` (a NumPy array
    or a tensor, in [0, 1)); as floats, of the uniforms' type."""
    log_idle = math.log1p(-participation)  # log(1 - p), p < 1
    some = -math.expm1(num_clients * log_idle)  # 1 - (1 - p)^b
    lib = torch if isinstance(uniforms, torch.Tensor) else np
    first = lib.ceil(lib.log1p(-uniforms * some) / log_idle) - 1
    return lib.clip(first, 0, num_clients - 1)  # rounding at the ends


def redrawn(first, later, clients):
    """The set drawn again: client ``first`` (``[...]``, from :func:`first_active`) and the clients after it
    whose own coin ``later`` (``[..., b]``, Bernoulli(:math:`p`)) is set; ``clients`` are the indices of the
    coins' clients (``[b]``: those held here). Given :math:`J`, the coins after it are independent and those
    before it unset: with :func:`first_active`'s law of :math:`J`, exactly the coins' law conditioned on a
    set that is not empty."""
    first = first[..., None]
    return (clients == first) | ((clients > first) & later)


def participation_coins(rng: Randomness, participation: float, *shape: int) -> np.ndarray:
    """Participation coins ``[*shape, b]`` on the host (``b = shape[-1]``, every client of the run): each
    client active with probability ``participation``, conditioned on at least one active client in each set
    (see the module's docstring). The sets that are not empty are the independent coins' draws; each empty
    one is drawn again with :func:`first_active` and :func:`redrawn`, from the same host stream, after the
    chunk's coins. With ``participation = 1`` every client, and no randomness drawn."""
    active = rng.coins(participation, *shape)
    empty = ~active.any(-1)
    count, b = int(empty.sum()), shape[-1]
    if count:
        first = first_active(rng.host.random(count), participation, b)
        active[empty] = redrawn(first, rng.host.random((count, b)) < participation, np.arange(b))
    return active


def step(
    state: QlsdState,
    gradients: Callable,
    noise: torch.Tensor,
    uniforms: torch.Tensor | None,
    active: torch.Tensor,
    network,
    compressor,
    *,
    step_size: torch.Tensor,
    memory_rate: float,
    control_variate: str | None,
    server_gradient: torch.Tensor | None = None,
    exact_gradients: bool = False,
) -> QlsdState:
    """One QLSD iteration.

    :param gradients: maps client points ``[..., C, b, d]`` to this iteration's minibatch gradients.
    :param noise: the server's Gaussian noise, ``[C, d]``.
    :param uniforms: the compressor's uniforms, ``[C, b, d]`` (``None`` for a deterministic compressor).
    :param active: which clients take part, ``[C, b]`` boolean.
    :param compressor: a :class:`~pyro_fed.network.compression.Compressor`.
    :param step_size: :math:`\\gamma` (a tensor: a scalar or per coordinate).
    :param float memory_rate: :math:`\\alpha`.
    :param control_variate: ``None``, ``"fixed_point"`` or ``"svrg"``.
    :param server_gradient: :math:`\\nabla U^0(\\theta)`, ``[C, d]``, when the server holds the prior.
    :param bool exact_gradients: the minibatches are the clients' full data (see :func:`estimates`).
    """
    uploads = compressor.compress(
        estimates(state, gradients, control_variate, network, exact_gradients) - state.memory, uniforms
    )
    uploads = torch.where(active[..., None], uploads, torch.zeros_like(uploads))
    estimate = aggregate(uploads, active, state.memory, network)
    if server_gradient is not None:
        estimate = estimate + server_gradient
    return state._replace(
        server=langevin_step(state.server, estimate, step_size, noise),
        memory=state.memory + memory_rate * uploads,
    )


def aggregate(
    uploads: torch.Tensor,
    active: torch.Tensor,
    memory: torch.Tensor,
    network,
    redraw: torch.Tensor | None = None,
) -> torch.Tensor:
    """The server's estimate :math:`g = \\frac{b}{|A|} \\sum_{i \\in A} g_i + \\sum_i \\eta^i`, ``[..., d]``,
    from the uploads ``[..., b, d]``, the participation ``[..., b]`` and the memories ``[..., b, d]``, summed
    over the clients by the ``network``. The iterations' sets are never empty (:func:`participation_coins`);
    given an empty one the first term is 0. With ``redraw`` (``[..., b]``, a set that is not empty) the sets
    found empty once summed are replaced by it: whether a set is empty is known only from the sum over all
    clients, so both sets' sums are taken in the same meeting (:func:`estimate_noise`, whose coins are drawn
    by blocks of clients)."""
    dtype = uploads.dtype
    zero = torch.zeros_like(uploads)
    # the sums in one meeting; the count of 0/1 floats is exact
    parts = [active[..., None].to(dtype), torch.where(active[..., None], uploads, zero), memory]
    if redraw is not None:
        parts += [redraw[..., None].to(dtype), torch.where(redraw[..., None], uploads, zero)]
    count, uploaded, memories, *again = network.sums(*parts)
    if redraw is not None:
        empty = count == 0
        count, uploaded = torch.where(empty, again[0], count), torch.where(empty, again[1], uploaded)
    weight = torch.where(count > 0, network.num_clients / count.clamp_min(1.0), torch.zeros_like(count))
    return weight * uploaded + memories


def estimate_noise(
    minibatch_gradients: Callable,
    mode: torch.Tensor,
    points: torch.Tensor,
    full_at_mode: torch.Tensor | None,
    network,
    compressor,
    *,
    control_variate: str | None,
    participation: float,
    memory_rate: float,
) -> torch.Tensor:
    """``[R, P, 1, d]`` draws of the server's whole estimate :math:`g` at ``P`` typical points ``points``
    (draws of the Laplace approximation around ``mode``), for the warm-up's measure of the gradient noise:
    the clients' estimates on ``R`` minibatches (``minibatch_gradients`` maps points ``[P, d]`` to ``[R, P,
    b, d]``; with a control variate, its error, :func:`~pyro_fed.algorithms.adaptation.control_variate_error`:
    at the mode a fixed point's estimate is exact), compressed, from the active clients, with the memories
    where they settle: at the clients' full gradients at the mode ``full_at_mode`` (``[b, d]``; needed for
    ``"svrg"`` or a memory), so that what is quantised is only the estimates' fluctuation. The server's
    estimate is one "client" (``b = 1``).

    The compressor's uniforms and the participation coins are drawn by blocks of clients from the streams of
    a :class:`~pyro_fed.engine.randomness.Randomness` of seed 0: each client's from its block's stream
    wherever it is held, so that the estimate, and the step chosen from it, is the same however the clients
    are split over processes (``network.held``). The participation follows the iterations' rule
    (:func:`participation_coins`): a second set of coins per block and a first active client
    (:func:`first_active`, from the stream all processes share) give each draw a set that is not empty,
    which replaces the first where that one is empty (:func:`aggregate`: both sums in one meeting)."""
    if control_variate is None:
        estimates = minibatch_gradients(points)
    else:
        estimates = control_variate_error(minibatch_gradients, mode, points)
    if control_variate == "svrg":
        estimates = estimates + full_at_mode
    *leading, _, d = estimates.shape  # [R, P, b, d]: the held clients
    everyone = network.num_clients
    held = network.held(everyone)
    streams = Randomness(0, mode.device)
    # each block of clients draws its uniforms, then its coins, from its own stream
    uniforms = streams.client_uniform(*leading, num_clients=everyone, held=held, dim=d, dtype=mode.dtype)
    coins = streams.client_uniform(*leading, num_clients=everyone, held=held, dim=1, dtype=mode.dtype)
    active = coins[..., 0] < participation
    redraw = None
    if participation < 1:
        later = streams.client_uniform(*leading, num_clients=everyone, held=held, dim=1, dtype=mode.dtype)
        first = first_active(streams.uniform(*leading, dtype=mode.dtype), participation, everyone)
        clients = torch.arange(held.start, held.stop, device=mode.device)
        redraw = redrawn(first, later[..., 0] < participation, clients)
    memory = full_at_mode.expand_as(estimates) if memory_rate > 0 else torch.zeros_like(estimates)
    uploads = compressor.compress(estimates - memory, uniforms)
    return aggregate(uploads, active, memory, network, redraw)[..., None, :]


@dataclass(kw_only=True)
class Qlsd(Algorithm):
    """The QLSD family as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param compressor: :math:`Q`, a :class:`~pyro_fed.network.compression.Compressor`.
    :param float participation: :math:`p`, each client's probability of being active per iteration.
    :param control_variate: ``None``, ``"fixed_point"`` or ``"svrg"``.
    :param float memory_rate: :math:`\\alpha` (``None``: :func:`memory_rate`'s default).
    :param snapshot_every: :math:`l`, the iterations between QLSD++'s snapshots (``"svrg"`` only; ``None``:
        resolved for the run, snapshots taking a tenth of its data evaluations, or none with full local
        batches, where the SVRG estimate is the exact gradient).
    :param fixed_point: :math:`\\theta_\\star`, ``[d]`` (for ``"fixed_point"``; ``None``: the run's mode).
    :param bool prior_on_server: the server holds the prior (the clients' estimates are of their likelihoods
        alone) and adds :math:`\\nabla U^0(\\theta)` to :math:`g`.
    :param bool automatic_levels: the warm-up chooses the quantisation levels
        (:func:`~pyro_fed.algorithms.levels.choose_levels`; ``compressor`` is then the one it measures the
        noise with, no compression) and the run's algorithm takes them.

    Resolved for the run (:meth:`resolve`):

    :param full_gradients: maps points ``[r, d]`` to every client's full local gradient, ``[r, b, d]``
        (for ``"svrg"``).
    :param prior_gradient: :math:`\\nabla U^0`, mapping ``[C, d]`` to ``[C, d]``, when the server holds the
        prior (``None``: the clients hold it).
    :param bool exact_gradients: the minibatches are the clients' full data.
    """

    compressor: object = None
    participation: float = 1.0
    control_variate: str | None = None
    memory_rate: float | None = None
    snapshot_every: int | None = None
    fixed_point: torch.Tensor | None = None
    prior_on_server: bool = False
    automatic_levels: bool = False
    full_gradients: Callable | None = None
    prior_gradient: Callable | None = None
    exact_gradients: bool = False

    state_type = QlsdState

    #: the server steps on the whole potential
    server_step = True

    def __post_init__(self):
        if self.network is not None and self.memory_rate is None:
            self.memory_rate = self.rate(self.dim)

    def rate(self, dim: int) -> float:
        """:math:`\\alpha` in ``dim`` dimensions: the given one, or :func:`memory_rate`'s default."""
        if self.memory_rate is not None:
            return float(self.memory_rate)
        return memory_rate(self.control_variate, self.compressor.omega(dim))

    def finish_adaptation(self, chosen, run):
        """The quantisation levels of fewest bits per unit of Langevin time where they are automatic, with the
        step that keeps the warm-up's accuracy at them (:func:`~pyro_fed.algorithms.levels.choose_levels`)."""
        if not self.automatic_levels or chosen is None:
            return chosen, self, []
        return levels.choose_levels(self, chosen, run), self, []

    def finish_window(self, algorithm, chosen, run):
        """Where the levels are automatic, the step the warm-up measured again from the chains' draws
        (uncompressed) shortened for the noise of the levels chosen before, which the run keeps
        (:func:`~pyro_fed.algorithms.levels.keep_levels`)."""
        if not self.automatic_levels:
            return chosen
        return levels.keep_levels(self, getattr(algorithm.compressor, "levels", None), chosen, run)

    def resolve(self, run):
        snapshot_every = self.snapshot_every
        if self.control_variate == "svrg" and snapshot_every is None and not run.exact_gradients:
            # with full local batches the SVRG estimate is the exact gradient: snapshots would be useless
            snapshot_every = math.ceil(1.0 / run.event_probability)
        prior_gradient = None
        if self.prior_on_server:  # the server's term of g
            prior_gradient = functools.partial(run.potential.server_prior, gradient=True)
        chosen = levels.chosen_compressor(run.chosen) if self.automatic_levels else None
        return {  # the memory rate is resolved in __post_init__, also for an algorithm built bound
            "compressor": self.compressor if chosen is None else chosen,
            "snapshot_every": snapshot_every,
            "full_gradients": run.full_gradients,
            "fixed_point": self.reference_point(run) if self.control_variate == "fixed_point" else None,
            "prior_gradient": prior_gradient,
            "exact_gradients": run.exact_gradients,
        }

    def reference_point(self, run) -> torch.Tensor:
        """QLSD⋆'s fixed point :math:`\\theta_\\star` for ``run``: the given one (checked), or the run's
        mode."""
        if self.fixed_point is not None:
            if self.fixed_point.shape != (run.dim,):
                raise ValueError(
                    f"fixed_point has shape {tuple(self.fixed_point.shape)}; the model has {run.dim} "
                    "unconstrained coordinates: give the flat unconstrained mode (or leave it None)."
                )
            return self.fixed_point
        return run.mode(
            "QLSD⋆'s fixed point", "QLSD⋆'s drift is off by the gradient left there", "Give fixed_point"
        )

    def participation_noise(self, chosen, run) -> float:
        r"""The variance that the random set of clients alone adds to the server's estimate (exact local
        gradients, no compression), per preconditioned coordinate, averaged over the warm-up's typical points,
        at its largest coordinate. Given :math:`|A| = k` the set is a uniform :math:`k`-subset, so
        :math:`\mathrm{Var}(\frac bk \sum_{i \in A} v_i) = b^2 (\frac1k - \frac1b) S^2`, :math:`S^2` the
        clients' variance (divisor :math:`b - 1`) of what they upload, :math:`v_i = H^i - \eta^i`: their
        gradients, less those at the reference point where a fixed point or a memory takes them off; averaged
        over :math:`k \sim` Binomial(:math:`b, p`) given :math:`k \ge 1`. One evaluation of the clients' full
        gradients at the points, and one meeting."""
        b, p = run.network.num_clients, self.participation
        if b == 1:
            return 0.0
        points = chosen.typical_points
        uploads = run.full_gradients(points)  # [P, b, d]: the held clients'
        if self.control_variate == "fixed_point" or self.rate(run.dim) > 0:
            fixed = self.control_variate == "fixed_point"
            reference = self.reference_point(run) if fixed else chosen.mode
            uploads = uploads - run.full_gradients(reference[None].to(points))
        whitened = whiten(square_root(chosen.preconditioner), uploads).double()
        total, squares = run.network.sums(whitened, whitened.square())
        spread = (squares - total.square() / b).clamp_min(0) / (b - 1)  # S^2, [P, d]
        # E[1/k - 1/b] for k ~ Binomial(b, p) given k >= 1
        k = torch.arange(1, b + 1, dtype=torch.float64)
        log_pmf = (
            math.lgamma(b + 1) - torch.lgamma(k + 1) - torch.lgamma(b - k + 1)
            + k * math.log(p) + (b - k) * math.log1p(-p)
        )  # fmt: skip
        weights = log_pmf.exp() / -math.expm1(b * math.log1p(-p))
        factor = b**2 * float((weights * (1 / k - 1 / b)).sum())
        return float((factor * spread).mean(0).max())

    def random_at_full_batch(self, run):
        return self.compressor.random or self.participation < 1

    def gradient_evaluations(self, minibatches):
        # theta and the reference point; SVRG with full local batches evaluates theta alone
        exact_svrg = self.control_variate == "svrg" and not minibatches
        return 1 if self.control_variate is None or exact_svrg else 2

    def adaptation_noise(self, minibatch_gradients, mode, points, run):
        rate = self.rate(run.dim)
        full = None
        if self.control_variate == "svrg" or rate > 0:
            full = run.potential.full_client_grads(mode)  # the clients' full gradients at the mode, once
        return estimate_noise(
            minibatch_gradients,
            mode,
            points,
            full,
            run.network,
            self.compressor,
            control_variate=self.control_variate,
            participation=self.participation,
            memory_rate=rate,
        )

    def init(self, positions):
        if self.control_variate == "svrg":
            return init(positions, self.num_held, self.full_gradients)
        state = init(positions, self.num_held, None)
        if self.control_variate == "fixed_point":
            point = self.fixed_point.to(positions).expand_as(positions).clone()
            state = with_reference(state, point, state.reference_grads)
        return state

    def coins(self, rng, first_iteration, num_iterations):
        chains = self.num_chains
        everyone = self.network.num_clients
        coins = {"active": participation_coins(rng, self.participation, num_iterations, chains, everyone)}
        if self.control_variate == "svrg" and self.snapshot_every is not None:
            # the snapshot is taken after iteration k when k + 1 is a multiple of l (theta_{k+1} = zeta)
            iteration = first_iteration + np.arange(1, num_iterations + 1)
            coins["snapshot"] = np.repeat((iteration % self.snapshot_every == 0)[:, None], chains, 1)
        return coins

    def inputs(self, rng, coins):
        leading = (len(coins["active"]), self.num_chains)
        noise = rng.normal(*leading, self.dim, dtype=self.dtype)
        active = self.held(torch.as_tensor(coins["active"], device=self.device), -1)
        if not self.compressor.random:
            return noise, active
        return noise, active, self.client_uniform(rng, *leading)

    def step(self, state, gradients, inputs, step_size):
        noise, active, *uniforms = inputs
        prior = None
        if self.prior_gradient is not None:
            prior = server_gradient(self.prior_gradient, state, self.control_variate)
        return step(
            state,
            gradients,
            noise,
            uniforms[0] if uniforms else None,
            active,
            self.network,
            self.compressor,
            step_size=step_size,
            memory_rate=self.memory_rate,
            control_variate=self.control_variate,
            server_gradient=prior,
            exact_gradients=self.exact_gradients,
        )

    @property
    def selects_clients(self) -> bool:
        # the idle clients' uploads are zeros (step): their gradients are never read
        return self.participation < 1

    def working_clients(self, coins, state):
        return coins["active"]

    def points(self, state):
        return state.server.unsqueeze(-2)

    def summary(self, state):
        return {"position": position(state, self.network)}

    def traffic(self, coins):
        # a snapshot sends theta to every client
        message = self.compressor.bits(self.dim)
        active = coins["active"].sum(-1)
        return traffic.server(active, message, self.num_clients, self.dim, coins.get("snapshot"))

    def coin_statistics(self, coins):
        stats = {"active_clients": coins["active"].sum(-1)}
        if "snapshot" in coins:
            stats["snapshot"] = coins["snapshot"]
        return stats

    def event_iterations(self, coins):
        return coins["snapshot"].any(1) if "snapshot" in coins else super().event_iterations(coins)

    def event(self, state, coins):
        return lambda after: snapshot(after, self.full_gradients)
