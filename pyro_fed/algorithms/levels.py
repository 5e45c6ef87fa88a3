r"""QLSD's automatic quantisation levels: the fewest uploaded bits per unit of Langevin time, at the warm-up's
accuracy.

A stochastic quantiser with :math:`s` levels (:class:`~pyro_fed.network.compression.StochasticQuantizer`)
sends a client's vector in :math:`\mathrm{bits}(s)` bits and adds to the server's gradient estimate a
variance that grows as :math:`s` falls (at most :math:`\omega(s) \|v\|^2` for an upload :math:`v`). The
warm-up's step (:func:`~pyro_fed.algorithms.adaptation.step_size`, a server's step) keeps the stiffest
direction's stationary variance within :math:`1 + \varepsilon` of the posterior's whatever the noise
:math:`V`, at

.. math::

    \gamma(V) = \frac{2 \varepsilon}{V + (1 + \varepsilon) \bar\lambda},

so every setting of the levels is as accurate, and the chains need iterations in proportion to
:math:`1/\gamma` for the same effective draws. The levels chosen minimise the bits uploaded per unit of
Langevin time,

.. math::

    \mathrm{bits}(s)\, \big(V(s) + (1 + \varepsilon)\bar\lambda\big),

over ``LEVELS`` and no compression. :math:`V(s)` is the warm-up's measured noise (the minibatch's and the
participation's, uncompressed) plus what the quantiser adds at the warm-up's typical points: the server's
estimate from the clients' exact gradients, compressed (with QLSD++'s memories at their rate for that
:math:`\omega`) on ``QUANTISER_DRAWS`` draws of the quantiser's uniforms
(:func:`~pyro_fed.algorithms.qlsd.estimate_noise`), its largest preconditioned variance less the
uncompressed one's. Adding the largest coordinate's excess to the largest coordinate's noise bounds the
noise from above: the step errs small.

Where the warm-up measures the preconditioner again from the chains' draws (a posterior its Laplace
approximation misjudges), the levels stay, since the run's iteration is prepared for them, and the new step
is shortened for their noise at the new typical points (:func:`keep_levels`).

The choice is the same in every process (the quantiser's uniforms are drawn by blocks of clients from fixed
streams, and the variances summed over the network). The quadratic part of the trade, a shorter step for
fewer bits, is exact; what it leaves out is the thinning's cap (``MAX_THINNING``): where the cap binds a
shorter step gives fewer effective draws per draw, not more iterations.

**Reference:** Vono, Plassier, Durmus, Dieuleveut, Moulines, *QLSD: Quantised Langevin stochastic
dynamics for Bayesian federated learning*, AISTATS 2022, Section 3 (the quantiser, its variance bound
:math:`\omega` and its bits).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..network.compression import compressor
from . import adaptation

if TYPE_CHECKING:
    from .adaptation import Adaptation
    from .base import Algorithm, Run

#: the quantisation levels the warm-up chooses among, and ``None``: no compression
LEVELS = (2, 4, 8, 16, 64, 256, 4096, 65536, None)
#: draws of the quantiser's uniforms per typical point, for the variance it adds
QUANTISER_DRAWS = 16


class LevelChoice(NamedTuple):
    """One setting of the levels, as the warm-up weighs it."""

    #: :math:`s` (``None``: no compression)
    levels: int | None
    #: the bits of one client's message
    bits: float
    #: :math:`V(s)`, the server's estimate's noise with it
    noise: float
    #: the bits uploaded per unit of Langevin time, up to a common factor
    cost: float


def exact_gradients(run: Run) -> Callable[[torch.Tensor], torch.Tensor]:
    """The clients' exact gradients as ``QUANTISER_DRAWS`` "minibatches" of their whole data (points ``[P,
    d]`` to ``[R, P, b, d]``: only the quantiser and the coins vary), each set of points evaluated once:
    every setting weighed reads the same points."""
    evaluated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def gradients(points: torch.Tensor) -> torch.Tensor:
        for seen, found in evaluated:
            if seen.shape == points.shape and torch.equal(seen, points):
                return found
        found = run.full_gradients(points)
        evaluated.append((points, found.expand(QUANTISER_DRAWS, *found.shape)))
        return evaluated[-1][1]

    return gradients


def quantiser_noise(
    settings: Algorithm, levels: int | None, chosen: Adaptation, run: Run, exact: Callable
) -> float:
    r"""The largest preconditioned variance of the server's estimate from the clients' exact gradients at
    the warm-up's typical points, compressed with ``levels`` (what compression and participation add, no
    minibatch's), as the warm-up measures noise (:func:`~pyro_fed.algorithms.adaptation.gradient_noise`).

    :param settings: the QLSD family's settings (:class:`~pyro_fed.algorithms.qlsd.Qlsd`), unbound.
    :param chosen: what the warm-up chose, measured uncompressed.
    :param exact: the clients' exact gradients (:func:`exact_gradients`)."""
    candidate = dataclasses.replace(settings, compressor=compressor(levels))  # its own memory rate
    draws = candidate.adaptation_noise(exact, chosen.mode, chosen.typical_points, run)
    profile = adaptation.noise_profile(draws, adaptation.square_root(chosen.preconditioner))
    return adaptation.gradient_noise(profile, run.network, per_client=False)


