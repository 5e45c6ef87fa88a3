"""The iteration engine: many iterations of an algorithm per call, near the cost of the tensor work.

An iteration of a federated sampler is a fixed sequence of tensor operations once its randomness (noise,
minibatch indices, coins) is drawn ahead: the engine receives a pure function

    ``iteration(state, inputs, constants) -> (new_state, outputs)``

(tuples of tensors; ``inputs`` are one iteration's slice of the chunk's pre-drawn tensors; an iteration of
several *variants*, known on the host ahead, also takes the variant), prepares it once per variant and input
shape (:mod:`pyro_fed.engine.compile`: traced, and compiled by TorchInductor by default) and runs a
chunk of iterations:

- on the CPU, the prepared iteration called in a loop, each call a single fused function;
- on a CUDA device, a whole chunk captured once as a CUDA graph and replayed, so that ``K`` iterations
  cost one launch (partial chunks run iteration by iteration, as on the CPU).

Nothing here knows Pyro or the algorithm: the kernels (:mod:`pyro_fed.kernels`) build the iteration
function and its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import messages
from .compile import Prepared, layout, prepare

Tensors = tuple[torch.Tensor, ...]


class ChunkEngine:
    """Runs a pure iteration function over chunks of pre-drawn inputs.

    :param iteration: ``(state, inputs, constants) -> (new_state, outputs)``, tuples of tensors, or
        ``(state, inputs, constants, variant)`` where :meth:`run` is given variants; it must not branch on
        tensor values (coins are selects) nor draw randomness.
    :param str mode: ``"compiled"``, ``"traced"`` or ``"eager"`` (see :mod:`pyro_fed.engine.compile`).
    :param str what: what the iteration is, for log lines and warnings.
    :param bool cuda_graphs: capture full chunks as CUDA graphs on CUDA devices.
    :param agree: the network's :meth:`~pyro_fed.network.base.Network.agree`, where several processes run
        the iteration (see :func:`~pyro_fed.engine.compile.prepare`).
    :param meter: an object whose integer ``sent_bytes`` the iteration's collectives add to when their
        Python runs (the network): at every call of an eager iteration, once when one is traced. The engine
        adds a traced or compiled iteration's bytes at each of its calls.
    :param eager: which variants run eagerly whatever ``mode`` (``eager(variant)``; default none): those that
        call a network that cannot be traced (:attr:`~pyro_fed.network.base.Network.traceable`).
    """

    def __init__(
        self,
        iteration: Callable,
        mode: str,
        *,
        what: str,
        cuda_graphs: bool = True,
        agree: Callable[[bool], bool] | None = None,
        meter=None,
        eager: Callable[[object], bool] | None = None,
    ):
        self.iteration = iteration
        self.meter = meter
        self.eager = eager
        self.mode = mode
        self.what = what
        self.cuda_graphs = cuda_graphs
        self.agree = agree
        self._prepared: dict[tuple, Prepared] = {}
        self._graphs: dict[tuple, _ChunkGraph | None] = {}
        self.preparation_seconds = 0.0

    @staticmethod
    def _key(*groups: Sequence[torch.Tensor]) -> tuple:
        # the strides too: a compiled iteration reads its inputs with those it was prepared for
        return tuple(layout(t) for group in groups for t in group)

    def prepared(self, state: Tensors, step_inputs: Tensors, constants: Tensors, variant=None) -> Prepared:
        """The iteration (of ``variant``, unless ``None``) prepared for these shapes (once per shape)."""
        key = (variant, *self._key(state, step_inputs, constants))
        if key not in self._prepared:
            counts = (len(state), len(step_inputs))

            def flat(*tensors):
                s, i = counts
                groups = (tensors[:s], tensors[s : s + i], tensors[s + i :])
                new_state, outputs = self.iteration(*groups, *(() if variant is None else (variant,)))
                return (*new_state, *outputs)

            sent = self._sent()
            mode = "eager" if self.eager is not None and self.eager(variant) else self.mode
            arguments = (*state, *step_inputs, *constants)
            prepared = prepare(flat, arguments, mode, what=self.what, agree=self.agree)
            # what one call sends: counted as it was traced (a real call), or by its Python at each call
            prepared.sent_bytes = 0 if prepared.mode == "eager" else self._sent() - sent
            self._prepared[key] = prepared
            self.preparation_seconds += prepared.seconds
        return self._prepared[key]

    def run(
        self,
        state: Tensors,
        inputs: Tensors,
        constants: Tensors,
        start: int,
        stop: int,
        variants: Sequence | None = None,
    ) -> tuple[Tensors, list[torch.Tensor]]:
        """Iterations ``start .. stop - 1`` of a chunk.

        :param state: the state before iteration ``start``.
        :param inputs: the chunk's pre-drawn inputs, each ``[K, ...]`` (iteration ``k`` reads ``t[k]``).
        :param constants: tensors every iteration reads (hyper-parameters).
        :param variants: the variant of each of the chunk's ``K`` iterations (hashable), passed to the
            iteration; ``None``: an iteration of one variant, called without it.
        :returns: the state after iteration ``stop - 1`` and the outputs stacked ``[stop - start, ...]``.
        """
        if stop <= start:
            return state, []
        step_inputs = tuple(t[0] for t in inputs)
        chosen = [None] * (stop - start) if variants is None else list(variants[start:stop])
        functions = {v: self.prepared(state, step_inputs, constants, v) for v in dict.fromkeys(chosen)}
        if self.meter is not None:
            self.meter.sent_bytes += sum(functions[v].sent_bytes for v in chosen)
        full_chunk = start == 0 and stop == inputs[0].shape[0] and len(functions) == 1
        function = next(iter(functions.values()))
        if full_chunk and self.cuda_graphs and state[0].is_cuda and function.mode != "eager":
            graph = self._graph(function, state, inputs, constants)
            if graph is not None:
                return graph(state, inputs, constants)
        return _iterate([functions[v] for v in chosen], state, inputs, constants, start)

    def _sent(self) -> int:
        return 0 if self.meter is None else self.meter.sent_bytes

    def _graph(self, function: Prepared, state: Tensors, inputs: Tensors, constants: Tensors):
        """The chunk captured as a CUDA graph, once per shape; ``None`` (with one warning) where the capture
        fails, e.g. on an operation that waits for the host: then the iterations run one by one."""
        key = (function, *self._key(state, inputs, constants))
        if key not in self._graphs:
            try:
                self._graphs[key] = _ChunkGraph(function, state, inputs, constants)
                if self.meter is not None:  # its warm-up chunks' collectives were sent
                    self.meter.sent_bytes += _ChunkGraph.WARMUP_CHUNKS * len(inputs[0]) * function.sent_bytes
            except Exception as error:
                messages.warn(
                    f"pyro_fed could not capture {self.what} as a CUDA graph ({type(error).__name__}: "
                    f"{error}); running its iterations one by one instead, which is slower.",
                )
                self._graphs[key] = None
        return self._graphs[key]


def _iterate(
    functions: Sequence[Callable],
    state: Tensors,
    inputs: Sequence[torch.Tensor],
    constants: Sequence[torch.Tensor],
    start: int,
) -> tuple[Tensors, list[torch.Tensor]]:
    """Iterations ``start .. start + len(functions) - 1``, one call each of its function: the last state
    and the outputs stacked ``[len(functions), ...]``."""
    num_state, outputs = len(state), []
    prepared_for = [layout(t) for t in state]  # the functions were prepared for the state's layouts
    # per function, whether it returns the state in other layouts than it takes (the same at every call)
    returns_other: dict[Callable, bool] = {}
    for k, function in enumerate(functions, start):
        result = function(*state, *(t[k] for t in inputs), *constants)
        state = tuple(result[:num_state])
        outputs.append(result[num_state:])
        if function not in returns_other:
            returns_other[function] = [layout(t) for t in state] != prepared_for
        if returns_other[function]:
            state = tuple(_as_layout(t, wanted) for t, wanted in zip(state, prepared_for, strict=True))
    return state, [torch.stack(column) for column in zip(*outputs, strict=True)]


def _as_layout(tensor: torch.Tensor, wanted: tuple) -> torch.Tensor:
    """``tensor`` with the shape and strides of ``wanted`` (a :func:`~pyro_fed.engine.compile.layout`): a
    state an iteration returns in other strides than it takes is copied into them, since a compiled
    iteration reads its inputs with the strides it was prepared for."""
    if layout(tensor) == wanted:
        return tensor
    shape, stride, dtype, device = wanted
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(tensor)


class _ChunkGraph:
    """A full chunk of iterations captured as one CUDA graph over static buffers.

    The state, the inputs and the constants are copied into the graph's static tensors before each replay;
    the new state and the stacked outputs are written into static tensors by the graph, and cloned out.
    """

    #: chunks run before the capture
    WARMUP_CHUNKS = 2

    def __init__(self, function: Prepared, state: Tensors, inputs: Tensors, constants: Tensors):
        self.static = [t.clone() for t in (*state, *inputs, *constants)]
        self.num_state, self.num_inputs = len(state), len(inputs)
        self.num_iterations = inputs[0].shape[0]
        # warm-up on a side stream (allocator, cuBLAS and autotuning state), as torch.cuda.graphs asks
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_CHUNKS):
                self._iterate(function)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.new_state, self.outputs = self._iterate(function)

    def _iterate(self, function: Prepared):
        s, i = self.num_state, self.num_inputs
        state, inputs, constants = self.static[:s], self.static[s : s + i], self.static[s + i :]
        return _iterate([function] * self.num_iterations, tuple(state), inputs, constants, 0)

    def __call__(self, state: Tensors, inputs: Tensors, constants: Tensors):
        for static, value in zip(self.static, (*state, *inputs, *constants), strict=True):
            static.copy_(value)
        self.graph.replay()
        return tuple(t.clone() for t in self.new_state), [t.clone() for t in self.outputs]
