"""The Pyro adapter shared by every federated kernel."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from pyro.infer.autoguide.initialization import init_to_median
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from .. import messages
from ..algorithms import adaptation, convergence
from ..algorithms.adaptation import Adaptation
from ..algorithms.base import Algorithm, Run
from ..data.minibatch import MinibatchSampler
from ..data.partition import check_clients
from ..engine.compile import check_mode
from ..engine.draws import DrawBuffer
from ..engine.randomness import Randomness
from ..model.potential import FederatedPotential
from ..network.base import Network
from ..network.in_process import InProcessNetwork
from . import checkpoint as checkpoints
from .arguments import (
    check_batch_size,
    check_batch_size_fits,
    check_checkpoint,
    check_positive,
    check_positive_int,
    check_preconditioner,
)
from .chunks import ChunkRunner
from .warmup_adapter import WarmupAdapter

#: elements of pre-drawn inputs (noise, minibatch indices) per chunk, at most: chunks shrink below
#: ``chunk_size`` iterations for very large problems so that the inputs stay within a few hundred MB
MAX_CHUNK_ELEMENTS = 2**27
#: fraction of diverging draws after warm-up above which a chain's end warns
DIVERGING_WARNING = 0.01
#: a step that moves a chain's draw farther than this many preconditioner scales (:math:`\sqrt{M_{kk}}`, the
#: posterior's standard deviations when the preconditioner is adapted; 1 without one) from the chain's
#: initial point has exploded: it is reverted and counted as a divergence, as a non-finite step is
EXPLOSION_SCALES = 1e6
#: the constructor's own names, besides its settings
CALLED = ("self", "model", "clients", "__class__")
#: what a kernel said of its sampler before the algorithms held it (see FederatedKernel.__init_subclass__)
MOVED_TO_ALGORITHM = frozenset(
    (
        "make_algorithm",
        "server_step",
        "laplace_starts",
        "averages_every_iteration",
        "upload_rate",
        "random_at_full_batch",
        "gradient_evaluations",
        "chooses_batch_size",
        "chosen_step",
        "warmup_preconditioner",
        "adaptation_noise",
        "finish_adaptation",
    )
)


def _iteration_constants(step: float, inverse_mass: torch.Tensor, start: torch.Tensor) -> tuple:
    """The constants of the prepared iteration: the preconditioned step (:math:`\\gamma m`, or
    :math:`\\gamma M` with its root), the chains' initial points and the explosion bounds around them."""
    return (
        adaptation.preconditioned_step(step, inverse_mass),
        start,
        EXPLOSION_SCALES * adaptation.marginal_scales(inverse_mass),
    )


class ChainPlan(NamedTuple):
    """What :class:`~pyro.infer.MCMC` will ask of the kernel (recorded when it is constructed, see
    :mod:`pyro_fed.kernels.chains`)."""

    #: number of chains
    num_chains: int
    #: draws after warm-up per chain (``None``: unknown, the kernel is driven by hand)
    num_samples: int | None
    #: the user's initial values, ``{site: [C, ...]}``
    initial_params: dict | None


