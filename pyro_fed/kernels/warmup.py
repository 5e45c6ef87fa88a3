"""The kernels' warm-up: the step size, the preconditioner, the minibatch size and the thinning chosen from
the model's curvature and gradient noise (:mod:`pyro_fed.algorithms.adaptation`), with the potential's
federated gradients."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import messages
from ..algorithms import adaptation
from ..algorithms import mode as mode_search
from ..algorithms.mode import MODE_TOLERANCE, MODE_WARNING, ModeSearch, newton_decrement
from ..data.minibatch import client_batch_sizes
from ..engine.chunk_engine import ChunkEngine
from ..engine.randomness import Randomness
from ..network.in_process import InProcessNetwork

#: minibatches drawn per client and point to measure the gradient noise (the relative standard error of a
#: variance from R draws is about sqrt(2 / R): 18% here)
NOISE_DRAWS = 64
#: the data evaluations (draws x points x all clients' minibatches) above which the noise is measured with
#: fewer draws, as many as these evaluations allow (at least ``MIN_NOISE_DRAWS``): only many clients reach
#: it (at least 256 of a full probe, ``PROBE_BATCH`` points, each), and the noise the step sees is their
#: sum, whose relative error falls as the square root of their number (8 draws of 256 clients: about 3%,
#: below one client's 18% at 64 draws). 10^4 clients of 10 points measured 64 draws in 15 of the set-up's
#: 30 s (128 full-data passes; 2 s with 8 draws, the same choices)
NOISE_EVALUATIONS = 2**20
#: the fewest draws of the noise measurement
MIN_NOISE_DRAWS = 8
#: draws of the Laplace approximation at which the stiffness (its largest, with the mode's) and the gradient
#: noise (averaged) are measured
TYPICAL_POINTS = 4
#: with ``gradient_mode="auto"``, the pilot's iteration is compiled when it plans at least this many (a
#: compilation takes one to 20 seconds and makes an iteration several times faster; a rule on the plan, not
#: on timings, so that the pilot, and with it the step, is the same in every run)
PILOT_COMPILE_ITERATIONS = 5000
#: searches for the mode again, in the Laplace approximation's coordinates, when the Hessian shows that the
#: first one stopped short (each costs the Hessian again)
MODE_REFINEMENTS = 2
#: the slope of the potential (nats per unconstrained unit) along a coordinate without curvature at which a
#: mode search's end is taken for a run-away (see ``_check_mode_exists``): a funnel of ``G`` effects has
#: ``G - 1`` along its log scale
RUNAWAY_GRADIENT = 1.0


class Sampler(NamedTuple):
    """What the warm-up must know of the sampler it adapts, given by its kernel."""

    #: the algorithm's name, for messages
    name: str
    #: the user's step size (``None``: to choose)
    step_size: float | None
    #: the user's thinning (``None``: to choose)
    thinning: int | None
    #: the user's minibatch size
    batch_size: int | float | str | None
    #: whether the warm-up chooses the minibatch size
    chooses_batch_size: bool
    #: whether a server steps on the whole potential (QLSD), rather than every client on its own
    server_step: bool
    #: whether the step is set for the clients' average, one step of gamma / b on U (FALD's family: see
    #: :meth:`~pyro_fed.algorithms.base.Algorithm.average_step`)
    average_step: bool
    #: whether the gradient estimates are random even with full local batches
    random_at_full_batch: bool
    #: evaluations of each datum of a minibatch per iteration (2 for a control variate's two points)
    gradient_evaluations: int
    #: ``(minibatch_gradients, mode, points) -> [R, P, b, d]``: draws of what makes the estimates noisy
    #: (:meth:`pyro_fed.algorithms.base.Algorithm.adaptation_noise`)
    adaptation_noise: Callable
    #: the sampler's step size from the adaptation's step (a client's, or the server's)
    chosen_step: Callable[[float], float]
    #: how the pilot's iteration runs (see :mod:`pyro_fed.engine.compile`)
    gradient_mode: str


def adapt(
    pot,
    sampler: Sampler,
    start: torch.Tensor,
    seed: int,
    inverse_mass: torch.Tensor | Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    form: str = "auto",
    max_pilot_iterations: float = 0,
    draws: torch.Tensor | None = None,
) -> adaptation.Adaptation:
    """Choose what the user left automatic in a ``sampler`` (its ``step_size``, ``preconditioner``,
    ``batch_size`` and ``thinning``) from the curvature of the potential ``pot`` at the mode found from
    ``start`` (``[d]``) and at typical points, and from the sampler's gradient noise; the bits the clients
    upload for it are counted on the potential's network, on the first chain (the choice serves every chain).
    ``inverse_mass`` is the user's, if given, or the sampler's own from the Hessian diagonal of :math:`U` at
    the mode (a function of it, which may return ``None``: see
    :meth:`~pyro_fed.algorithms.base.Algorithm.warmup_preconditioner`); otherwise one of ``form``
    (``"diagonal"``, ``"dense"`` or ``"auto"``: dense when ``d`` is at most ``DENSE_DIMENSIONS`` and the
    diagonal one leaves a condition number above :func:`~pyro_fed.algorithms.adaptation.dense_condition`, see
    :mod:`pyro_fed.algorithms.adaptation`) is adapted. ``seed`` seeds the minibatches of the noise
    measurement: the choice depends on neither the number of chains nor their randomness, nor does the pilot
    run that checks the step (at most ``max_pilot_iterations`` per iteration of a draw: the kernels pass their
    warm-up's upload rounds, see ``upload_rate``). ``draws`` (``[P, d]``), draws of the posterior (the chains'
    own, when the preconditioner is measured again from them), are the typical points where the stiffness and
    the noise are measured and the pilot starts; by default, draws of the Laplace approximation pulled to the
    potential level of posterior draws (:func:`~pyro_fed.algorithms.adaptation.typical_points`)."""
    mode, inverse_mass, curvature, clients, condition, slowest, decrement, rounds = _mode_and_preconditioner(
        pot, start, inverse_mass, form
    )
    root = adaptation.square_root(inverse_mass)
    # typical points of the posterior, where the chains will be: the stiffness (with the mode's) and the
    # noise are measured there; each client uploads its potential at the points (scalars, not counted)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    laplace = torch.randn(TYPICAL_POINTS, pot.dim, generator=generator, dtype=mode.dtype, device="cpu")
    laplace = laplace.to(mode.device)
    if draws is None:
        points = adaptation.typical_points(pot.total_potentials, mode, adaptation.whiten(root, laplace))
    else:
        points = draws.to(mode.device, mode.dtype)
    at_points, clients_per_step, stiffness_rounds, _ = _stiffness(
        pot, sampler, torch.cat([mode[None], points]), root
    )
    # the step is set for the typical points' root mean square stiffness, kept stable at the mode's too
    largest = float(at_points.max())
    stiffness = adaptation.step_stiffness(at_points[1:], largest)
    rounds += stiffness_rounds
    batch, noise, noise_rounds = _batch_and_noise(
        pot, sampler, seed, mode, points, root, stiffness, clients_per_step
    )
    rounds += noise_rounds
    step, pilot_iterations, pilot_time = sampler.step_size, 0, 0.0
    thinning, relaxation = sampler.thinning or 1, float("nan")
    if step is None:
        client_step = adaptation.step_size(stiffness, noise, clients_per_step)
        # the pilot's budget is per iteration of a draw: the thinning of the step before the pilot
        draws = adaptation.thinning_for(client_step / clients_per_step, slowest)
        client_step, stiffness, largest, pilot_rounds, pilot_iterations, pilot_time = _pilot(
            pot, sampler, points, at_points[1:], largest, root, client_step, clients_per_step, generator,
            math.ceil(max_pilot_iterations * (sampler.thinning or draws)), noise,
        )  # fmt: skip
        rounds += pilot_rounds
        step = sampler.chosen_step(client_step)
        relaxation = adaptation.relaxation_time(client_step / clients_per_step, slowest)
        if sampler.thinning is None:
            thinning = adaptation.thinning_for(client_step / clients_per_step, slowest)
    pot.network.record_averages(rounds, shared=True)
    return adaptation.Adaptation(
        step, inverse_mass, mode, curvature, stiffness, noise, rounds, condition, points, pilot_iterations,
        pilot_time, decrement, batch, thinning, slowest, clients, largest, relaxation,
    )  # fmt: skip


def _mode_and_preconditioner(pot, start: torch.Tensor, given, form: str):
    """The mode (by L-BFGS from ``start``, then checked with the Hessian there: refined in the coordinates
    that the Laplace approximation whitens while its Newton decrement exceeds ``MODE_TOLERANCE``, at most
    ``MODE_REFINEMENTS`` times, and reported with a warning if it then exceeds ``MODE_WARNING``; above
    ``ESTIMATED_DIAGONAL_ABOVE`` coordinates the curvature is measured again only where a refinement moved
    more than a posterior sd), the inverse mass, the Hessian diagonal and each client's, the condition
    number, the slowest curvature, the decrement and the rounds of uploads."""
    search = find_mode(pot, start)
    rounds, measured_at, laplace = search.evaluations, None, None
    for refinement in range(MODE_REFINEMENTS + 1):
        # above ESTIMATED_DIAGONAL_ABOVE, where the curvature costs 8 passes or more, a refinement that
        # moved less than a posterior sd from where it was measured keeps it (a network of 3,020 weights:
        # 79 s a measure, three of them in a 452 s set-up)
        if (
            measured_at is None
            or pot.dim <= adaptation.ESTIMATED_DIAGONAL_ABOVE
            or float(((search.point - measured_at).square() / laplace).sum().sqrt()) > 1.0
        ):
            inverse_mass, curvature, clients, condition, slowest, laplace, hessian_rounds = _preconditioner(
                pot, search, given, form, start
            )
            rounds, measured_at = rounds + hessian_rounds, search.point
        decrement = newton_decrement(search.gradient, laplace)
        if decrement <= MODE_TOLERANCE or refinement == MODE_REFINEMENTS:
            break
        search = find_mode(pot, search.point, inverse_hessian=laplace)
        rounds += search.evaluations
    if decrement > MODE_WARNING:
        messages.warn(
            f"pyro_fed's warm-up did not reach the mode of the potential: after {rounds} rounds its gradient "
            f"there is {decrement:.3g} posterior standard deviations from stationary (the Newton decrement "
            f"with the Laplace approximation's covariance; the search aims at {MODE_TOLERANCE}). The "
            "preconditioner, the step and the chains' starts were measured there. A posterior with many "
            "modes or none (a flat or improper direction) does this: check the model, or give step_size and "
            "initial_params.",
        )
    return search.point, inverse_mass, curvature, clients, condition, slowest, decrement, rounds


def _check_mode_exists(pot, start: torch.Tensor, search: ModeSearch, curvature: torch.Tensor) -> None:
    r"""Refuse the end of a mode search from which the potential still falls without bound: where its
    curvature (the Hessian diagonal ``curvature``) is infinite, or along a coordinate whose curvature is
    below ``CURVATURE_FLOOR`` of the largest (flat, to the preconditioner) while the potential falls by at
    least ``RUNAWAY_GRADIENT`` per unit of it (a flat direction of a proper mode has no slope). That is a
    posterior with no mode, typically Neal's funnel of a hierarchical model written centred: with the
    effects ``a ~ Normal(mu, tau)`` all at ``mu``, :math:`U` falls as :math:`(G - 1) \log \tau` for ``G``
    effects, a slope of ``G - 1`` along :math:`\log\tau` with no curvature, and the search follows it
    until the curvature of the effects overflows. Left alone, the dense preconditioner's eigendecomposition
    failed there (infinite entries), or the chains started at :math:`\tau = e^{-18}` and never moved."""
    magnitude = curvature.abs()
    finite = magnitude[magnitude.isfinite()]
    floor = adaptation.CURVATURE_FLOOR * float(finite.max()) if len(finite) else 0.0
    slope = search.gradient.abs().to(magnitude.device)
    runaway = ~magnitude.isfinite() | ((magnitude <= floor) & (slope >= RUNAWAY_GRADIENT))
    if bool(runaway.any()):
        raise _no_mode(pot, start, search.point, runaway)


def _no_mode(pot, start: torch.Tensor, point: torch.Tensor, runaway: torch.Tensor) -> ValueError:
    """The error of a mode search that ran off (:func:`_check_mode_exists`), named with the coordinates that
    ran farthest from the start and those where the potential has no curvature to stop it, and the fix for
    the effects it found collapsed: a site of several coordinates that all ended at one value (a funnel's
    effects all run to their mean), or ``'a'`` when none did."""
    names = pot.space.coordinate_names
    collapsed = [
        s.name
        for s in pot.latent_sites
        if s.stop - s.start > 1
        and float(point[s.start : s.stop].std()) <= 1e-3 * (1 + float(point[s.start : s.stop].abs().max()))
        and float(start[s.start : s.stop].std()) > 1e-3 * (1 + float(start[s.start : s.stop].abs().max()))
    ]
    effects = repr(collapsed[0]) if collapsed else "'a'"
    moved = (point - start).abs().cpu()
    farthest = [int(j) for j in moved.argsort(descending=True)[:3] if moved[j] > 1]
    ran = ", ".join(f"{names[j]} {float(start[j]):.3g} -> {float(point[j]):.3g}" for j in farthest)
    where = [names[j] for j in runaway.nonzero().flatten().tolist()]
    return ValueError(
        "pyro_fed's warm-up found no mode of the posterior: its mode search ran to where the potential "
        f"falls without bound or its curvature is infinite (in {', '.join(where[:6])}"
        f"{', ...' if len(where) > 6 else ''})"
        + (f"; the farthest coordinates (unconstrained) {ran}" if ran else "")
        + (
            f"; the coordinates of {', '.join(map(repr, collapsed))} all ran to one value"
            if collapsed
            else ""
        )
        + ". A density that grows without bound has no mode; most often it is a hierarchical model written "
        "centred, whose effects' scale can shrink to zero (Neal's funnel: effects ~ Normal(mu, tau) as "
        "tau -> 0, every effect at mu). Write those effects non-centred, as one does for NUTS: "
        f"pyro.poutine.reparam(model, config={{{effects}: "
        "pyro.infer.reparam.LocScaleReparam(centered=0.0)}) "
        f"(the kernel then samples {effects[:-1]}_decentered'; to_inference_data's posterior holds {effects} "
        "too), or "
        "give the scale a prior that keeps it away from zero."
    )


def _batch_and_noise(
    pot, sampler: Sampler, seed, mode, points, root, stiffness: float, clients_per_step: int
):
    """The minibatch size (the user's, or chosen: :func:`~pyro_fed.algorithms.adaptation.choose_batch_size`
    at the step the ``stiffness`` allows), the gradient noise of the sampler's estimator with it (0 for exact
    gradients) and the rounds of uploads the measurements cost (each client uploads its variances)."""
    if not sampler.chooses_batch_size:
        batch = None if sampler.batch_size == "full" else sampler.batch_size
        if batch is None and not sampler.random_at_full_batch:
            return None, 0.0, 0
        profile, drawn = _noise_profile(pot, sampler, seed, mode, points, root, batch)
        if batch is not None and not drawn:
            _warn_blind(sampler, f"the step is chosen as if batch_size={batch} added none (too large a step)")
        return batch, adaptation.gradient_noise(profile, pot.network, not sampler.server_step), 1
    # each client's probe, for all clients wherever they are held (the minibatch sampler's rule), and the
    # held clients' own
    sizes, probe = pot.client_sizes, adaptation.probe_batch_sizes(pot.all_client_sizes)
    held_probe = probe[pot.network.held(len(probe))]
    full = None
    if sampler.random_at_full_batch:
        full, _ = _noise_profile(pot, sampler, seed, mode, points, root, None)
    probed, drawn = _noise_profile(pot, sampler, seed, mode, points, root, probe)
    if not drawn:  # a measure blind to the minibatch: full local batches, whose noise it does measure
        _warn_blind(sampler, "it keeps full local batches (or give batch_size)")
        noise = 0.0 if full is None else adaptation.gradient_noise(full, pot.network, not sampler.server_step)
        return None, noise, 1 + (sampler.random_at_full_batch or 0)
    full = torch.zeros_like(probed) if full is None else full
    allowed = adaptation.batch_noise_allowance(stiffness, clients_per_step)
    # the clients' own estimates, or a server's of their sum (one row: said, as a process holding one
    # client has one row too)
    per_client = not sampler.server_step
    batch = adaptation.choose_batch_size(
        full, probed, sizes, held_probe, allowed, sampler.gradient_evaluations, pot.network, per_client
    )
    noise = adaptation.batch_noise(
        full, probed, sizes, held_probe, batch or int(pot.all_client_sizes.max()), pot.network, per_client
    )
    return batch, noise, 1 + (sampler.random_at_full_batch or 0)


def _noise_profile(pot, sampler: Sampler, seed, mode, points, root, batch) -> tuple[torch.Tensor, bool]:
    """The noise profile (:func:`~pyro_fed.algorithms.adaptation.noise_profile`) of the sampler's estimate
    at the typical ``points`` with minibatches of ``batch`` (``None``: full local batches), from its
    ``adaptation_noise``, and whether that drew the minibatch estimates it was given (one that never does
    reports every minibatch as noiseless as the full data: an own algorithm's ``adaptation_noise`` on exact
    gradients made the warm-up choose one point per client, and its posterior 60-100% too wide)."""
    drawn = []
    minibatch_gradients = _minibatch_gradients(pot, seed, batch)

    def recorded(at: torch.Tensor) -> torch.Tensor:
        drawn.append(True)
        return minibatch_gradients(at)

    draws = sampler.adaptation_noise(recorded, mode, points)
    if draws.dim() != 4 or draws.shape[1] != len(points) or draws.shape[-1] != pot.dim:
        raise ValueError(
            f"{sampler.name}.adaptation_noise returned shape {tuple(draws.shape)}: it must "
            f"return [R, P, b, d] draws (R draws at each of the P = {len(points)} points it is given, "
            f"b clients, or 1 for a server's estimate, d = {pot.dim})."
        )
    return adaptation.noise_profile(draws, root), bool(drawn)


def _warn_blind(sampler: Sampler, consequence: str) -> None:
    """The warning for an ``adaptation_noise`` that never drew the minibatch estimates it was given."""
    messages.warn(
        f"{sampler.name}.adaptation_noise never called the minibatch_gradients it was given, so the warm-up "
        f"cannot measure what a minibatch adds to the gradient noise: {consequence}. Draw the clients' "
        "estimates from minibatch_gradients(points) there (see "
        "pyro_fed.algorithms.base.Algorithm.adaptation_noise).",
    )


def _pilot(
    pot, sampler: Sampler, points, measured, largest, root, step, clients_per_step, generator, max_iterations,
    noise,
):  # fmt: skip
    """The step after the pilot run from the typical ``points`` (:func:`~pyro_fed.algorithms.adaptation.
    pilot_step`; ``measured``: their stiffness, ``largest``: the largest with the mode's, ``step``: the rule's
    for them, which plans the pilot's iterations), the stiffness it is set for, the largest measured, the
    rounds of uploads it cost, its iterations and the Langevin time they covered. Its iterations run on the
    engine of the chains (:mod:`pyro_fed.engine.chunk_engine`), compiled when at least
    ``PILOT_COMPILE_ITERATIONS`` are planned."""
    stiffness_rounds, directions = [0], [None]

    def iteration(state, inputs, constants):
        h, root = constants
        return (adaptation.langevin_move(pot.total_gradient, state[0], inputs[0], h, root),), ()

    # every pilot iteration sums the clients' gradients: eagerly through a network that cannot be traced
    mode = sampler.gradient_mode if pot.gradients.vectorized and pot.network.traceable else "eager"
    if mode == "auto":  # decided from the iterations planned, not from timings: the same choice every run
        planned = adaptation.PILOT_CHECKS * math.ceil(
            adaptation.PILOT_DURATION * clients_per_step / (adaptation.PILOT_CHECKS * step)
        )
        mode = "compiled" if min(planned, max_iterations) >= PILOT_COMPILE_ITERATIONS else "traced"
    engine = ChunkEngine(iteration, mode, what="the warm-up's pilot iteration")

    def move(x: torch.Tensor, noise: torch.Tensor, h: float) -> torch.Tensor:
        (x,), _ = engine.run((x,), (noise,), (x.new_tensor(h), root), 0, len(noise))
        return x

    def stiffness(x: torch.Tensor) -> torch.Tensor:
        # from the last check's directions, which the particles' small moves barely change: a few power
        # iterations, to the 1% that a step needs
        at, _, rounds, directions[0] = _stiffness(
            pot, sampler, x, root, start=directions[0], tolerance=adaptation.PILOT_TOLERANCE
        )
        stiffness_rounds[0] += rounds
        return at

    step, typical, largest, iterations, elapsed = adaptation.pilot_step(
        move, stiffness, points, measured, largest, clients_per_step, generator,
        max_iterations=max_iterations, noise=noise,
    )  # fmt: skip
    # each pilot iteration is a round per particle: every client uploads its gradient there
    return step, typical, largest, iterations * len(points) + stiffness_rounds[0], iterations, elapsed


def _preconditioner(pot, search: ModeSearch, given, form: str, start: torch.Tensor):
    """The inverse mass (the ``given`` one: a tensor, or a function of the Hessian diagonal at the mode
    returning one or ``None``; else one of ``form`` from the clients' Hessians at the mode), the Hessian
    diagonal of :math:`U` and each client's, the condition number the diagonal form leaves (``nan`` when the
    Hessian is not gathered), the slowest preconditioned curvature (the smallest eigenvalue of :math:`R^\top
    H R` when the Hessian is gathered, else the smallest diagonal entry, which bounds it from above), the
    Laplace approximation's covariance (dense when gathered, else its diagonal: the metric of the mode's
    Newton decrement) and the rounds of uploads it cost, at the end of the mode ``search`` from ``start``.
    A search that ran off to where the density grows without bound is refused there (:func:`_no_mode`)."""
    mode = search.point
    gather = form == "dense" or (form == "auto" and pot.dim <= adaptation.DENSE_DIMENSIONS)
    # each client uploads its Hessian (d^2 floats; the server sends the dense preconditioner back), or its
    # diagonal (and its estimate's groups)
    diagonals, hessian, rounds = adaptation.client_hessians(
        pot.full_gradient_fn, mode, pot.num_clients, pot.network, total=gather
    )
    curvature = pot.network.sum(diagonals)
    if pot.prior_on_server:  # the server's own share of the curvature

        def prior_gradient(points: torch.Tensor) -> torch.Tensor:
            return pot.server_prior(points.reshape(-1, pot.dim), gradient=True).reshape(points.shape)

        # the server's own: not summed over clients
        prior_diagonal, prior_hessian, _ = adaptation.client_hessians(
            prior_gradient, mode, 1, InProcessNetwork(), total=gather
        )
        curvature = curvature + prior_diagonal[0]
        hessian = None if hessian is None else hessian + prior_hessian
    if hessian is not None and not bool(hessian.isfinite().all()):
        curvature = curvature + float("inf")  # reported as infinite wherever it is
    _check_mode_exists(pot, start, search, curvature)
    diagonal = adaptation.preconditioner(curvature)
    laplace = diagonal if hessian is None else adaptation.dense_preconditioner(hessian)
    if callable(given):  # the sampler's own inverse mass from the curvature (pSGLD's stationary G)
        given = given(curvature)
    inverse_mass, condition = diagonal if given is None else given, float("nan")
    if hessian is not None:
        curvatures = adaptation.preconditioned_curvatures(hessian, diagonal)
        condition = adaptation.condition_number(curvatures)
        if given is None and (form == "dense" or condition > adaptation.dense_condition(pot.dim)):
            inverse_mass = laplace
        if inverse_mass is not diagonal:
            curvatures = adaptation.preconditioned_curvatures(hessian, inverse_mass)
        slowest = float(curvatures.min())
    else:
        marginal = inverse_mass if inverse_mass.dim() == 1 else inverse_mass.diagonal()
        slowest = float((marginal * curvature.abs()).min())
    return inverse_mass, curvature, diagonals, condition, slowest, laplace, rounds


def _stiffness(
    pot, sampler: Sampler, points: torch.Tensor, root: torch.Tensor, **options
) -> tuple[torch.Tensor, int, int, torch.Tensor]:
    """The stiffness that bounds the step at each of ``points`` (``[P]``); the clients per step it is for
    (``adaptation.step_size``'s ``num_clients``); the rounds of uploads it cost; and the power iteration's
    last directions (``options`` go to :func:`~pyro_fed.algorithms.adaptation.client_stiffness`)."""
    if sampler.server_step or sampler.average_step:
        # the server steps on the whole potential, or the clients' steps from their common average are one
        # step of gamma / b on it: the stiffness of the sum of the clients' Hessians (per client, then)
        def total_products(at: torch.Tensor, tangents: torch.Tensor) -> torch.Tensor:
            # the Hessian of U times the tangents [P, 1, d]: each client's product, summed by the network
            # (a derivative of the network's sum would not cross it), and the server's own
            clients = tangents.expand(-1, pot.num_clients, -1)
            total = pot.network.sum(adaptation.hessian_products(pot.full_gradient_fn, at, clients))
            if pot.prior_on_server:
                prior = torch.func.jvp(lambda x: pot.server_prior(x, gradient=True), (at,), (tangents[:, 0],))
                total = total + prior[1]
            return total[:, None]

        clients_per_step = 1 if sampler.server_step else pot.network.num_clients
        largest, iterations, vector = adaptation.client_stiffness(
            None, points, root, 1, products=total_products, **options
        )
        # each power iteration is a round per point: the server sends a direction, the clients upload their
        # Hessian-vector products
        return largest[:, 0] / clients_per_step, clients_per_step, iterations * len(points), vector
    # each client's stiffness is computed locally and uploaded as one number (not counted: not d floats); the
    # holders stop together, so that every client's estimate is the same however the clients are held
    largest, _, vector = adaptation.client_stiffness(
        pot.full_gradient_fn, points, root, pot.num_clients, everywhere=pot.network.everywhere, **options
    )
    return pot.network.maximum(largest), pot.network.num_clients, 0, vector


def find_mode(pot, start: torch.Tensor, **options) -> ModeSearch:
    """The mode of the potential ``pot`` by L-BFGS from ``start``
    (:func:`~pyro_fed.algorithms.mode.find_mode`: each evaluation is a round of uploads of every client's
    gradient and potential)."""
    return mode_search.find_mode(pot.potential, pot.gradient, start, **options)


def _minibatch_gradients(pot, seed: int, batch: int | float | None):
    """``points [P, d] -> [R, P, b, d]``: every client's minibatch gradient at each point, on ``R`` fresh
    minibatches of ``batch`` points (the same minibatch at the ``P`` points; ``R = NOISE_DRAWS``, fewer where
    that would evaluate more than ``NOISE_EVALUATIONS`` data); ``None``: the full local gradients, the same
    for every ``R``."""
    if batch is None:
        return lambda points: pot.full_client_grads(
            points[:, None, :].expand(-1, pot.num_clients, -1)
        ).expand(NOISE_DRAWS, -1, -1, -1)
    # every client's minibatch, wherever it is held: the same number of draws in every process
    per_draw = TYPICAL_POINTS * int(client_batch_sizes(batch, pot.all_client_sizes).sum())
    draws = max(MIN_NOISE_DRAWS, min(NOISE_DRAWS, NOISE_EVALUATIONS // per_draw))
    sampler = pot.minibatch_sampler(batch, chunk_size=draws, num_chains=1, rng=Randomness(seed, pot.device))
    indices, weights = sampler(), sampler.datum_weights  # [R, b, n], [b, n]

    def gradients(points: torch.Tensor) -> torch.Tensor:
        # every client at each point, on each of the R minibatches: [R, P, b, d]
        (r, b, _), p = indices.shape, points.shape[0]
        at = points[None, :, None, :].expand(r, p, b, -1)
        return pot.minibatch_gradients(at, indices[:, None], weights)

    return gradients