def _added_noise(
    settings: Algorithm,
    levels: int | None,
    uncompressed: float,
    chosen: Adaptation,
    run: Run,
    exact: Callable,
) -> float:
    """What ``levels`` add to the noise ``chosen`` measured uncompressed (``uncompressed``: the quantiser's
    measure without compression, participation's part)."""
    if levels is None:
        return 0.0
    return max(0.0, quantiser_noise(settings, levels, chosen, run, exact) - uncompressed)


def weigh_levels(settings: Algorithm, chosen: Adaptation, run: Run) -> list[LevelChoice]:
    """Every setting of ``LEVELS``, weighed from the warm-up's ``chosen`` noise and stiffness (see the
    module's docstring); each client uploads its variances once per setting."""
    exact = exact_gradients(run)
    uncompressed = quantiser_noise(settings, None, chosen, run, exact)
    stiffness = (1 + adaptation.VARIANCE_TARGET) * chosen.stiffness
    weighed = []
    for levels in LEVELS:
        noise = chosen.noise + _added_noise(settings, levels, uncompressed, chosen, run, exact)
        bits = compressor(levels).bits(run.dim)
        weighed.append(LevelChoice(levels, bits, noise, bits * (noise + stiffness)))
    run.network.record_averages(len(LEVELS), shared=True)
    return weighed


def _with_levels(
    chosen: Adaptation, run: Run, levels: int | None, noise: float, thinning: bool
) -> Adaptation:
    r"""``chosen`` at ``levels`` of noise ``noise``: the step scaled by :math:`(V_0 + (1 +
    \varepsilon)\bar\lambda) / (V(s) + (1 + \varepsilon)\bar\lambda)`, which keeps the pilot's word on it
    (a shorter step stays stable), the relaxation time with it, and the automatic thinning too where
    ``thinning``."""
    stiffness = (1 + adaptation.VARIANCE_TARGET) * chosen.stiffness
    step = chosen.step_size * (chosen.noise + stiffness) / (noise + stiffness)
    every = chosen.thinning
    if thinning and run.thinning is None:
        every = adaptation.thinning_for(step, chosen.slowest)
    return chosen._replace(
        step_size=step,
        noise=noise,
        thinning=every,
        relaxation=adaptation.relaxation_time(step, chosen.slowest),
        quantization_levels=math.inf if levels is None else float(levels),
    )


def choose_levels(settings: Algorithm, chosen: Adaptation, run: Run) -> Adaptation:
    """``chosen`` with the levels of least cost (:func:`weigh_levels`; fewer bits where two cost the same),
    and the step, noise, thinning and relaxation time that go with them."""
    best = min(weigh_levels(settings, chosen, run), key=lambda choice: (choice.cost, choice.bits))
    return _with_levels(chosen, run, best.levels, best.noise, thinning=True)


def keep_levels(settings: Algorithm, levels: int | None, chosen: Adaptation, run: Run) -> Adaptation:
    """What the warm-up measured again from the chains' draws (``chosen``, uncompressed: a better
    preconditioner, another step), at the ``levels`` chosen before, which the run keeps (its iteration is
    prepared for them): the noise they add at the new typical points and preconditioner, and the step
    shortened for it; the thinning kept, as the window keeps it. No compression adds nothing, and nothing is
    measured for it."""
    noise = chosen.noise
    if levels is not None:
        exact = exact_gradients(run)
        uncompressed = quantiser_noise(settings, None, chosen, run, exact)
        noise += _added_noise(settings, levels, uncompressed, chosen, run, exact)
        run.network.record_averages(2, shared=True)
    return _with_levels(chosen, run, levels, noise, thinning=False)


def chosen_compressor(chosen: Adaptation | None):
    """The compressor of the levels the warm-up chose (``None`` where it chose none: the user's stays)."""
    if chosen is None or chosen.quantization_levels != chosen.quantization_levels:
        return None
    levels = chosen.quantization_levels
    return compressor(None if math.isinf(levels) else int(levels))