def _recording(init: Callable) -> Callable:
    """A kernel class's ``init`` that first keeps the arguments of the outermost constructor call (the
    user's, whatever the class), for a checkpoint's fingerprint
    (:func:`~pyro_fed.kernels.checkpoint.fingerprint`); its signature is ``init``'s."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "_arguments" not in self.__dict__:
            self._arguments = (args, kwargs)
        init(self, *args, **kwargs)

    return __init__


class FederatedKernel(MCMCKernel):
    """Base class of the federated kernels: a Pyro :class:`~pyro.infer.mcmc.mcmc_kernel.MCMCKernel` that
    splits the model's data plate into clients and runs a federated algorithm, many iterations at a time.

    Each :meth:`sample` call returns one draw (``thinning`` iterations after the previous one), served from
    buffers that the kernel fills a chunk of iterations at a time: the randomness of a chunk (noise,
    minibatches, coins) is drawn ahead, and the iterations run as one prepared function
    (:mod:`pyro_fed.engine.chunk_engine`). ``MCMC(kernel, num_chains=C)`` runs the ``C`` chains as one batched
    state ``[C, b, d]`` in one process, with independent noise, minibatches and coins; Pyro then receives them
    one chain after another, as it would from independent runs.

    A subclass checks its own arguments and builds its :class:`~pyro_fed.algorithms.base.Algorithm` (the
    pure tensor code of :mod:`pyro_fed.algorithms`) with their settings, which it passes as ``algorithm``:
    the algorithm tells the warm-up what it needs adapted, and is bound to each run after the warm-up
    (:meth:`~pyro_fed.algorithms.base.Algorithm.bind`). The warm-up is one object, built for each run
    (:class:`~pyro_fed.kernels.warmup_adapter.WarmupAdapter`, :attr:`warmup`), which this class asks. It owns
    the rest: the :class:`~pyro_fed.model.potential.FederatedPotential`, the randomness, the minibatches, the
    network, reverting diverging steps (non-finite or exploded: counted as divergences), the buffers and the
    per-draw statistics.

    :param model: a Pyro model whose likelihood is a plate over data.
    :param clients: a number of clients ``b`` (an i.i.d. split of the data, seed 0), a LongTensor of length
        ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index tensors (see
        :mod:`pyro_fed.data.partition`).
    :param float step_size: the step size :math:`\\gamma` (default ``None``: chosen before the chains start,
        from the curvature of the potential at its mode and at typical points, then checked by a pilot run
        within the warm-up's upload rounds; see
        :meth:`~pyro_fed.algorithms.base.Algorithm.upload_rate`, :mod:`pyro_fed.algorithms.adaptation`).
    :param preconditioner: the inverse mass of the preconditioned steps: diagonal :math:`m`,
        :math:`X - \\gamma\\, m \\odot \\hat\\nabla U + \\sqrt{2\\gamma m} \\odot Z`, or dense :math:`M = R
        R^\\top`, :math:`X - \\gamma M \\hat\\nabla U + \\sqrt{2\\gamma} R Z`. ``None`` (default: adapted when
        ``step_size`` is automatic — dense for up to 200 coordinates when the diagonal one leaves the
        curvature ill-conditioned, else diagonal; see :mod:`pyro_fed.algorithms.adaptation` —, none — the
        identity — when the user gives ``step_size``, so that a given step keeps its meaning in the model's
        unconstrained units), ``"adapt"`` (adapted so, also with a given ``step_size``), ``"diagonal"`` or
        ``"dense"`` (that form adapted), a tensor of ``d`` positive numbers or a ``d x d`` symmetric positive
        definite matrix (fixed).
    :param batch_size: minibatch size per client, a fraction in ``(0, 1)`` of each client's data (``0.1``:
        :math:`n_i = \\lfloor N_i / 10 \\rfloor`, at least 1) or ``"full"`` (the full local data). Default
        ``None``: chosen with an automatic step (the smallest minibatch whose noise takes a tenth of the
        step's budget, or the full local data when it would read half of it; see
        :func:`~pyro_fed.algorithms.adaptation.choose_batch_size`), the full local data with a given one.
    :param prior_weights: split of the prior :math:`\\varpi^i`: ``"proportional"`` (``N_i/N``),
        ``"uniform"`` (``1/b``) or a tensor.
    :param str plate: name of the data plate (found automatically when unambiguous).
    :param init_strategy: a Pyro init strategy, drawn afresh for every chain. Default ``None``: with an
        adapted preconditioner, each chain starts at an independent draw of the Laplace approximation the
        warm-up found (the mode plus :math:`\\sqrt m \\odot N(0, I)`), where the chosen step is known to be
        stable; otherwise at the prior median (:func:`~pyro.infer.autoguide.init_to_median`, which also
        starts the search for the mode). ``initial_params`` given to ``MCMC`` override both; with an
        automatic step, a start (given, or the strategy's) whose potential is above the posterior's typical
        level (:func:`~pyro_fed.algorithms.adaptation.typical_points`: where the chosen step is not known to
        be stable) is first pulled toward the mode along the line that joins them, its distance halved until
        it is at that level, as NUTS's warm-up carries its chains into the posterior's bulk. A site whose
        prior cannot be sampled (an improper flat prior, :class:`~pyro.distributions.ImproperUniform`) starts
        uniformly in :math:`(-2, 2)` on its unconstrained scale, whatever the strategy
        (:func:`~pyro_fed.model.sites.sampling_free`): nothing samples the prior.
    :param str gradient_mode: how an iteration runs: ``"auto"`` (default: traced once per shape, and
        compiled as soon as the rest of the run, at the pace of its fastest chunk so far, is projected to take
        more than 20 s traced, 8 s once the process has compiled before:
        :func:`~pyro_fed.kernels.chunks.auto_compile_seconds`), ``"compiled"`` (traced and compiled by
        TorchInductor from the start: about a second of compilation, tens of seconds the first time on a
        machine, then the fastest), ``"traced"`` (traced only) or ``"eager"`` (the Pyro model at every
        iteration: the reference). A model that cannot be traced or compiled falls back with a warning saying
        why. The draws are the same in every mode up to rounding.
    :param int thinning: iterations per draw: each :meth:`sample` returns the iterate after ``thinning``
        more iterations, so ``num_samples`` draws cover ``thinning * num_samples`` iterations and memory
        holds only the draws. Default ``None``: with an automatic step, half the autocorrelation time of the
        slowest direction at that step, at most 100 (draws nearly independent, as NUTS's; see
        :func:`~pyro_fed.algorithms.adaptation.thinning_for`); 1 with a given step.
    :param int chunk_size: iterations prepared and run per chunk (default 64).
    :param network: where the clients meet (a :class:`~pyro_fed.network.base.Network`): every reduction over
        the clients of the iterations goes through it. Default ``None``: all clients in this process
        (:class:`~pyro_fed.network.in_process.InProcessNetwork`).
    :param checkpoint: a file path (``str`` or ``os.PathLike``) where the run keeps a checkpoint, to
        resume it after an interruption (default ``None``: none). The run writes it after a chunk of
        iterations, once ``checkpoint_every`` draws per chain were computed since the last write, and when
        its last iteration is computed; atomically (a temporary file in the same directory, then renamed),
        so the file always holds a whole checkpoint. It holds tensors only, read by ``torch.load(path,
        weights_only=True)`` (see :mod:`pyro_fed.kernels.checkpoint`): the algorithm's state, what the
        warm-up chose (step size, preconditioner, mode, minibatch size, thinning...), the chains' initial
        points, the run's seeds and every generator's state, the iterations computed, the draws and their
        statistics so far, the network's counters, and a fingerprint of the configuration (the kernel's
        class and arguments, the number of chains, ``num_samples``, ``warmup_steps``, the model arguments'
        shapes and a hash of their content, the clients and their sizes). When the file exists at set-up,
        the run resumes from it instead of starting: no warm-up, the draws already computed served from the
        checkpoint, the rest computed from its state; a checkpoint written by a different configuration is
        refused with a ``ValueError`` naming what differs. The resumed run's draws, ``sample_stats`` and bits
        are those of the uninterrupted run bit for bit (``torch.equal``) with ``gradient_mode="traced"``,
        ``"compiled"`` or ``"eager"``; with ``"auto"`` only to rounding, as the switch to the compiled
        iteration follows the timings of each process. A finished run's checkpoint stays: running it again
        serves its draws (delete the file to start afresh). Where clients are held in several processes
        (:mod:`pyro_fed.network.distributed`), each holder writes its own file: give each a path of its own,
        e.g. with the rank in it (``f"run-{rank}.pt"``); they resume together, from the last checkpoint
        they all have (the one before the last is kept beside it, as ``path + ".previous"``, for holders
        that stopped between their writes).
    :param int checkpoint_every: draws per chain computed between checkpoints (at a chunk's end, so a write
        may come a chunk later). Default ``None``: a tenth of the run's draws (``warmup_steps + num_samples``,
        rounded up), or every chunk for a kernel driven by hand.
    :param algorithm: the subclass's :class:`~pyro_fed.algorithms.base.Algorithm`, built with its settings
        alone (its kernel's arguments).
    """

    def __init__(
        self,
        model: Callable,
        clients=None,
        *,
        algorithm: Algorithm,
        step_size: float | None = None,
        preconditioner=None,
        batch_size: int | float | str | None = None,
        prior_weights="proportional",
        plate: str | None = None,
        init_strategy: Callable | None = None,
        gradient_mode: str = "auto",
        thinning: int | None = None,
        chunk_size: int = 64,
        network: Network | None = None,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
    ):
        if "_arguments" not in self.__dict__:  # a subclass without a constructor of its own
            given = dict(locals())
            self._arguments = ((model, clients), {k: v for k, v in given.items() if k not in CALLED})
        self.model = model
        if not isinstance(algorithm, Algorithm) or algorithm.network is not None:
            raise TypeError(
                "algorithm must be a pyro_fed.algorithms.base.Algorithm built with its settings alone "
                f"(bound to each run by the kernel); got {algorithm!r}."
            )
        #: the algorithm's settings (an unbound :class:`~pyro_fed.algorithms.base.Algorithm`), which the
        #: warm-up reads; :attr:`algorithm` is the run's, bound to it
        self.settings = algorithm
        #: the checkpoint's file path and interval (see the parameters)
        self.checkpoint, self.checkpoint_every = check_checkpoint(checkpoint, checkpoint_every)
        if network is not None and not isinstance(network, Network):
            raise TypeError(
                f"network must be a pyro_fed.network.base.Network (for example InProcessNetwork()); got "
                f"{type(network).__name__}."
            )
        self._network = network
        self._in_process = InProcessNetwork()  # the default, one per kernel
        self.gradient_mode = check_mode(gradient_mode)
        check_clients(clients)
        self.clients = clients
        self.step_size = None if step_size is None else check_positive("step_size", step_size)
        self.preconditioner = check_preconditioner(preconditioner)
        #: the run's warm-up and the record of what it chose
        #: (:class:`~pyro_fed.kernels.warmup_adapter.WarmupAdapter`), built at set-up
        self.warmup: WarmupAdapter | None = None
        self.batch_size = check_batch_size(batch_size)
        self.thinning = check_positive_int("thinning", thinning, "chosen with an automatic step, else 1")
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        if isinstance(prior_weights, str) and prior_weights == "server" and not algorithm.server_step:
            raise ValueError(
                f"prior_weights='server': {type(self).__name__} has no server step to add the prior to: "
                "split it among the clients ('proportional', 'uniform' or a tensor), or use "
                "QlsdKernel(prior_on_server=True)."
            )
        self.prior_weights = prior_weights
        self.plate = plate
        if init_strategy is not None and not callable(init_strategy):
            raise TypeError(
                f"init_strategy={init_strategy!r}: give a Pyro init strategy, a function of a site such as "
                "pyro.infer.autoguide.init_to_median or init_to_value(values={...}), or leave it out "
                "(None: the warm-up chooses the chains' starts)."
            )
        self.init_strategy = init_strategy
        self.potential: FederatedPotential | None = None
        self.plan = ChainPlan(1, None, None)
        self._initial_params = None
        self._user_initial_params = None
        self._chain = 0
        self._served = 0  # draws served to MCMC in the current chain
        self._iterations_needed = None
        #: the run's iterations (:class:`~pyro_fed.kernels.chunks.ChunkRunner`), built at set-up
        self.runner: ChunkRunner | None = None
        self._convergence = None  # the end-of-run check, once computed
        self._start: checkpoints.Start | None = None  # where the run's chains started
        self._fingerprint: dict | None = None  # of the run's configuration, with a checkpoint
        self._checkpointed = 0  # draws per chain computed at the last checkpoint
        self._checkpoint_interval = 1  # draws per chain between checkpoints, fixed at set-up
        self._run: Run | None = None  # what the run gives the algorithm (see Algorithm.bind)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a kernel written for the contract before the algorithms held their warm-up traits: its methods
        # would be silently ignored (a noise measure the warm-up never calls chooses a wrong minibatch)
        moved = sorted(set(cls.__dict__) & MOVED_TO_ALGORITHM)
        if moved:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(moved)}: a kernel no longer says these. They belong to "
                "its algorithm (pyro_fed.algorithms.base.Algorithm: server_step and laplace_starts as class "
                "attributes, the methods taking the run as their last argument where they need the model), "
                "which the kernel builds with its settings and passes to FederatedKernel.__init__(..., "
                "algorithm=...); see docs/changes.md and the own-kernel tutorial."
            )
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording(cls.__dict__["__init__"])

    #: statistics that hold every client's iterate (``[draws, b, d]`` per chain), not a number per draw, with
    #: the name of their client dimension: :func:`~pyro_fed.to_inference_data` gives each an ArviZ group of
    #: its own, named after it
    client_iterates: dict[str, str] = {}

    # ------------------------------------------------------- Pyro MCMCKernel
    def build_potential(self, *args, network: Network | None = None, **kwargs) -> FederatedPotential:
        """The model's split into client potentials for these model arguments (no randomness drawn but
        the init strategy's)."""
        return FederatedPotential(
            self.model,
            args,
            kwargs,
            clients=self.clients,
            plate=self.plate,
            prior_weights=self.prior_weights,
            init_strategy=self.init_strategy or init_to_median,
            gradient_mode=self.gradient_mode,
            network=network,
        )

    def setup(self, warmup_steps: int, *args, **kwargs) -> None:
        self._meeting(self._setup, warmup_steps, *args, **kwargs)

    def _meeting(self, work: Callable, *args, **kwargs):
        """``work(*args, **kwargs)``, whose errors are every holder's where clients are held in several
        processes: a lost process is named (:meth:`~pyro_fed.network.base.Network.explain`), and an error of
        this one's own makes it leave the others, so that none waits for it
        (:meth:`~pyro_fed.network.base.Network.leave`)."""
        network = self._network or self._in_process
        try:
            return work(*args, **kwargs)
        except Exception as error:
            explained = network.explain(error)
            if explained is not error:
                raise explained from error
            network.leave(error)
            raise

    def _setup(self, warmup_steps: int, *args, **kwargs) -> None:
        """A run's set-up: the model's split, the seeds (or a checkpoint's), the warm-up and the chains'
        starts, the algorithm and its state, the runner of its iterations."""
        if self._continues_batched_run():
            self._chain += 1
            self._served = 0
            return
        self._warmup_steps = warmup_steps
        self._convergence = None
        network = self._network or self._in_process
        network.new_run()
        self.potential = pot = self.build_potential(*args, network=network, **kwargs)
        self._check_same_settings(network, warmup_steps)
        check_batch_size_fits(self.batch_size, pot.all_client_sizes)
        num_chains = self.plan.num_chains
        seed, adaptation_seed, saved = self._seeds(network, warmup_steps, args, kwargs)
        self.rng = Randomness(seed, pot.device)
        self.network = network.attach(len(pot.all_client_sizes), pot.dim, num_chains)
        self._chain, self._served = 0, 0
        self.warmup = warm = WarmupAdapter(
            self.settings,
            pot,
            step_size=self.step_size,
            preconditioner=self.preconditioner,
            batch_size=self.batch_size,
            thinning=self.thinning,
            gradient_mode=self.gradient_mode,
            warmup_steps=warmup_steps,
            name=type(self).__name__,
        )
        self._run = Run(
            network=network,
            num_chains=num_chains,
            dim=pot.dim,
            dtype=pot.dtype,
            device=pot.device,
            potential=pot,
            full_gradients=self._full_gradients,
            mode=warm.mode,
            step_size=self.step_size,
            thinning=self.thinning,
            num_samples=self.plan.num_samples,
        )
        positions, inverse_mass = self._starts(network, saved, adaptation_seed, num_chains)
        self._run = dataclasses.replace(
            self._run,
            chosen=self.adaptation,
            step=self.current_step_size,
            exact_gradients=self.full_local_batches,
            event_probability=warm.event_probability(),
        )
        if saved is None:
            warm.say()
            warm.warn_if_draws_dependent(self.plan.num_samples)
            self.warn_before_run()
        algorithm = warm.finished.bind(self._run)
        if saved is None:
            state = tuple(algorithm.init(positions))
            self._start = checkpoints.Start(positions, inverse_mass, (seed, adaptation_seed))
        else:
            state = checkpoints.algorithm_state(saved, pot.device)
        self.runner = self._runner(algorithm, state, positions, inverse_mass, network)
        if saved is not None:
            checkpoints.restore_run(saved, self.runner, pot.device)
        self._window_end = warm.next_window(self.runner.computed)
        thinning = self.current_thinning
        self._checkpointed = self.runner.computed // thinning
        if self.checkpoint_every is not None:
            self._checkpoint_interval = self.checkpoint_every
        elif self._iterations_needed is None:
            self._checkpoint_interval = 1
        else:  # about ten checkpoints over the run
            self._checkpoint_interval = max(1, math.ceil(self._iterations_needed // thinning / 10))

    def _check_same_settings(self, network: Network, warmup_steps: int) -> None:
        """Where the clients are held in several processes, every one must run the same kernel with the
        same settings (:func:`~pyro_fed.kernels.checkpoint.run_settings`, its own clients aside): another
        step size in one process made its clients step with it, a hybrid of two runs without a word, and
        another ``comm_prob`` or kernel left the processes in different collectives until one aborted.
        Refused in every process, naming the settings that differ from the first process's."""
        if not network.remote:
            return
        here = checkpoints.run_settings(self, warmup_steps, clients=False)
        first, differs = network.compare_with_first(here)
        if differs:
            fields = checkpoints.differences(first, here)
            shown = "; ".join(f"{f}: {first.get(f)!r} in the first, {here.get(f)!r} here" for f in fields)
            raise ValueError(
                "the processes holding the clients were given different kernels or settings: every one must "
                "build the same kernel with the same arguments (but its own clients), and call run with the "
                "same num_chains, num_samples and warmup_steps; "
                + (f"they differ in {shown}." if fields else "another process's differ from the first's.")
            )

    def _seeds(self, network: Network, warmup_steps: int, args, kwargs) -> tuple[int, int, dict | None]:
        """The run's seed and the warm-up's, and the checkpoint it resumes (``None``: a new run): drawn from
        the global RNG, so that ``pyro.set_rng_seed`` makes a run reproducible (the first holder's where
        clients are held in several places), or the checkpointed run's, for the streams it has not drawn
        yet."""
        seed, adaptation_seed = network.share(torch.randint(0, 2**62, (2,), device="cpu").tolist())
        saved = None
        if self.checkpoint is not None:
            self._fingerprint = checkpoints.fingerprint(self, warmup_steps, args, kwargs)
            saved = checkpoints.load_matching(self.checkpoint, self._fingerprint, network)
        if saved is not None:
            seed, adaptation_seed = saved["meta"]["seeds"]
        return seed, adaptation_seed, saved

    def _starts(
        self, network: Network, saved: dict | None, adaptation_seed: int, num_chains: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chains' initial points ``[C, d]`` and the run's inverse mass, after the warm-up (which needs
        chain 0's initial point), with the iterations they imply; a resumed run's are the checkpoint's (its
        preconditioner the draws' if they were measured)."""
        pot, warm = self.potential, self.warmup
        if saved is None:
            given = self._initial_values(num_chains)
            positions = torch.stack([pot.flatten(p) for p in given]).to(pot.device, pot.dtype)
            positions = network.share(positions)
            pot.check_initial_points(positions)
            inverse_mass = warm.choose(positions[0], adaptation_seed, self._run)
            # the user's starts or strategy, else the warm-up's Laplace approximation (see init_strategy)
            laplace = (
                self.init_strategy is None
                and self.plan.initial_params is None
                and self._user_initial_params is None
            )
            positions = warm.starts(positions, self.rng, laplace)
        else:
            self._start, chosen = checkpoints.start(saved, pot.device)
            warm.resume(chosen)
            positions, inverse_mass = self._start.positions, self._start.inverse_mass
            if chosen is not None:
                inverse_mass = chosen.preconditioner
        self._initial_params = [pot.unconstrained_params(p) for p in positions]
        self._iterations_needed = (
            None
            if self.plan.num_samples is None
            else (self._warmup_steps + self.plan.num_samples) * self.current_thinning
        )
        return positions, inverse_mass

    def _runner(
        self, algorithm: Algorithm, state: tuple, positions: torch.Tensor, inverse_mass: torch.Tensor, network
    ) -> ChunkRunner:
        """The runner of the algorithm's iterations from ``state``: chunks of whole draws, the clients'
        minibatch sampler, and the constants every iteration reads."""
        pot, num_chains, thinning = self.potential, self.plan.num_chains, self.current_thinning
        batch = self.current_batch_size
        # pre-drawn per iteration: minibatch indices and their sort keys, and at most b x d random numbers
        # (noise, quantisation), for all clients: every holder of clients runs chunks of the same length
        per_iteration = num_chains * network.num_clients * (2 * (batch or 0) + pot.dim)
        # a chunk holds a whole number of draws
        draws_per_chunk = max(1, min(self.chunk_size, MAX_CHUNK_ELEMENTS // per_iteration) // thinning)
        chunk = draws_per_chunk * thinning
        minibatches = (
            None
            if self.full_local_batches
            else pot.minibatch_sampler(batch, chunk_size=chunk, num_chains=num_chains, rng=self.rng)
        )
        constants = _iteration_constants(self.current_step_size, inverse_mass, positions.clone())
        return ChunkRunner(
            algorithm,
            state,
            pot,
            self.rng,
            minibatches,
            # later chains are served from the buffer only when a run will ask for them
            DrawBuffer(thinning, keep=num_chains > 1 and self._iterations_needed is not None),
            constants,
            chunk=chunk,
            iterations_needed=self._iterations_needed,
            # a model evaluated client by client is run as written (see FederatedPotential)
            mode=self.gradient_mode if pot.gradients.vectorized else "eager",
            # prepared afresh for every run: a traced iteration holds what the model read (its arguments,
            # and data it reads from elsewhere, which no comparison of arguments can see) as constants
            what=f"the {type(self).__name__} iteration",
        )

    @property
    def current_run(self) -> Run | None:
        """What the current run gives its algorithm (:class:`~pyro_fed.algorithms.base.Run`: the network,
        the shapes, the model's gradients, what the warm-up chose; ``None`` before set-up)."""
        return self._run

    @property
    def algorithm(self) -> Algorithm | None:
        """The run's :class:`~pyro_fed.algorithms.base.Algorithm` (``None`` before set-up)."""
        return None if self.runner is None else self.runner.algorithm

    @property
    def minibatches(self) -> MinibatchSampler | None:
        """The clients' minibatch sampler of the run (``None``: full local batches, or before set-up)."""
        return None if self.runner is None else self.runner.minibatches

    def engine(self):
        """The run's prepared iteration (:class:`~pyro_fed.engine.chunk_engine.ChunkEngine`)."""
        return self.runner.engine()

    @property
    def preparation_seconds(self) -> float:
        """Seconds spent tracing and compiling (the iteration and the model's gradients) in this run."""
        if self.runner is not None:
            return self.runner.preparation_seconds
        return 0.0 if self.potential is None else self.potential.preparation_seconds

    @property
    def adaptation(self) -> Adaptation | None:
        """What the warm-up chose (:class:`~pyro_fed.algorithms.adaptation.Adaptation`: the step, the
        preconditioner, the mode, the minibatch, the thinning, and why), ``None`` when the user gave
        everything or before set-up; the record of :attr:`warmup`."""
        return None if self.warmup is None else self.warmup.chosen

    @property
    def current_step_size(self) -> float | None:
        """The step size :math:`\\gamma` of the current run: the user's, or the one the warm-up chose."""
        return self.step_size if self.warmup is None else self.warmup.step_size

    @property
    def current_batch_size(self) -> int | float | None:
        """The minibatch size per client of the current run (``None``: full local batches): the user's, or
        the one the warm-up chose."""
        if self.warmup is None:
            return None if self.batch_size == "full" else self.batch_size
        return self.warmup.batch_size

    @property
    def current_thinning(self) -> int:
        """Iterations per draw of the current run: the user's, or the one the warm-up chose (1 with a given
        step size and no thinning)."""
        return (self.thinning or 1) if self.warmup is None else self.warmup.thinning

    @property
    def full_local_batches(self) -> bool:
        """Whether every client reads all its data at every iteration of the current run."""
        return self.warmup.full_local_batches

    def iteration_data(self) -> int:
        """Data evaluations per iteration of the current run, summed over clients (one chain's)."""
        return self.warmup.iteration_data()

    def warn_before_run(self) -> None:
        """The kernel's own warnings once the warm-up chose its settings, before the chains start (pSGLD's,
        QLSD's, FSGLD's); none by default. FALD's client drift is said where the warm-up's settings are
        finished (:meth:`~pyro_fed.algorithms.base.Algorithm.finish_adaptation`)."""

    def _full_gradients(self, points: torch.Tensor) -> torch.Tensor:
        """Every client's full gradient at each of ``r`` common points ``[r, d]``: ``[r, b, d]``. ``r`` is
        padded to a power of two, so that at most ``log2(C) + 1`` shapes are ever prepared."""
        pot, r = self.potential, points.shape[0]
        padded = points[torch.arange(2 ** math.ceil(math.log2(r)), device=points.device).clamp(max=r - 1)]
        return pot.full_client_grads(padded[:, None, :].expand(-1, pot.num_clients, -1))[:r]

    def _continues_batched_run(self) -> bool:
        """Whether this ``setup`` is Pyro's for the next chain of a batched run whose chains are computed."""
        return (
            self.potential is not None
            and self._chain + 1 < self.plan.num_chains
            and self._iterations_needed is not None
            and self._served * self.current_thinning == self._iterations_needed
        )

    def _initial_values(self, num_chains: int) -> list[dict[str, torch.Tensor]]:
        """The user's initial values if given (checked), else a fresh draw of the init strategy for each
        chain."""
        pot = self.potential
        if self.plan.initial_params is not None and num_chains > 1:
            given = [{k: v[c] for k, v in self.plan.initial_params.items()} for c in range(num_chains)]
        elif self._user_initial_params is not None:
            given = [self._user_initial_params] * num_chains
        else:
            flats = [pot.initial_flat] + [pot.draw_initial_flat() for _ in range(num_chains - 1)]
            return [pot.unconstrained_params(flat) for flat in flats]
        missing = [s.name for s in pot.latent_sites if s.name not in given[0]]
        if missing:
            raise ValueError(
                f"initial_params lacks the latent sites {missing}: give an unconstrained value for every "
                f"latent site ({[s.name for s in pot.latent_sites]}), or leave initial_params out."
            )
        for site in pot.latent_sites:
            value = torch.as_tensor(given[0][site.name])
            if value.shape != site.shape:
                per_chain = f", after the leading dimension of {num_chains} chains" if num_chains > 1 else ""
                raise ValueError(
                    f"initial_params[{site.name!r}] has shape {tuple(value.shape)}{per_chain}; the site's "
                    f"unconstrained value has shape {tuple(site.shape)}."
                )
        return given

    # -------------------------------------------------------- serving the draws
    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        draw = self._served
        if (draw + 1) * self.current_thinning > self.runner.computed:
            self._meeting(self.runner.run_chunk)
            # before the checkpoint: a checkpoint past the window holds the preconditioner of its draws
            window = self._window_end
            if window is not None and self.runner.computed >= window[1] * self.current_thinning:
                self._meeting(self._adapt_to_draws, *window)
                self._window_end = self.warmup.next_window(self.runner.computed)
            if self.checkpoint is not None:
                self._meeting(self._write_checkpoint)
        self._served += 1
        return self.potential.unconstrained_params(self.runner.buffer.draw(draw, self._chain))

    def _adapt_to_draws(self, first: int, end: int) -> None:
        """The warm-up's measure of the preconditioner from the chains' draws ``first`` to ``end - 1``
        (:meth:`~pyro_fed.kernels.warmup_adapter.WarmupAdapter.adapt_to_draws`), given to the iterations."""
        draws = self.runner.buffer.all_draws(first)[:, : end - first]
        draws = torch.as_tensor(draws, device=self.potential.device)
        if not self.warmup.adapt_to_draws(draws, self._start.seeds[1], self.algorithm, self._run):
            return
        renewed, (_, start, _) = self.adaptation, self.runner.constants
        self.runner.constants = _iteration_constants(renewed.step_size, renewed.preconditioner, start)
        self.warmup.warn_if_draws_dependent(self.plan.num_samples)  # the new step may be smaller

    def _write_checkpoint(self) -> None:
        """After a chunk: write the checkpoint when ``checkpoint_every`` draws per chain were computed since
        the last one, or the run's last iteration was."""
        computed = self.runner.computed // self.current_thinning
        finished = self.runner.remaining_iterations() == 0
        if not finished and computed - self._checkpointed < self._checkpoint_interval:
            return
        contents = checkpoints.capture(
            fingerprint=self._fingerprint, runner=self.runner, start=self._start, adaptation=self.adaptation
        )
        checkpoints.save(self.checkpoint, contents)
        self._checkpointed = computed

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        if self._initial_params is None:
            return None
        return self._initial_params[self._chain]

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._user_initial_params = params

    @property
    def transforms(self):
        return None if self.potential is None else self.potential.transforms

    def sample_stats(self, chain: int | None = None) -> dict[str, np.ndarray]:
        """Per-draw statistics of the served draws after warm-up of ``chain`` (default: the current one), as
        NumPy arrays (ArviZ's ``sample_stats`` group, :func:`~pyro_fed.to_inference_data`):
        ``diverging`` (a step was reverted), ``uploaded_bits`` and ``downloaded_bits`` (cumulative, summed
        over clients, from the start of warm-up; the adaptation, done once for all chains, on chain 0's), the
        algorithm's per-draw statistics (:meth:`~pyro_fed.algorithms.base.Algorithm.report`)
        (FALD's ``dispersion``, D-ULA's ``consensus_error``) and its coins (FALD's ``communicated``,
        VR-FALD⋆'s ``refreshed``, QLSD's ``active_clients`` and ``snapshot``). With ``thinning > 1`` the flags
        say whether it happened in the draw's iterations, the counts are summed over them."""
        chain = self._chain if chain is None else chain
        return self.runner.buffer.sample_stats(chain, self._warmup_steps, self._served)

    @property
    def end_of_run_checks(self) -> dict | None:
        """The end-of-run checks of all the chains' draws (:func:`pyro_fed.algorithms.convergence.check`):
        per unconstrained coordinate ``r_hat``, ``ess_bulk``, ``ess_tail`` and ``mcse_mean``, and the
        ``problems`` (sentences, the warning's); ``None`` before every chain's draws are computed."""
        return self._end_of_run_check()

    def diagnostics(self) -> dict:
        """The current chain's diagnostics, a few numbers as NUTS's (``mcmc.diagnostics()`` gathers them per
        chain): the divergent draws, the step size, the averaging rounds, the bits uploaded and downloaded,
        the MB uploaded and per effective draw, the bytes this process sent, the end-of-run checks'
        verdict (``"passed"``, or their problems) and the warm-up's one line
        (:meth:`~pyro_fed.kernels.warmup_adapter.WarmupAdapter.summary`). The per-draw statistics are
        ArviZ's ``sample_stats`` (:meth:`sample_stats`), the preconditioner is the warm-up's
        (``kernel.adaptation``), the checks' figures per coordinate are :attr:`end_of_run_checks`."""
        stats = self.sample_stats()
        diverging = stats.get("diverging", np.zeros(0, dtype=bool))
        if len(diverging) and diverging.mean() > DIVERGING_WARNING:
            messages.warn(
                f"{int(diverging.sum())} of the {len(diverging)} draws of chain {self._chain} diverged (a "
                "step went non-finite or exploded and was reverted): the draws are not a sample of the "
                f"posterior. Pass a smaller step_size (now {self.current_step_size:.3g}"
                + (", chosen automatically" if self.step_size is None else "")
                + ").",
            )
        last, buffer = self._served - 1, self.runner.buffer
        convergence = self._end_of_run_check()
        verdict = None
        if convergence is not None:
            verdict = convergence["problems"] or "passed"
        return {
            "divergences": np.flatnonzero(stats.get("diverging", [])).tolist(),
            "step size": self.current_step_size,
            "communication rounds": buffer.rounds_at(last, self._chain),
            "uploaded bits": buffer.bits("uploaded", last, self._chain),
            "downloaded bits": buffer.bits("downloaded", last, self._chain),
            "uploaded MB": buffer.bits("uploaded", last, self._chain) / 8e6,
            "MB per effective draw": self._megabytes_per_effective_draw(convergence),
            # what crossed a wire (none in one process): this process's, for all its chains
            "sent bytes": self.network.sent_bytes,
            "end-of-run checks": verdict,
            # what the warm-up chose, in its one line (None: the user gave everything)
            "warm-up": self.warmup.summary() or None,
        }

    def _megabytes_per_effective_draw(self, convergence: dict | None) -> float:
        """What the clients uploaded over all the chains (warm-up and the warm-up's own rounds included), in
        MB (``8e6`` bits), per effective draw: the smallest bulk ESS over the unconstrained coordinates of all
        the chains' draws after warm-up (the end-of-run checks'); ``nan`` before every chain's draws are
        computed or where no coordinate has an ESS."""
        if convergence is None:
            return math.nan
        ess = [value for value in convergence["ess_bulk"].values() if math.isfinite(value)]
        if not ess or min(ess) <= 0:
            return math.nan
        last, buffer = self._served - 1, self.runner.buffer
        total = sum(buffer.bits("uploaded", last, chain) for chain in range(self.plan.num_chains))
        return total / 8e6 / min(ess)

    def _end_of_run_check(self) -> dict | None:
        """Once every chain's draws are computed (at the end of the first chain Pyro is served: the chains
        run as one batch), Stan's checks on all of them (:func:`pyro_fed.algorithms.convergence.check`) and
        the warm-up's own (:meth:`warmup_problems`), with one warning naming what failed; the figures per
        coordinate (unconstrained, named ``site[index]``) and the problems. ``None`` for a kernel driven by
        hand."""
        if self._iterations_needed is None or self.runner.computed < self._iterations_needed:
            return None
        if self._convergence is None:
            pot = self.potential
            draws = self.runner.buffer.all_draws(self._warmup_steps)
            report = convergence.check(draws, pot.space.coordinate_names)
            problems = report.problems + self.warmup_problems()
            if problems:
                messages.warn(
                    "pyro_fed's end-of-run checks (unconstrained coordinates, all chains): "
                    + "; ".join(problems)
                    + f". More draws (num_samples), more iterations per draw (thinning, now "
                    f"{self.current_thinning}) or more chains tell more; a problem that stays is the model's "
                    "or the sampler's.",
                )
            self._convergence = {**report.as_dict(), "problems": problems}
        return self._convergence

    def warmup_problems(self) -> list[str]:
        """The warm-up's own checks that were not met, each a sentence
        (:meth:`~pyro_fed.kernels.warmup_adapter.WarmupAdapter.problems`)."""
        return [] if self.warmup is None else self.warmup.problems()

    def logging(self) -> OrderedDict:
        """What the progress bar shows: the step size, the divergences, the averaging rounds and the bits
        uploaded so far (this chain, warm-up included), and the preparation time when it was noticeable."""
        last, buffer = self._served - 1, self.runner.buffer
        entries = [
            ("step", f"{self.current_step_size:.3g}"),
            ("divergences", buffer.divergences_at(last, self._chain)),
            ("rounds", buffer.rounds_at(last, self._chain)),
            ("Mbits up", f"{buffer.bits('uploaded', last, self._chain) / 1e6:.3g}"),
            ("Mbits down", f"{buffer.bits('downloaded', last, self._chain) / 1e6:.3g}"),
        ]
        seconds = self.preparation_seconds
        if seconds > 1:
            entries.append(("prepared in", f"{math.ceil(seconds)} s"))
        return OrderedDict(entries)
