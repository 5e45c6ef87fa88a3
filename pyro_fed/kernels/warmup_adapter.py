"""What a federated kernel's warm-up decides, in one object.

A :class:`WarmupAdapter` is built for each run from the potential (the model's split into clients, which
holds the network where they meet), the algorithm's settings and warm-up traits
(:class:`~pyro_fed.algorithms.base.Algorithm`) and what the user fixed (step size, preconditioner,
minibatch, thinning). It chooses what was left automatic before the chains start
(:meth:`WarmupAdapter.choose`, with the measurements of :mod:`pyro_fed.kernels.warmup`), moves the chains'
starts into the posterior's bulk (:meth:`WarmupAdapter.starts`), measures the preconditioner again from
the warm-up's own draws (:meth:`WarmupAdapter.adapt_to_draws`, Stan's windowed adaptation) and keeps the
record of its choices (:attr:`WarmupAdapter.chosen`, an :class:`~pyro_fed.algorithms.adaptation.Adaptation`),
which it says in one line at its end (:meth:`WarmupAdapter.summary`).

The kernel (:class:`~pyro_fed.kernels.base.FederatedKernel`) only asks it, as Pyro's NUTS asks its
``WarmupAdapter`` (``pyro.infer.mcmc.adaptation``) and BlackJAX's ``window_adaptation`` is kept apart from
its kernels: a change in the warm-up does not touch the sampling.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from .. import messages
from ..algorithms import adaptation, convergence
from ..algorithms.adaptation import Adaptation
from ..algorithms.base import Algorithm, Run
from ..algorithms.mode import MODE_TOLERANCE, MODE_WARNING
from ..data.minibatch import client_batch_sizes
from . import warmup

#: the windows of the warm-up's draws (its fractions: first, end) after each of which an automatic
#: preconditioner is measured again from the chains' own draws in it (see
#: :meth:`WarmupAdapter.adapt_to_draws`): Stan's windowed adaptation, whose later window starts from what
#: the earlier one found
DRAWS_WINDOWS = ((0.25, 0.5), (0.5, 0.75))
#: the fewest draws per chain in a window (a shorter warm-up keeps the preconditioner it has)
MIN_WINDOW_DRAWS = 20

#: where the warm-up's one-line summary is logged (at ``INFO``)
LOGGER = logging.getLogger("pyro_fed")


class WarmupAdapter:
    """The warm-up of one run of a federated kernel, and the record of what it chose.

    :param settings: the algorithm's settings (an unbound :class:`~pyro_fed.algorithms.base.Algorithm`),
        whose warm-up traits say what it needs adapted.
    :param potential: the model's split into client potentials
        (:class:`~pyro_fed.model.potential.FederatedPotential`), with the network where the clients meet.
    :param step_size: the user's step size (``None``: chosen).
    :param preconditioner: the user's (``None``, ``"adapt"``, ``"diagonal"``, ``"dense"`` or a tensor; see
        :class:`~pyro_fed.kernels.base.FederatedKernel`).
    :param batch_size: the user's minibatch size (``None``: chosen with an automatic step).
    :param thinning: the user's thinning (``None``: chosen with an automatic step).
    :param str gradient_mode: how the pilot's iteration runs.
    :param int warmup_steps: the warm-up's draws per chain (its windows and its pilot's budget).
    :param name: the kernel's name, for messages.
    """

    def __init__(
        self,
        settings: Algorithm,
        potential,
        *,
        step_size: float | None,
        preconditioner,
        batch_size,
        thinning: int | None,
        gradient_mode: str,
        warmup_steps: int,
        name: str,
    ):
        self.settings, self.potential, self.name = settings, potential, name
        self.step_size_given, self.preconditioner_given = step_size, preconditioner
        self.batch_size_given, self.thinning_given = batch_size, thinning
        self.gradient_mode, self.warmup_steps = gradient_mode, warmup_steps
        #: what the warm-up chose (:class:`~pyro_fed.algorithms.adaptation.Adaptation`), ``None`` when the
        #: user gave everything
        self.chosen: Adaptation | None = None
        #: the settings as the algorithm's last word on the warm-up left them
        #: (:meth:`~pyro_fed.algorithms.base.Algorithm.finish_adaptation`)
        self.finished = settings
        #: what that last word found, repeated at the end of the run
        self.finish_problems: list[str] = []
        self._warned_draws = math.inf  # the independent draws a warning before the draws last counted

    # ------------------------------------------------------------ what it chose
    @property
    def step_size(self) -> float | None:
        """The run's step size :math:`\\gamma`: the user's, or the chosen one."""
        return self.chosen.step_size if self.chosen is not None else self.step_size_given

    @property
    def batch_size(self) -> int | float | None:
        """The run's minibatch size per client (``None``: full local batches)."""
        if self.chosen is not None:
            return self.chosen.batch_size
        return None if self.batch_size_given == "full" else self.batch_size_given

    @property
    def thinning(self) -> int:
        """The run's iterations per draw (1 with a given step size and no thinning)."""
        return self.chosen.thinning if self.chosen is not None else (self.thinning_given or 1)

    @property
    def full_local_batches(self) -> bool:
        """Whether every client reads all its data at every iteration."""
        batch, sizes = self.batch_size, self.potential.all_client_sizes
        return batch is None or bool((client_batch_sizes(batch, sizes) == sizes).all())

    @property
    def automatic(self) -> bool:
        """Whether anything is chosen: the step, or a preconditioner named by the user."""
        return self.step_size_given is None or isinstance(self.preconditioner_given, str)

    def iteration_data(self) -> int:
        """Data evaluations per iteration, summed over clients (one chain's): each client's minibatch (or its
        data) times the algorithm's :meth:`~pyro_fed.algorithms.base.Algorithm.gradient_evaluations`."""
        sizes, exact = self.potential.all_client_sizes, self.full_local_batches
        used = sizes if exact else client_batch_sizes(self.batch_size, sizes)
        return self.settings.gradient_evaluations(not exact) * int(used.sum())

    def event_probability(self) -> float:
        """The automatic probability per iteration of an event that evaluates all the data (VR-FALD⋆'s
        refresh, the inverse of QLSD++'s snapshot period): a tenth of the run's data evaluations
        (:func:`~pyro_fed.algorithms.adaptation.refresh_probability`, from all clients' sizes)."""
        full_data = int(self.potential.all_client_sizes.sum())
        return adaptation.refresh_probability(self.iteration_data(), full_data)

    # ------------------------------------------------------------ before the chains
    def choose(self, start: torch.Tensor, seed: int, run: Run) -> torch.Tensor:
        """Choose what is automatic (from chain 0's initial point ``start``, so that the choice is the same
        for any number of chains; ``seed`` seeds its measurements) and finish it with the algorithm's last
        word; the run's inverse mass, ``[d]`` or ``[d, d]``."""
        pot, given = self.potential, self._given_inverse_mass()
        self.chosen = None
        if not self.automatic:
            return given if given is not None else torch.ones(pot.dim, dtype=pot.dtype, device=pot.device)
        named = isinstance(self.preconditioner_given, str) and self.preconditioner_given != "adapt"
        chosen = warmup.adapt(
            pot,
            self._sampler(run),
            start,
            seed,
            self.settings.warmup_preconditioner if given is None else given,
            self.preconditioner_given if named else "auto",
            max_pilot_iterations=self._pilot_budget(run),
        )
        self.chosen, self.finished, self.finish_problems = self.settings.finish_adaptation(chosen, run)
        return self.chosen.preconditioner

    def resume(self, chosen: Adaptation | None) -> None:
        """Take a checkpointed run's record instead of choosing."""
        self.chosen = chosen

    def _given_inverse_mass(self) -> torch.Tensor | None:
        """The user's fixed inverse mass, checked against the model's dimension."""
        pot, given = self.potential, self.preconditioner_given
        if not isinstance(given, torch.Tensor):
            return None
        if given.shape not in ((pot.dim,), (pot.dim, pot.dim)):
            raise ValueError(
                f"preconditioner has shape {tuple(given.shape)}; the model has {pot.dim} unconstrained "
                f"coordinates: give one positive number per coordinate, or a {pot.dim} x {pot.dim} matrix."
            )
        return given.to(pot.device, pot.dtype)

    def _sampler(self, run: Run, **chosen) -> warmup.Sampler:
        """What the measurements must know of the sampler (:class:`~pyro_fed.kernels.warmup.Sampler`): the
        user's settings, or those ``chosen`` already (the minibatch and the thinning, when the preconditioner
        is measured again from the draws)."""
        algorithm = self.settings
        settings = {
            "step_size": self.step_size_given,
            "thinning": self.thinning_given,
            "batch_size": self.batch_size_given,
            # when neither the minibatch nor the step is given
            "chooses_batch_size": self.batch_size_given is None
            and self.step_size_given is None
            and algorithm.reads_minibatches(),
            **chosen,
        }
        return warmup.Sampler(
            name=type(algorithm).__name__,
            server_step=algorithm.server_step,
            average_step=algorithm.average_step(),
            random_at_full_batch=algorithm.random_at_full_batch(run),
            gradient_evaluations=algorithm.gradient_evaluations(minibatches=True),
            adaptation_noise=functools.partial(algorithm.adaptation_noise, run=run),
            chosen_step=functools.partial(algorithm.chosen_step, run=run),
            gradient_mode=self.gradient_mode,
            **settings,
        )

    def _pilot_budget(self, run: Run) -> float:
        """The pilot's iterations per iteration of a draw: as many upload rounds per particle as a chain's
        warm-up (see :meth:`~pyro_fed.algorithms.base.Algorithm.upload_rate`)."""
        return self.warmup_steps * min(1.0, self.settings.upload_rate(run))

    def starts(self, positions: torch.Tensor, rng, laplace: bool) -> torch.Tensor:
        """The chains' initial points ``[C, d]`` from those given or drawn (``positions``): with
        ``laplace`` (no start of the user's nor init strategy, and an algorithm that starts so), independent
        draws of the Laplace approximation the warm-up found, where the chosen step is known to be stable;
        else the given starts, each pulled toward the mode along the line that joins them until its
        potential is at the posterior's typical level
        (:func:`~pyro_fed.algorithms.adaptation.typical_points`), as NUTS's warm-up carries its chains into
        the bulk. Unchanged when nothing was chosen."""
        chosen, pot = self.chosen, self.potential
        if chosen is None:
            return positions
        if laplace and self.settings.laplace_starts:
            root = adaptation.square_root(chosen.preconditioner)
            noise = rng.normal(len(positions), pot.dim, dtype=pot.dtype)
            positions = chosen.mode + adaptation.whiten(root, noise)
            pot.check_initial_points(positions)
            return positions
        # a given start far above the posterior's typical potential, where the automatic step is not known to
        # be stable (every step from there may diverge and be reverted), is pulled toward the mode
        return adaptation.typical_points(pot.total_potentials, chosen.mode, positions - chosen.mode)

    def mode(self, what: str, cost: str, remedy: str) -> torch.Tensor:
        """The potential's mode, for a sampler's own use of it (QLSD⋆'s fixed point, FSGLD's surrogates): the
        warm-up's, or, with a given step (no warm-up), one found by L-BFGS from the initial point, its
        rounds counted; a warning names ``what`` it is for, its ``cost`` and the ``remedy`` where the search
        stops short."""
        if self.chosen is not None:
            return self.chosen.mode
        pot = self.potential
        search = warmup.find_mode(pot, pot.initial_flat)
        pot.network.record_averages(search.evaluations, shared=True)
        if not search.converged:
            messages.warn(
                f"{what}: the search for the mode stopped after {search.evaluations} evaluations with a "
                f"Newton decrement of {search.decrement:.3g} (by its own estimate of the Hessian; it stops "
                f"at {MODE_TOLERANCE}): {cost}. {remedy}, or leave step_size automatic (the warm-up checks "
                "the mode with the Hessian).",
            )
        return search.point

    def warn_if_draws_dependent(self, num_samples: int | None) -> None:
        """Warn before the draws when the automatic thinning is short of half the slowest direction's
        relaxation time (stopped at its cap, ``MAX_THINNING``, or kept from the set-up while the warm-up's
        draws made the step smaller) and the ``num_samples`` draws then cannot hold ``ESS_PER_CHAIN``
        independent ones per chain (the end-of-run checks' threshold), naming the thinning that would: a slow
        sampler's run otherwise ends, minutes later, in a warning about its effective sample size. Not where
        the algorithm's last word on the warm-up already said why (D-ULA's cut step)."""
        chosen = self.chosen
        if chosen is None or self.thinning_given is not None or num_samples is None or self.finish_problems:
            return
        relaxation = chosen.relaxation
        if not math.isfinite(relaxation) or chosen.thinning >= math.floor(relaxation / 2):
            return
        covered = num_samples * chosen.thinning / relaxation
        # said once, and again only where the warm-up's draws made it worse
        if covered / 2 >= min(convergence.ESS_PER_CHAIN, self._warned_draws):
            return
        self._warned_draws = covered / 2
        messages.warn(
            f"pyro_fed: at {self.name}'s automatic step the slowest direction relaxes over about "
            f"{relaxation:.3g} iterations, and the automatic thinning puts the draws {chosen.thinning} "
            f"iterations apart (at most {adaptation.MAX_THINNING}, chosen before the warm-up's draws): the "
            f"{num_samples} draws per chain cover {covered:.3g} relaxation times, about {covered / 2:.3g} "
            f"independent draws per chain (the end-of-run checks ask for {convergence.ESS_PER_CHAIN}). Pass "
            f"thinning={math.ceil(relaxation / 2)} for nearly independent draws, or more num_samples.",
        )

    # ------------------------------------------------------------ from the warm-up's draws
    def next_window(self, computed: int) -> tuple[int, int] | None:
        """The next window of draws ``(first, end)`` (:data:`DRAWS_WINDOWS` of the warm-up's) whose end is
        beyond the ``computed`` iterations, from which the preconditioner is measured again once its draws are
        computed (:meth:`adapt_to_draws`), when the warm-up chose the step and the preconditioner and the
        algorithm has no last word of its own on the step (D-ULA's graph); ``None`` when there is none, or
        none left. The windows depend on ``warmup_steps`` alone: a run resumed from a checkpoint meets those
        its first run had still to meet."""
        if (
            self.chosen is None
            or self.step_size_given is not None
            or isinstance(self.preconditioner_given, torch.Tensor)
            or self.settings.finishes_adaptation
        ):
            return None
        for first, end in DRAWS_WINDOWS:
            window = int(first * self.warmup_steps), int(end * self.warmup_steps)
            if window[1] - window[0] >= MIN_WINDOW_DRAWS and computed < window[1] * self.thinning:
                return window
        return None

    def adapt_to_draws(self, draws: torch.Tensor, seed: int, algorithm: Algorithm, run: Run) -> bool:
        """Stan's windowed adaptation, for one window of the chains' draws ``[C, n, d]``: their covariance
        replaces the preconditioner in use where it disagrees with it beyond chance
        (:func:`~pyro_fed.algorithms.adaptation.draws_preconditioner`); the step is then chosen again for it
        (``seed`` seeds the measurements, as the first choice's), at the same minibatch and thinning, its
        stiffness and noise measured (and its pilot started) at some of the window's draws, and finished by
        the run's ``algorithm`` (:meth:`~pyro_fed.algorithms.base.Algorithm.finish_window`). Whether the
        choice changed. The Laplace approximation at the mode misjudges a posterior whose curvature varies (a
        hierarchical model's scale): on eight schools the slowest direction then had 2.7 times fewer
        effective draws."""
        pot, chosen = self.potential, self.chosen
        measured = adaptation.draws_preconditioner(draws, chosen.preconditioner)
        if measured is None:
            return False
        batch = "full" if self.batch_size is None else self.batch_size
        sampler = self._sampler(run, chooses_batch_size=False, batch_size=batch, thinning=self.thinning)
        # the step is checked where the chains are: at some of their draws (evenly spread over the window's
        # second half, all chains pooled), not at draws of a Gaussian of that covariance, which put a skewed
        # posterior's typical points where it has little mass (eight schools' log tau: in its right tail,
        # where the curvature is ten times the typical one)
        pooled = draws.reshape(-1, pot.dim)
        picked = torch.linspace(0, len(pooled) - 1, warmup.TYPICAL_POINTS).round().long()
        self.chosen = warmup.adapt(
            pot,
            sampler,
            chosen.mode,
            seed,
            measured.to(pot.dtype),
            max_pilot_iterations=self._pilot_budget(run),
            draws=pooled[picked],
        )
        self.chosen = self.settings.finish_window(algorithm, self.chosen, run)
        return True

    # ------------------------------------------------------------ what it says
    def problems(self) -> list[str]:
        """The warm-up's own checks that were not met, each a sentence: the mode not reached (its Newton
        decrement above ``MODE_WARNING``, a posterior sd), the pilot run cut short of its Langevin time, and
        what the algorithm's last word found."""
        chosen, problems = self.chosen, []
        if chosen is None:
            return problems
        if chosen.mode_decrement > MODE_WARNING:
            problems.append(
                f"the warm-up did not reach the mode (Newton decrement {chosen.mode_decrement:.3g} posterior "
                f"sds, above {MODE_WARNING}): the preconditioner and the step were measured elsewhere"
            )
        if chosen.pilot_iterations and chosen.pilot_time < adaptation.PILOT_DURATION:
            problems.append(
                f"the pilot run that checks the step covered a Langevin time of {chosen.pilot_time:.3g} of "
                f"{adaptation.PILOT_DURATION:g} (the warm-up's upload rounds cut it): more warmup_steps let "
                "it look farther"
            )
        return problems + self.finish_problems

    def summary(self) -> str:
        """Everything the warm-up chose, in one line (``""`` when the user gave everything): the step, the
        preconditioner's form, the minibatch, the thinning, the communication setting where one was chosen,
        and the averaging rounds its measurements cost."""
        chosen = self.chosen
        if chosen is None:
            return ""
        form = ("dense" if chosen.preconditioner.dim() == 2 else "diagonal") + " preconditioner"
        if not math.isnan(chosen.condition):
            form += f" (a diagonal one leaves a condition number of {chosen.condition:.3g})"
        exact = self.full_local_batches
        parts = [
            f"step {chosen.step_size:.3g}",
            form,
            "full local batches" if exact else f"minibatch {chosen.batch_size} per client",
            f"thinning {chosen.thinning}",
        ]
        for label, value in (
            ("comm_prob", chosen.comm_prob),
            ("refresh_prob", chosen.refresh_prob),
            ("quantization levels", chosen.quantization_levels),
        ):
            if not math.isnan(value):
                parts.append(f"{label} {value:.3g}")
        if not math.isnan(chosen.drift_error):
            parts.append(f"predicted drift {chosen.drift_error:.2g} sd")
        parts.append(f"{chosen.rounds} rounds of uploads to choose them")
        return f"pyro_fed's warm-up for {self.name}: " + ", ".join(parts) + "."

    def say(self) -> None:
        """Log :meth:`summary` at ``INFO`` on the ``pyro_fed`` logger."""
        line = self.summary()
        if line:
            LOGGER.info(line)
