"""The contract every federated algorithm keeps.

An :class:`Algorithm` is everything a kernel runs, as pure tensor code over the clients held here, meeting
the other clients only through its :class:`~pyro_fed.network.base.Network`:

- its **state**, a NamedTuple of tensors with a leading chain dimension (:attr:`~Algorithm.state_type`), and
  :meth:`~Algorithm.init`, all clients of chain ``c`` at an initial point;
- the **per-chunk inputs**: the host coins of a chunk (:meth:`~Algorithm.coins`: communication,
  participation, refreshes) and the device randomness its iterations read (:meth:`~Algorithm.inputs`:
  noise, compressor uniforms), drawn ahead so that an iteration is a fixed sequence of tensor operations;
- the **step** (:meth:`~Algorithm.step`), one iteration given the clients' gradient estimates;
- the **draw** and its statistics, by one route: what each iteration keeps of its state, computed where its
  clients are held (:meth:`~Algorithm.summary`), which a chunk turns into its draws (``"position"``) and
  per-draw statistics at its end, with one meeting (:meth:`~Algorithm.report`);
- what **meets** the other clients, and when: the iterations whose step meets them
  (:meth:`~Algorithm.meeting_iterations`; the others run :meth:`~Algorithm.local_step`);
- which clients **work** in an iteration (:meth:`~Algorithm.working_clients`): the gradient oracle evaluates
  only those (QLSD's active clients), all of them by default;
- its **per-iteration traffic** (:meth:`~Algorithm.traffic`), the bits each iteration sent, counted on the
  host from the coins;
- its **out-of-step events** (:meth:`~Algorithm.event_iterations`, :meth:`~Algorithm.event`): rare, expensive
  work (VR-FALD⋆'s refresh, QLSD++'s snapshot) that splits a chunk rather than sitting inside the compiled
  iteration.

An algorithm is built in two phases. Its kernel builds it with its **settings** alone (the user's
arguments, ``None`` where automatic), when the kernel is constructed; that algorithm tells the warm-up what it
needs adapted (its **warm-up traits**: :attr:`~Algorithm.server_step`, :meth:`~Algorithm.adaptation_noise`,
:meth:`~Algorithm.finish_adaptation`...). When a run starts, after the warm-up, :meth:`~Algorithm.bind` gives
it the run (:class:`Run`: the network, the shapes, the model's gradients and what the warm-up chose) and
resolves what its settings left automatic (VR-FALD⋆'s refresh probability, QLSD⋆'s fixed point, FSGLD's
surrogates...); the Pyro adapter (:mod:`pyro_fed.kernels`) then only runs the bound algorithm: the iterations
in chunks (:mod:`pyro_fed.engine.chunk_engine`), the divergence check, the buffers of draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..engine.randomness import Randomness
from ..network.base import Network

if TYPE_CHECKING:
    from .adaptation import Adaptation


@dataclass(kw_only=True)
class Run:
    """What a run gives its algorithm (:meth:`Algorithm.bind` and the warm-up traits that need the model):
    where the clients meet, the state's shape, the model's gradients and what the user and the warm-up
    chose. The algorithms read the model only through these.

    :param network: where the clients meet, attached to the run.
    :param int num_chains: independent chains ``C`` run together.
    :param int dim: the parameter dimension ``d``.
    :param dtype: the floating type of the state.
    :param device: the device of the state.
    :param potential: the model's split into client potentials
        (:class:`~pyro_fed.model.potential.FederatedPotential`): the held clients' gradients
        (``full_client_grads``, ``full_gradient_fn``), the whole potential's (``total_gradient``), every
        client's data size (``all_client_sizes``), the coordinates' names (``space``), the server's prior
        (``server_prior``).
    :param full_gradients: every held client's full gradient at each of ``r`` common points: ``[r, d]`` to
        ``[r, b_h, d]``.
    :param mode: ``mode(what, cost, remedy)``, the potential's mode for an algorithm's own use of it (QLSD⋆'s
        fixed point, FSGLD's surrogates): the warm-up's, or one found by L-BFGS, with a warning naming
        ``what`` it is for, its ``cost`` and the ``remedy`` where the search stops short.
    :param step_size: the user's step size (``None``: automatic).
    :param thinning: the user's thinning (``None``: automatic).
    :param num_samples: the draws per chain after warm-up (``None``: a kernel driven by hand).
    :param chosen: what the warm-up chose (``None``: the user gave everything).
    :param step: the run's step size (the user's, or the warm-up's).
    :param exact_gradients: whether the clients read their full local data at every iteration.
    :param event_probability: the automatic probability per iteration of an event that evaluates all the
        data (VR-FALD⋆'s refresh, QLSD++'s snapshot): see
        :func:`~pyro_fed.algorithms.adaptation.refresh_probability`.
    """

    network: Network
    num_chains: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    potential: object
    full_gradients: Callable[[torch.Tensor], torch.Tensor]
    mode: Callable[[str, str, str], torch.Tensor]
    step_size: float | None = None
    thinning: int | None = None
    num_samples: int | None = None
    chosen: Adaptation | None = None
    step: float | None = None
    exact_gradients: bool = False
    event_probability: float = 0.0


@dataclass(kw_only=True)
class Algorithm:
    """What every federated algorithm provides; subclasses (one per algorithm module) add their settings.

    Built with its settings alone (the run's fields below left out) it is the kernel's description of the
    sampler, which the warm-up reads; :meth:`bind` fills the run's fields (a subclass derives what it
    precomputes from them in ``__post_init__``, when ``network`` is set).

    :param network: where the clients meet, attached to the run (it knows every client of the run,
        :attr:`num_clients`, and which are held here, :attr:`held_clients`).
    :param int num_chains: independent chains ``C`` run together.
    :param int dim: the parameter dimension ``d``.
    :param dtype: the floating type of the state.
    :param device: the device of the state.

    The state's client axis holds the clients held here (:attr:`num_held` of them; all in one process); the
    host coins are drawn for every client of the run (:attr:`num_clients`), so that every holder draws the
    same coins and counts the same bits.
    """

    network: Network | None = None
    num_chains: int = 0
    dim: int = 0
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    #: the state NamedTuple
    state_type: ClassVar[type]

    # ---------------------------------------------------------------- the two phases
    def bind(self, run: Run) -> Algorithm:
        """The algorithm that runs ``run``: these settings, the run's fields filled, and what the settings
        left automatic resolved for the run (:meth:`resolve`)."""
        return dataclasses.replace(
            self,
            network=run.network,
            num_chains=run.num_chains,
            dim=run.dim,
            dtype=run.dtype,
            device=run.device,
            **self.resolve(run),
        )

    def resolve(self, run: Run) -> dict:
        """The settings that depend on the run, ``{field: value}`` (VR-FALD⋆'s automatic refresh probability,
        from the minibatch the warm-up chose): none by default."""
        return {}

    # ---------------------------------------------------------------- the warm-up traits
    #: whether a server takes the algorithm's steps on the whole potential (QLSD), rather than every client on
    #: its own (FALD): the warm-up then chooses the step for the stiffness of the sum of the clients'
    #: potentials, and the prior may stay on the server (``prior_weights="server"``)
    server_step: ClassVar[bool] = False
    #: whether the chains start at draws of the warm-up's Laplace approximation when no start is given (with
    #: the run's inverse mass as its covariance: an algorithm whose run's inverse mass is not that
    #: approximation, pSGLD's identity, starts from the init strategy's points instead)
    laplace_starts: ClassVar[bool] = True

    def averages_every_iteration(self) -> bool:
        """Whether every iteration ends with all clients at their average (FALD with ``comm_prob = 1``): their
        local steps are then one Langevin step of size :math:`\\gamma / b` on :math:`U`, stable as that step
        is, whatever each client's own curvature (the warm-up takes the stiffness of :math:`U` then)."""
        return False

    def average_step(self) -> bool:
        """Whether the warm-up sets the step for the clients' average, one Langevin step of :math:`\\gamma /
        b` on :math:`U` (FALD's family, whose :meth:`finish_adaptation` then keeps each client's own steps
        stable and its drift small), rather than for each client's own potential: by default where every
        iteration ends at the average (:meth:`averages_every_iteration`)."""
        return self.averages_every_iteration()

    def upload_rate(self, run: Run) -> float:
        """The expected number of rounds per iteration in which every client uploads ``d`` floats (1 by
        default). The warm-up's pilot run, which uploads a gradient per particle at every iteration, runs for
        at most ``warmup_steps * thinning * upload_rate`` iterations: as many rounds per particle as a
        chain's warm-up, so that it never dominates the communication of a sampler that communicates
        rarely."""
        return 1.0

    def random_at_full_batch(self, run: Run) -> bool:
        """Whether the gradient estimates are random even with full local batches (compression, partial
        participation): the warm-up then measures their noise with full batches too."""
        return False

    def gradient_evaluations(self, minibatches: bool) -> int:
        """Evaluations of each datum of a minibatch (or of the full local data) per iteration: 1, or 2 for
        a control variate's two points (the warm-up chooses minibatches only where they evaluate at most half
        the data)."""
        return 1

    def reads_minibatches(self) -> bool:
        """Whether the warm-up may choose minibatches for it (DG-LMC's local steps share their iteration's
        data: full local batches with more than one)."""
        return True

    def chosen_step(self, client_step: float, run: Run) -> float:
        """The algorithm's step size from the adaptation's step (a client's, or the server's): the same by
        default."""
        return client_step

    def warmup_preconditioner(self, curvature: torch.Tensor) -> torch.Tensor | None:
        """The inverse mass the warm-up chooses the step for, from the Hessian diagonal of :math:`U` at the
        mode (``[d]``), when the algorithm has its own (pSGLD: the stationary value of its adaptive
        :math:`G`); ``None`` (the default): the warm-up's Laplace approximation, diagonal or dense."""
        return None

    def adaptation_noise(
        self, minibatch_gradients: Callable, mode: torch.Tensor, points: torch.Tensor, run: Run
    ) -> torch.Tensor:
        """``[R, P, b, d]`` draws of what makes the clients' gradient estimates noisy at ``P`` typical points
        ``points`` (``[P, d]``, draws of the Laplace approximation around ``mode``): their minibatch gradients
        (``minibatch_gradients`` maps points ``[P, d]`` to ``[R, P, b, d]`` on ``R`` minibatches). Samplers
        with control variates measure the error of their own estimate instead; a server's estimate is one
        "client" (``b = 1``). Whatever it measures, it must draw the clients' estimates from
        ``minibatch_gradients``: one that never calls it cannot see a minibatch's noise, and the warm-up then
        keeps full local batches, with a warning."""
        return minibatch_gradients(points)

    #: whether :meth:`finish_adaptation` has a last word of its own: the warm-up then does not measure the
    #: preconditioner again from the chains' draws (which the algorithm's word may depend on)
    finishes_adaptation: ClassVar[bool] = False

    def finish_adaptation(self, chosen: Adaptation, run: Run) -> tuple[Adaptation, Algorithm, list[str]]:
        """What the warm-up chose (``chosen``), with the algorithm's own last word (D-ULA: a step its graph's
        mixing allows), the algorithm with the settings that word resolved (DG-LMC's tolerances), and the
        problems it found, each a sentence that the end-of-run checks repeat: as they are by default."""
        return chosen, self, []

    def finish_window(self, algorithm: Algorithm, chosen: Adaptation, run: Run) -> Adaptation:
        """These settings' word on what the warm-up measured again from the chains' draws in a window
        (``chosen``), for the run's bound ``algorithm``: FALD's family chooses its automatic communication
        setting again (the bound algorithm takes it) and bounds the new step as :meth:`finish_adaptation`
        does; as it is by default."""
        return chosen

    @property
    def num_clients(self) -> int:
        """Every client of the run, wherever it is held: ``b``."""
        return self.network.num_clients

    @property
    def held_clients(self) -> slice:
        """The clients held here, in the run's order (all of them in one process)."""
        return self.network.held(self.network.num_clients)

    @property
    def num_held(self) -> int:
        """The clients held here: the length of the state's client axis."""
        held = self.held_clients
        return held.stop - held.start

    def held(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """The held clients' part of ``values`` drawn for all the run's clients (axis ``dim``; a part
        broadcast to every client, of size 1 there, as it is): the host coins are drawn for every client,
        wherever it is held, so that every holder counts the bits of all of them, and each keeps its own.
        (The device randomness of the clients is drawn by blocks, each holder drawing its own:
        :meth:`~pyro_fed.engine.randomness.Randomness.client_normal`.)"""
        if values.shape[dim] == 1:
            return values
        return values.narrow(dim, self.held_clients.start, self.num_held)

    def client_normal(self, rng: Randomness, *leading: int) -> torch.Tensor:
        """Standard normal noise of the held clients, ``[*leading, b_h, d]``: each client's from its block's
        stream (:meth:`~pyro_fed.engine.randomness.Randomness.client_normal`), wherever it is held."""
        return rng.client_normal(
            *leading, num_clients=self.num_clients, held=self.held_clients, dim=self.dim, dtype=self.dtype
        )

    def client_uniform(self, rng: Randomness, *leading: int) -> torch.Tensor:
        """Uniforms of the held clients, ``[*leading, b_h, d]``, drawn as :meth:`client_normal`."""
        return rng.client_uniform(
            *leading, num_clients=self.num_clients, held=self.held_clients, dim=self.dim, dtype=self.dtype
        )

    def init(self, positions: torch.Tensor):
        """The initial state, all clients of chain ``c`` at ``positions[c]`` (``[C, d]``)."""
        raise NotImplementedError

    def coins(self, rng: Randomness, first_iteration: int, num_iterations: int) -> dict[str, np.ndarray]:
        """The host coins of the ``num_iterations`` iterations from ``first_iteration`` on, ``{name: [K, C,
        ...]}`` (booleans or iteration numbers)."""
        raise NotImplementedError

    def inputs(self, rng: Randomness, coins: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        """The device inputs of a chunk whose coins are ``coins``, each with a leading dimension of the
        chunk's iterations: the coins as tensors and the randomness (noise, uniforms)."""
        raise NotImplementedError

    def step(self, state, gradients: Callable, inputs: tuple[torch.Tensor, ...], step_size: torch.Tensor):
        """One iteration (a pure tensor function): the new state. ``gradients`` maps client points ``[...,
        C, b, d]`` to this iteration's gradient estimates; ``inputs`` is this iteration's row of
        :meth:`~pyro_fed.algorithms.base.Algorithm.inputs`; ``step_size`` is :math:`\\gamma`,
        preconditioned (see :func:`~pyro_fed.algorithms.langevin.langevin_step`)."""
        raise NotImplementedError

    #: whether an iteration reads the gradients of some of the clients only (:meth:`working_clients`)
    selects_clients: ClassVar[bool] = False

    def working_clients(self, coins: dict[str, np.ndarray], state) -> np.ndarray:
        """``[K, C, b]`` bool, every client of the run (wherever it is held): the clients whose gradient
        estimates each iteration of a chunk reads, when :attr:`selects_clients`, from the chunk's coins and
        the state it starts from (FSGLD's round goes on from the last chunk). The gradient oracle then
        evaluates those alone (:meth:`~pyro_fed.FederatedPotential.working_gradients`) and
        gives the others zeros, which :meth:`step` must not read: an iteration costs the work of its working
        clients, not of all of them."""
        raise NotImplementedError

    def meeting_iterations(self, coins: dict[str, np.ndarray]) -> np.ndarray:
        """``[K]`` bool: the iterations of a chunk whose step meets other clients (all, by default). The
        others run :meth:`local_step`: where clients are held in several processes, they exchange nothing
        then."""
        return np.ones(len(next(iter(coins.values()))), dtype=bool)

    def local_step(
        self, state, gradients: Callable, inputs: tuple[torch.Tensor, ...], step_size: torch.Tensor
    ):
        """The step of an iteration that :meth:`meeting_iterations` leaves out: what :meth:`step` gives when
        its coins keep every client to itself, computed without the network (:meth:`step` by default)."""
        return self.step(state, gradients, inputs, step_size)

    def points(self, state) -> torch.Tensor:
        """``[C, m, d]``: the points held here at which the next step evaluates gradients (the held clients'
        iterates, or the server's), read without meeting: a run reverts a step that moved one of them out of
        its bounds before the model is evaluated there. None by default (``m = 0``)."""
        return torch.zeros(self.num_chains, 0, self.dim, dtype=self.dtype, device=self.device)

    def summary(self, state) -> dict[str, torch.Tensor]:
        """What an iteration keeps of its state for its draw and per-draw statistics (``{name: [C, ...]}``),
        computed where the clients are held, without meeting:
        :meth:`~pyro_fed.algorithms.base.Algorithm.report` turns a chunk's summaries into its draws with one
        meeting. A server's iterate is the draw itself (``{"position":
        state.server}``, ``[C, d]``, reported as it is); the clients' average is kept as the held clients'
        moments, combined at the chunk's end (FALD)."""
        raise NotImplementedError

    def report(self, summaries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The draws (``"position"``, ``[K, C, d]``) and statistics (``{name: [K, C, ...]}``) of a chunk's
        ``K`` iterations from their :meth:`summary` stacked (``[K, C, ...]`` each): as they are by
        default."""
        return summaries

    def traffic(self, coins: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What each iteration of a chunk sent, from its coins: uploaded bits, downloaded bits (each summed
        over all clients) and whether it was a communication round, each ``[K, C]``."""
        raise NotImplementedError

    def coin_statistics(self, coins: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The coins recorded per draw (``[K, C]``: booleans, or counts): all of them by default."""
        return coins

    def event_iterations(self, coins: dict[str, np.ndarray]) -> np.ndarray:
        """``[K]`` bool: the iterations of a chunk preceded by an out-of-step event (none by default)."""
        return np.zeros(len(next(iter(coins.values()))), dtype=bool)

    def event(self, state, coins: dict[str, np.ndarray]) -> Callable:
        """The out-of-step event before an iteration whose coins are ``coins`` (``{name: [C, ...]}``),
        computed from the state before that iteration: the function then applied to the state after it."""
        raise NotImplementedError
