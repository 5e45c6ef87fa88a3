r"""DG-LMC — distributed Gibbs sampling with Langevin Monte Carlo steps within it.

Each client :math:`i` holds an auxiliary variable :math:`z_i` tied to the server's :math:`\theta` by a
Gaussian of tolerance :math:`\rho_i`, which augments the posterior :math:`\pi(\theta) \propto
\exp(-\sum_i U^i(\theta))` to

.. math::

    \pi_\rho(\theta, z_1, \dots, z_b) \propto \exp\Big(-\sum_i U^i(z_i)
    - \sum_i \frac{\|z_i - \theta\|^2_{M^{-1}}}{2 \rho_i}\Big),

whose :math:`\theta`-marginal tends to :math:`\pi` as :math:`\rho \to 0` (:math:`\|v\|^2_{M^{-1}} = v^\top
M^{-1} v`, :math:`M = R R^\top` the inverse mass; :math:`M = I` is the paper's target). An iteration is a
Gibbs sweep: every client takes ``local_steps`` :math:`N` Langevin steps on its conditional
:math:`\pi_\rho(z_i \mid \theta)`, then the server draws :math:`\theta` exactly from its Gaussian conditional:

.. math::

    z_i &\leftarrow z_i - \gamma_i M \hat\nabla U^i(z_i) - \frac{\gamma_i}{\rho_i} (z_i - \theta)
    + \sqrt{2 \gamma_i}\, R\, \xi_i \qquad (N \text{ times, every client in parallel}), \\
    \theta &\sim N\Big(\frac{\sum_i z_i / \rho_i}{\sum_i 1 / \rho_i},\ \Big(\sum_i \frac1{\rho_i}\Big)^{-1}
    M\Big) \qquad (\text{the server}).

The reported draw is :math:`\theta`. With the metric :math:`M^{-1}` in the tie, this is the paper's algorithm
run in the coordinates :math:`y = R^{-1} x`, where the inverse mass is the identity: the client step is the
preconditioned Langevin step (:func:`~pyro_fed.algorithms.langevin.langevin_step`) on the conditional, whose
tie term :math:`M \cdot M^{-1}(z_i - \theta) / \rho_i` needs no product with :math:`M`, and the server's draw
is the conditional of the same augmented target. :math:`\rho` is thus measured in the preconditioner's units:
posterior variances when it is adapted.

**Exact laws on Gaussian clients.** With :math:`U^i(x) = \frac12 (x - \mu_i)^\top A_i (x - \mu_i)` and full
local batches the sweep is a linear Gaussian recursion of :math:`(z, \theta)`. Its stationary mean solves
:math:`\gamma_i (M A_i (z_i - \mu_i) + (z_i - \theta) / \rho_i) = 0`, :math:`\theta = \sum_i w_i z_i`: it does
not depend on :math:`\gamma`, and is that of the augmented target's :math:`\theta`-marginal,

.. math::

    \theta \sim N\big(\Sigma_\rho \textstyle\sum_i B_i \mu_i,\ \Sigma_\rho\big), \qquad
    B_i = (A_i^{-1} + \rho_i M)^{-1}, \quad \Sigma_\rho = (\textstyle\sum_i B_i)^{-1}

(each client's likelihood smoothed by :math:`N(0, \rho_i M)`), which tends to the posterior as :math:`\rho
\to 0`; the covariance is that of this marginal up to the discretisation's :math:`O(\gamma)`: in one
dimension, one client, :math:`\mathrm{Var}(\theta) = 1/a + \rho + \gamma (a + 1/\rho) / (a (2 - \gamma a))`,
ULA's excess :math:`\gamma \kappa / 2` for the conditional's curvature :math:`\kappa = a + 1/\rho`.

**Automatic settings** (:func:`automatic_tolerance`, :func:`automatic_step`), in the preconditioned
coordinates, from what the warm-up measures: the largest client stiffness :math:`L = \max_i \lambda^i`
(:mod:`~pyro_fed.algorithms.adaptation`), the slowest curvature :math:`\lambda_{\min}` of the posterior, and
the clients' pull :math:`v = \sum_i \tilde A_i \tilde g_i` (their Hessians times their gradients at the mode,
whitened; zero when the clients agree). Both errors of the stationary law are held to ``VARIANCE_SHARE``
:math:`\varepsilon = \sqrt{1 + 0.1} - 1`, so that together the stiffest direction's variance is within
``VARIANCE_TARGET`` (10%) of the posterior's, as for the other samplers:

- the tolerance: since :math:`B_i = \tilde A_i (I + \rho \tilde A_i)^{-1} \succeq (1 - \rho L) \tilde A_i`,
  the marginal's covariance is at most :math:`1 / (1 - \rho L)` times the posterior's in every direction:
  :math:`\rho L = \varepsilon / (1 + \varepsilon)` bounds the excess by :math:`\varepsilon` (tight for
  identical clients, where :math:`L \approx 1/b` and :math:`\rho \approx \varepsilon b`); and its mean moves
  by :math:`\rho \tilde H^{-1} v` to first order, at most :math:`\rho \|v\| / \sqrt{\lambda_{\min}}`
  posterior sds along any direction, held to ``MEAN_TARGET``;
- the step: :math:`\gamma = 2 \varepsilon b / (V + (1 + \varepsilon) b \kappa)` with :math:`\kappa = L +
  1/\rho`, the warm-up's rule for a client's step (:func:`~pyro_fed.algorithms.adaptation.step_size`, with
  the gradient noise :math:`V`) on the conditional's curvature: its variance :math:`1 + \varepsilon` times
  its target's.

The price of the tie is speed: the clients' centre relaxes like ULA with step :math:`\gamma / b` on
:math:`U`, and :math:`\gamma L = 2 \varepsilon^2 / ((1 + \varepsilon)(1 + 2 \varepsilon)) \approx 0.004`,
some 45 times below FALD's :math:`\gamma L \approx 0.18` at the same accuracy. The kernel's thinning follows
(:func:`~pyro_fed.algorithms.adaptation.thinning_for`).

Tensors carry a leading chain dimension ``C``; the clients' noises and the server's are inputs of
:func:`step`, drawn ahead for a chunk.

**Reference:** Plassier, Vono, Durmus, Moulines, *DG-LMC: a turn-key and scalable synchronous distributed
MCMC algorithm via Langevin Monte Carlo within Gibbs*, ICML 2021, Algorithm 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import traffic
from .adaptation import (
    VARIANCE_TARGET,
    hessian_products,
    relaxation_time,
    square_root,
    thinning_for,
    whiten,
)
from .base import Algorithm
from .langevin import langevin_step

#: :math:`\varepsilon`: the relative excess of the stationary variance that the tolerance and the step may
#: each add along the stiffest direction; together ``(1 + eps)^2 = 1 + VARIANCE_TARGET``
VARIANCE_SHARE = math.sqrt(1.0 + VARIANCE_TARGET) - 1.0
#: the largest shift of the stationary mean, in posterior sds along any direction, that the automatic
#: tolerance allows in the clients' quadratic model at the mode (the target of D-ULA's consensus too)
MEAN_TARGET = 0.1


class DglmcState(NamedTuple):
    clients: torch.Tensor  #: the clients' :math:`z_i`, ``[C, b, d]``
    server: torch.Tensor  #: the server's :math:`\theta`, ``[C, d]``


def init(positions: torch.Tensor, num_clients: int) -> DglmcState:
    """The server and every client of chain ``c`` at ``positions[c]`` (``[C, d]``)."""
    return DglmcState(positions[:, None, :].expand(-1, num_clients, -1).clone(), positions.clone())


def automatic_tolerance(stiffness: float, slowest: float, pull: float) -> float:
    r"""The tolerance :math:`\rho` (see the module's docstring): the largest with :math:`\rho L \le
    \varepsilon / (1 + \varepsilon)` (``stiffness`` :math:`L`, the largest preconditioned client curvature)
    and :math:`\rho \|v\| / \sqrt{\lambda_{\min}} \le` ``MEAN_TARGET`` (``pull`` :math:`\|v\|`, ``slowest``
    :math:`\lambda_{\min}`)."""
    tolerance = VARIANCE_SHARE / ((1.0 + VARIANCE_SHARE) * stiffness)
    if pull > 0:
        tolerance = min(tolerance, MEAN_TARGET * math.sqrt(slowest) / pull)
    return tolerance


def automatic_step(stiffness: float, tolerance: torch.Tensor, noise: float, num_clients: int) -> torch.Tensor:
    r"""Each client's step :math:`\gamma_i = 2 \varepsilon b / (V + (1 + \varepsilon) b (L + 1/\rho_i))`:
    the warm-up's rule (:func:`~pyro_fed.algorithms.adaptation.step_size`) with the variance share
    :math:`\varepsilon` for the curvature of client :math:`i`'s conditional; ``tolerance`` :math:`\rho_i`
    (``[b]``), ``noise`` :math:`V`, ``num_clients`` :math:`b`."""
    curvature = stiffness + 1.0 / tolerance.double()
    eps, b = VARIANCE_SHARE, num_clients
    return 2 * eps * b / (noise + (1 + eps) * b * curvature)


def check_step(step: float, tolerance: float) -> None:
    """Refuse a step at least twice the smallest tolerance, on which a client's conditional diverges."""
    if step >= 2 * tolerance:
        raise ValueError(
            f"step_size={step:.3g} is at least twice the tolerance {tolerance:.3g}: a client's "
            "conditional has curvature at least 1/tolerance, on which such a step diverges. Pass a "
            "step_size below 2 * tolerance (0.2 * tolerance keeps its bias near 10%), or leave it out."
        )


def client_pull(chosen, run) -> float:
    r""":math:`\|\sum_i \tilde A_i \tilde g_i\|`: the clients' Hessians times their gradients at the warm-up's
    mode, in its preconditioned coordinates (:math:`R \nabla^2 U^i M \nabla U^i`; one Hessian-vector product
    per client, on its own data, summed by the network), for :func:`automatic_tolerance`."""
    root = square_root(chosen.preconditioner)
    grads = run.full_gradients(chosen.mode[None])  # [1, b, d]
    tangents = whiten(root, whiten(root, grads))  # M grad (R symmetric)
    products = hessian_products(run.potential.full_gradient_fn, chosen.mode, tangents)
    return float(run.network.sum(whiten(root, products)).double().norm())


def client_move(
    clients: torch.Tensor,
    grads: torch.Tensor,
    step_size: torch.Tensor,
    factors: torch.Tensor | None,
    noise: torch.Tensor,
) -> torch.Tensor:
    r"""The preconditioned Langevin step :math:`z_i - \gamma_i M g_i + \sqrt{2 \gamma_i} R \xi_i` of every
    client (``[C, b, d]``): ``step_size`` is :math:`\gamma M` as in
    :func:`~pyro_fed.algorithms.langevin.langevin_step` and ``factors`` (``[b]``, or ``None`` for all 1)
    :math:`\gamma_i / \gamma`."""
    if factors is None:
        return langevin_step(clients, grads, step_size, noise)
    factors = factors[:, None]
    if step_size.dim() == 3:  # gamma M and its root sqrt(gamma) R
        drift, root = step_size
        return clients - factors * (grads @ drift) + (2.0 * factors).sqrt() * (noise @ root)
    scaled = step_size * factors  # [b, d] or [b, 1]
    return clients - scaled * grads + (2.0 * scaled).sqrt() * noise


def server_draw(
    clients: torch.Tensor,
    noise: torch.Tensor,
    network,
    inverse_tolerance: torch.Tensor,
    total_precision: float,
    step_size: torch.Tensor,
    reference_step: float,
) -> torch.Tensor:
    r"""The server's exact draw :math:`\theta \sim N(\sum_i z_i/\rho_i / P, M / P)`, :math:`P = \sum_i
    1/\rho_i`, ``[C, d]``: the clients (``[C, b, d]``, those held here) upload :math:`z_i`, summed by the
    ``network``; ``inverse_tolerance`` is :math:`1/\rho_i` of the held clients (``[b]``),
    ``total_precision`` :math:`P` over all of them, ``noise`` the server's :math:`N(0, I)` (``[C, d]``, the
    same wherever clients are held). :math:`R` is read from ``step_size`` (:math:`\gamma M`, as in
    :func:`~pyro_fed.algorithms.langevin.langevin_step`) and ``reference_step`` :math:`\gamma`."""
    mean = network.sum(clients * inverse_tolerance[:, None]) / total_precision
    if step_size.dim() == 3:  # sqrt(gamma) R
        return mean + (noise @ step_size[1]) / math.sqrt(reference_step * total_precision)
    return mean + (step_size / (reference_step * total_precision)).sqrt() * noise


def step(
    state: DglmcState,
    gradients: Callable[[torch.Tensor], torch.Tensor],
    client_noise: torch.Tensor,
    server_noise: torch.Tensor,
    network,
    *,
    step_size: torch.Tensor,
    reference_step: float,
    factors: torch.Tensor | None,
    coupling: torch.Tensor,
    inverse_tolerance: torch.Tensor,
    total_precision: float,
) -> DglmcState:
    """One DG-LMC iteration: the clients' local steps, then the server's draw.

    :param gradients: maps client points ``[C, b, d]`` to this iteration's gradient estimates.
    :param client_noise: :math:`\\xi_i`, ``[N, C, b, d]`` (one per local step).
    :param server_noise: the server's :math:`N(0, I)`, ``[C, d]``.
    :param step_size: :math:`\\gamma M` (see :func:`client_move`).
    :param float reference_step: :math:`\\gamma`.
    :param factors: :math:`\\gamma_i / \\gamma`, ``[b]`` (``None``: all 1).
    :param coupling: :math:`\\gamma_i / \\rho_i`, ``[b]``.
    :param inverse_tolerance: :math:`1 / \\rho_i`, ``[b]``.
    :param float total_precision: :math:`\\sum_i 1 / \\rho_i` over all clients.
    """
    clients = state.clients
    server = network.broadcast(state.server, clients.shape[-2])
    for noise in client_noise:  # the local steps, all toward the same theta
        moved = client_move(clients, gradients(clients), step_size, factors, noise)
        clients = moved - coupling[:, None] * (clients - server)
    theta = server_draw(
        clients, server_noise, network, inverse_tolerance, total_precision, step_size, reference_step
    )
    return DglmcState(clients, theta)


@dataclass(kw_only=True)
class Dglmc(Algorithm):
    """DG-LMC as an :class:`~pyro_fed.algorithms.base.Algorithm`.

    :param tolerance: :math:`\\rho_i`: one number for every client, or one per client of the run (``[b]``),
        or ``None``: automatic (:func:`automatic_tolerance`, from the warm-up's measures); resolved for the
        run to a tensor ``[b]`` (:meth:`resolve`).
    :param int local_steps: :math:`N`, the clients' Langevin steps per iteration.

    Resolved for the run:

    :param float reference_step: :math:`\\gamma`, the step the kernel's step tensor carries (:math:`\\gamma
        M`).
    :param step_factors: :math:`\\gamma_i / \\gamma` of every client of the run, ``[b]`` (``None``: all 1).
    """

    tolerance: float | torch.Tensor | None = None
    local_steps: int = 1
    reference_step: float | None = None
    step_factors: torch.Tensor | None = None

    state_type = DglmcState

    #: its last word sets the step and the tolerances for the clients' conditionals
    finishes_adaptation = True

    def reads_minibatches(self):
        # the local steps of an iteration share its minibatch: full local batches with more than one
        return self.local_steps == 1

    def gradient_evaluations(self, minibatches):
        return self.local_steps

    def finish_adaptation(self, chosen, run):
        """With the warm-up's measures: the automatic tolerance (one more round of uploads: the clients'
        Hessians times their gradients at the mode), the automatic step for the clients' conditionals, and
        the thinning for the clients' centre's step :math:`\\gamma / b` on :math:`U`."""
        tolerance, steps, rounds = self.tolerances_and_steps(chosen, run)
        step = float(steps.max())
        thinning, relaxation = chosen.thinning, chosen.relaxation
        if run.step_size is None:
            centre = float(steps.mean()) / run.network.num_clients
            relaxation = relaxation_time(centre, chosen.slowest)
            if run.thinning is None:  # 1 with a step of the user's, as elsewhere
                thinning = thinning_for(centre, chosen.slowest)
        finished = chosen._replace(
            step_size=step, thinning=thinning, rounds=chosen.rounds + rounds, relaxation=relaxation
        )
        return finished, dataclasses.replace(self, tolerance=tolerance), []

    def resolve(self, run):
        chosen = run.chosen
        factors = None
        if chosen is None:
            tolerance = self.given_tolerance(run.network.num_clients)
        else:
            # the tolerances the warm-up's last word resolved (or, resumed from a checkpoint, those its
            # measures give again: the rounds were counted by the run that chose them)
            tolerance, steps, _ = self.tolerances_and_steps(chosen, run)
            factors = steps / float(steps.max())
            factors = None if bool((factors == 1).all()) else factors
        return {"tolerance": tolerance, "reference_step": run.step, "step_factors": factors}

    def tolerances_and_steps(self, chosen, run) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every client's tolerance and step (``[b]`` each) for the warm-up's measures ``chosen``, and the
        rounds of uploads they cost."""
        b = run.network.num_clients
        rounds = 0
        if self.tolerance is None:
            pull = client_pull(chosen, run)
            tolerance = torch.full((b,), automatic_tolerance(chosen.stiffness, chosen.slowest, pull))
            rounds = 1
        else:
            tolerance = self.given_tolerance(b)
        if run.step_size is None:
            steps = automatic_step(chosen.stiffness, tolerance, chosen.noise, b)
        else:
            check_step(run.step_size, float(tolerance.min()))
            steps = torch.full((b,), run.step_size, dtype=torch.float64)
        return tolerance.double(), steps, rounds

    def given_tolerance(self, num_clients: int) -> torch.Tensor:
        """The given tolerance, one per client (``[b]``, float64), checked against their number."""
        if isinstance(self.tolerance, torch.Tensor):
            if len(self.tolerance) != num_clients:
                raise ValueError(
                    f"tolerance has {len(self.tolerance)} values; the run has {num_clients} clients: give "
                    "one per client, or a single number for all."
                )
            return self.tolerance.double()
        return torch.full((num_clients,), self.tolerance, dtype=torch.float64)

    def __post_init__(self):
        if self.network is None:
            return
        tolerance = self.tolerance.to(self.device, self.dtype)
        factors = None
        if self.step_factors is not None:
            factors = self.step_factors.to(self.device, self.dtype)
        # the total over all clients, then the held clients' parts
        self._total_precision = float((1.0 / tolerance.double()).sum())
        held = self.held_clients
        tolerance = tolerance[held]
        self._factors = None if factors is None else factors[held]
        self._inverse_tolerance = 1.0 / tolerance
        self._coupling = self.reference_step * (1.0 if factors is None else self._factors) / tolerance

    def init(self, positions):
        return init(positions, self.num_held)

    def coins(self, rng, first_iteration, num_iterations):
        # no randomness on the host: every iteration is a round of every client
        return {"communicated": np.ones((num_iterations, self.num_chains), dtype=bool)}

    def coin_statistics(self, coins):
        return {}

    def inputs(self, rng, coins):
        leading = (len(coins["communicated"]), self.local_steps, self.num_chains)
        client_noise = self.client_normal(rng, *leading)
        server_noise = rng.normal(leading[0], self.num_chains, self.dim, dtype=self.dtype)
        return client_noise, server_noise

    def step(self, state, gradients, inputs, step_size):
        client_noise, server_noise = inputs
        return step(
            state,
            gradients,
            client_noise,
            server_noise,
            self.network,
            step_size=step_size,
            reference_step=self.reference_step,
            factors=self._factors,
            coupling=self._coupling,
            inverse_tolerance=self._inverse_tolerance,
            total_precision=self._total_precision,
        )

    def points(self, state):
        return state.clients

    def summary(self, state):
        return {"position": state.server}

    def traffic(self, coins):
        # every client uploads z_i and downloads theta: d floats each way, an average's traffic
        communicated = coins["communicated"]
        return (*traffic.averages(communicated, self.num_clients, self.dim), communicated)
