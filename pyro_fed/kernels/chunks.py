"""How a run computes its draws: a chunk of iterations at a time, as one prepared function.

:class:`ChunkRunner` is the part of a run that iterates, with explicit inputs: the run's
:class:`~pyro_fed.algorithms.base.Algorithm` and its state, the potential's gradients, the randomness and
the minibatches, the network, the draw buffer. It runs the iteration as a pure tensor function with the
divergence revert (a select, not a branch), its pre-drawn inputs, the prepared engine
(:mod:`pyro_fed.engine.chunk_engine`: traced or compiled once per shape), the automatic compilation of long
runs (:func:`auto_compile_seconds`) and the out-of-step events that split a chunk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from ..algorithms.base import Algorithm
from ..data.minibatch import MinibatchSampler
from ..engine.chunk_engine import ChunkEngine
from ..engine.compile import compiled_before
from ..engine.draws import DrawBuffer
from ..engine.randomness import Randomness
from ..model.potential import FederatedPotential
from ..network.base import held_finite

#: with ``gradient_mode="auto"``, the iteration is compiled once the traced iterations still to run are
#: projected to take longer than this (seconds): a compilation makes iterations several (up to 20) times
#: faster, but takes from about a second (a graph TorchInductor has cached) to 20 s (a new one)
AUTO_COMPILE_SECONDS = 20.0
#: the same once the process has compiled another function (:func:`~pyro_fed.engine.compile.compiled_before`):
#: TorchInductor is then loaded and warm, and a new graph took 4 to 5 s where the first took 13 (eight
#: schools: 20 s traced, 11 s compiled); iterations 4 times faster repay 5 s from about 7 s of traced ones
AUTO_COMPILE_SECONDS_AFTER_FIRST = 8.0


def auto_compile_seconds() -> float:
    """The projected seconds of traced work past which ``gradient_mode="auto"`` compiles: fewer once this
    process has compiled before."""
    if compiled_before():
        return min(AUTO_COMPILE_SECONDS, AUTO_COMPILE_SECONDS_AFTER_FIRST)
    return AUTO_COMPILE_SECONDS


class ChunkRunner:
    """The iterations of one run of every chain, a chunk at a time.

    :param algorithm: the run's :class:`~pyro_fed.algorithms.base.Algorithm`.
    :param state: its initial state, a tuple of tensors.
    :param potential: the :class:`~pyro_fed.model.potential.FederatedPotential` whose gradients it reads.
    :param rng: the run's :class:`~pyro_fed.engine.randomness.Randomness`.
    :param minibatches: the clients' :class:`~pyro_fed.data.minibatch.MinibatchSampler` (``None``: full local
        batches).
    :param buffer: the :class:`~pyro_fed.engine.draws.DrawBuffer` the draws go to.
    :param tuple constants: the tensors every iteration reads: the preconditioned step, the chains'
        initial points and the explosion bounds of the divergence check.
    :param int chunk: iterations per chunk.
    :param iterations_needed: iterations the run needs (``None``: unknown, the kernel is driven by hand).
    :param str mode: how the iteration is prepared (see :mod:`pyro_fed.engine.compile`).
    :param str what: what the iteration is, for warnings (``"the FaldKernel iteration"``).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        state: tuple,
        potential: FederatedPotential,
        rng: Randomness,
        minibatches: MinibatchSampler | None,
        buffer: DrawBuffer,
        constants: tuple,
        *,
        chunk: int,
        iterations_needed: int | None,
        mode: str,
        what: str,
    ):
        self.algorithm, self.state, self.potential, self.rng = algorithm, state, potential, rng
        self.minibatches, self.buffer, self.constants = minibatches, buffer, constants
        self.chunk, self.iterations_needed, self.mode, self.what = chunk, iterations_needed, mode, what
        self.network = algorithm.network
        #: iterations computed so far
        self.computed = 0
        self._engine: ChunkEngine | None = None
        #: seconds per iteration of the fastest chunk so far (see _maybe_compile)
        self._fastest = math.inf
        # the widths of the working clients' rows prepared so far (see working_rows)
        self._widths: set[int] = set()
        if algorithm.selects_clients and minibatches is None:
            # the working clients' whole data, padded, built here: built while the iteration is traced, its
            # sizes (read on the host) would stop the tracing
            potential.full_batches  # noqa: B018
        # the names of the iterations' summaries, in the order of their outputs
        self._summary_names = tuple(algorithm.summary(algorithm.state_type(*state)))

    def gradients(
        self, indices: torch.Tensor | None, rows: torch.Tensor | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """This iteration's gradient estimates: client points ``[..., C, b, d]`` -> same shape; with
        ``rows`` (:func:`working_rows`), those of the working clients alone, zeros elsewhere."""
        pot = self.potential

        def gradients(points: torch.Tensor) -> torch.Tensor:
            if rows is not None:
                weights = None if indices is None else self.minibatches.datum_weights
                return pot.working_gradients(points, rows, indices, weights)
            if indices is None:
                return pot.full_gradient_fn(points.reshape(-1, pot.num_clients, pot.dim)).reshape(
                    points.shape
                )
            # the chains' minibatches [C, b, n], the same at every leading point
            shape = (-1, pot.num_clients, indices.shape[-1])
            weights = self.minibatches.datum_weights.reshape(shape)
            return pot.minibatch_gradients(points, indices.reshape(shape), weights)

        return gradients

    def iteration(self, state, inputs, constants, variant: tuple[bool, bool]):
        """One iteration as a pure tensor function: ``(state, (valid, *summary))``, ``summary`` the new
        state's :meth:`~pyro_fed.algorithms.base.Algorithm.summary`.

        ``variant`` is ``(checked, meets)``. ``meets``: whether the step meets other clients (else
        :meth:`~pyro_fed.algorithms.base.Algorithm.local_step`). ``checked``: the divergence check is made
        here, a diverging step reverted without waiting for the device (a select, not a branch), and
        ``valid`` is whether the step was kept. Unchecked, a step is judged without meeting, by what is held
        here: one that made a held tensor non-finite, or moved a held point
        (:meth:`~pyro_fed.algorithms.base.Algorithm.points`) out of its bounds, is reverted too, so that the
        model is never evaluated there, and ``valid`` says so; :meth:`run_chunk` checks the chunk's
        iterations together at its end, with one meeting instead of one per iteration."""
        checked, meets = variant
        indices, inputs = (inputs[0], inputs[1:]) if self.minibatches is not None else (None, inputs)
        rows, inputs = (inputs[0], inputs[1:]) if self.algorithm.selects_clients else (None, inputs)
        step_size, start, bound = constants
        algorithm = self.algorithm
        step = algorithm.step if meets else algorithm.local_step
        new = tuple(step(algorithm.state_type(*state), self.gradients(indices, rows), inputs, step_size))
        valid = held_finite(new)
        if checked:
            summary = {k: v.unsqueeze(0) for k, v in algorithm.summary(algorithm.state_type(*new)).items()}
            position = algorithm.report(summary)["position"][0]
            valid = self.network.everywhere(valid) & _bounded(position, start, bound)
        else:
            points = algorithm.points(algorithm.state_type(*new)).movedim(-2, 0)  # [m, C, d]
            valid = valid & _bounded(points, start, bound).all(0)
        new = tuple(
            torch.where(valid.view(-1, *[1] * (n.dim() - 1)), n, o) for n, o in zip(new, state, strict=True)
        )
        return new, (valid, *algorithm.summary(algorithm.state_type(*new)).values())

    def engine(self) -> ChunkEngine:
        """The prepared iteration (prepared once per shape: a new number of chains is a new shape)."""
        if self._engine is None:
            self._engine = self._new_engine(self.mode)
        return self._engine

    def _new_engine(self, mode: str) -> ChunkEngine:
        # a network that cannot be traced is called eagerly: by the iterations that meet, and by every checked
        # one (its divergence check meets); the variant is (checked, meets)
        eager = None if self.network.traceable else any
        return ChunkEngine(
            self.iteration, mode, what=self.what, agree=self.network.agree, meter=self.network, eager=eager
        )

    def remaining_iterations(self) -> int | None:
        """Iterations the run still needs (``None``: unknown, the kernel is driven by hand)."""
        return None if self.iterations_needed is None else self.iterations_needed - self.computed

    @property
    def preparation_seconds(self) -> float:
        """Seconds spent tracing and compiling (the iteration and the model's gradients)."""
        engine = 0.0 if self._engine is None else self._engine.preparation_seconds
        return engine + self.potential.preparation_seconds

    def _maybe_compile(self, seconds: float, event_seconds: float, num_iterations: int) -> None:
        """``gradient_mode="auto"``: compile the iteration when the traced iterations still to run would
        take longer than :func:`auto_compile_seconds` (projected at the rate of the fastest chunk so far: the
        chunk just run took ``seconds`` without its events), and the clients' full gradients of the events
        (refreshes, snapshots) when theirs would (``event_seconds`` in the chunk): rare events are not worth a
        compilation.

        The fastest chunk, not the last: one chunk stalled by the machine projected over the run would decide
        it. A chunk of 64 iterations at 0.15 ms each, with 12,000 to go, projects 1.7 seconds; stalled a tenth
        of a second (a pause on a shared CPU), 20, and a compilation of several seconds follows (the likely
        cause of a posteriordb run at the same code that took 6.6 seconds, where it had taken 2.6)."""
        if self._engine.mode != "auto":
            return
        remaining = self.remaining_iterations()
        remaining = math.inf if remaining is None else remaining
        self._fastest = min(self._fastest, seconds / num_iterations)
        # timings differ between the holders of clients: any that would compile makes all compile, so that
        # all run the same iteration
        threshold = auto_compile_seconds()
        if self.network.agree(remaining * self._fastest > threshold):
            self._engine = self._new_engine("compiled")
        events = self.network.agree(remaining / num_iterations * event_seconds > threshold)
        if events and self.potential.gradient_mode == "auto":
            self.potential.gradient_mode = "compiled"

    def _inputs(self, coins: dict[str, np.ndarray], num_iterations: int) -> tuple[torch.Tensor, ...]:
        """The chunk's inputs: the minibatches (unless full), the working clients' rows (where the algorithm
        selects them), then the algorithm's own."""
        algorithm, working = self.algorithm, None
        inputs = algorithm.inputs(self.rng, coins)
        if algorithm.selects_clients:
            working = algorithm.working_clients(coins, algorithm.state_type(*self.state))
            holdings = self.network.holdings(working.shape[-1])
            rows = working_rows(working, holdings, self.network.held(working.shape[-1]), self._widths)
            self._widths.add(rows.shape[1])
            inputs = (torch.as_tensor(rows, device=self.state[0].device), *inputs)
        if self.minibatches is None:
            return inputs
        return (self.minibatches(working)[:num_iterations], *inputs)

    def run_chunk(self) -> None:
        """Compute the next chunk of draws of every chain.

        Its iterations run unchecked (:meth:`iteration`); the chunk's divergence check and draws then meet
        once. Should a step have diverged, the chunk is run again from its start, each step checked and a
        diverging one reverted as it runs: the same iterations, inputs and events, so that the draws are
        those of a run that checks every step."""
        remaining = self.remaining_iterations()
        num_iterations = self.chunk if remaining is None else min(self.chunk, remaining)
        start_time = time.perf_counter()
        algorithm = self.algorithm
        coins = algorithm.coins(self.rng, self.computed, num_iterations)
        inputs = self._inputs(coins, num_iterations)
        engine = self.engine()
        preparation = engine.preparation_seconds
        # on a CUDA device a chunk is one captured graph, the same whatever its coins; elsewhere iterations
        # that meet nobody skip a network whose clients are in other processes; and everywhere they run
        # traced where the network cannot be (the others run eagerly)
        meets = np.ones(num_iterations, dtype=bool)
        if not self.network.traceable or (self.network.remote and not self.state[0].is_cuda):
            meets = algorithm.meeting_iterations(coins)
        run = self._run(engine, inputs, coins, meets, checked=False)
        state, valid, report, event_seconds, event_wall = run
        valid = self.network.everywhere(valid) & _bounded(report["position"], *self.constants[1:])
        if not bool(valid.all()):
            state, valid, report, *_ = self._run(engine, inputs, coins, meets, checked=True)
        self.state = state
        self.computed += num_iterations
        positions = report.pop("position")
        bits = self.network.record(*algorithm.traffic(coins))
        self.buffer.add(positions, valid, report, algorithm.coin_statistics(coins), bits)
        # the chunk's outputs are on the host now: the time is the device's too
        elapsed = time.perf_counter() - start_time - (engine.preparation_seconds - preparation)
        # the iterations' time: without the events', whose functions' first preparation (the clients' full
        # gradients, traced at a refresh) would otherwise count as iterations and compile a short run
        self._maybe_compile(elapsed - event_wall, event_seconds, num_iterations)

    def _run(self, engine: ChunkEngine, inputs: tuple, coins: dict, meets: np.ndarray, *, checked: bool):
        """The chunk's iterations from the runner's state, with its out-of-step events: ``(state, valid,
        report, event_seconds, event_wall)``, ``report`` the algorithm's
        :meth:`~pyro_fed.algorithms.base.Algorithm.report` of the iterations' summaries, ``event_seconds``
        the events' time without preparing their functions and ``event_wall`` with it."""
        algorithm, state, outputs, start = self.algorithm, self.state, [], 0
        event_seconds = event_wall = 0.0
        variants = [(checked, bool(m)) for m in meets]

        def run(state, start, stop):
            state, out = engine.run(state, inputs, self.constants, start, stop, variants)
            outputs.append(out)
            return state

        for k in np.flatnonzero(algorithm.event_iterations(coins)):
            state = run(state, start, k)
            event_start, prepared = time.perf_counter(), self.potential.preparation_seconds
            after = algorithm.event(algorithm.state_type(*state), {n: c[k] for n, c in coins.items()})
            # the events' own time, without tracing their functions
            wall = time.perf_counter() - event_start
            event_wall += wall
            event_seconds += wall - (self.potential.preparation_seconds - prepared)
            state = run(state, k, k + 1)
            state, start = tuple(after(algorithm.state_type(*state))), k + 1
        state = run(state, start, len(meets))
        valid, *values = (torch.cat(c) for c in zip(*(o for o in outputs if o), strict=True))
        report = algorithm.report(dict(zip(self._summary_names, values, strict=True)))
        return state, valid, report, event_seconds, event_wall


def working_rows(
    working: np.ndarray, holdings: list[slice], held: slice, prepared: set[int] = frozenset()
) -> np.ndarray:
    """``[K, R]``: the working (chain, client) pairs held here of each of a chunk's iterations, as indices
    ``c b_h + i`` of the held clients' flattened ``[C b_h]`` pairs, padded with ``C b_h`` (none); from
    ``working`` ``[K, C, b]``, every client of the run
    (:meth:`~pyro_fed.algorithms.base.Algorithm.working_clients`). ``R`` is the same for every holder
    (``holdings``, each holder's clients): its largest count of pairs in an iteration, rounded up to a quarter
    of its power of two, so that a run prepares few shapes (a new ``R`` is a new shape of the prepared
    iteration) and evaluates at most 1.25 times the pairs that work (a fixed ``R`` of every pair would
    evaluate them all); or the narrowest width already ``prepared`` within that bound, which needs no new
    preparation (the widths, decided from the coins every holder draws, are the same everywhere)."""
    num_iterations, num_chains, _ = working.shape
    largest = max(int(working[:, :, s].sum((1, 2)).max()) for s in holdings)
    step = 2 ** max(0, largest.bit_length() - 3)
    width = min(-(-max(largest, 1) // step) * step, max(num_chains * (s.stop - s.start) for s in holdings))
    reused = [w for w in prepared if largest <= w <= 1.25 * max(largest, 1)]
    width = min(reused, default=width)
    mine = working[:, :, held].reshape(num_iterations, -1)
    pairs = mine.shape[1]
    if pairs < width:  # a holder of fewer clients than the widest: padded to the shared width
        mine = np.concatenate([mine, np.zeros((num_iterations, width - pairs), dtype=bool)], 1)
    order = np.argsort(~mine, axis=1, kind="stable")[:, :width]  # the working pairs first, in order
    return np.where(np.take_along_axis(mine, order, 1), order, pairs)


def _bounded(positions: torch.Tensor, start: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Whether the draws ``[..., C, d]`` are within the explosion bounds ``bound`` (``[C, d]``) of the
    chains' initial points ``start``: ``[..., C]``."""
    return ((positions - start).abs() <= bound).all(-1)
