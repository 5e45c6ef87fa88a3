"""Preparing tensor functions for fast repeated calls: traced once per input shape, optionally compiled.

Running a Pyro model costs mostly Python overhead (building distributions, messengers, site dicts), which
does not depend on the size of the data. Tracing a function of tensors with
:func:`torch.fx.experimental.proxy_tensor.make_fx` records the tensor operations it performs, once, as a
graph that runs without that overhead; TorchInductor (the compiler behind :func:`torch.compile`) then
fuses the graph's operations into a few kernels. A graph holds for inputs of the shapes it was traced with,
so functions are prepared once per shape.

Modes:

- ``"auto"`` (the default): traced, and compiled once the work ahead is long enough to pay for the
  compilation (the kernels decide after their first chunk; one-off evaluations stay traced);
- ``"compiled"``: traced, then compiled by TorchInductor — the fastest per call, after a compilation of
  about a second per shape (tens of seconds for a machine's first compilation);
- ``"traced"``: traced only, no compilation;
- ``"eager"``: the function itself, run as written at every call (the reference).

A function that cannot be traced (for example a model whose control flow depends on parameter values) or
compiled falls back to the next mode with one warning saying why.

A traced graph is first simplified (:func:`simplified`): a model's trace holds many operations that change
nothing (views and expansions to the shape a tensor already has) or depend on no input (its prior's constant
terms, scalars turned into tensors, the data's fixed gathers), and a traced call pays a few microseconds for
each: a posteriordb regression's iteration loses a third of its 210 operations, and a run of FALD on it
(traced: too short to pay for a compilation) a fifth of its time, with the same values to the bit. On the
CPU the simplified graph then runs in TorchScript's interpreter (:func:`interpreted`), which dispatches each
operation from C++ rather than from a line of Python: the same operations on the same inputs at about a
third of the cost (posteriordb's AR(5) model: FALD's traced iteration 1.3 ms -> 0.5 ms).
"""

from __future__ import annotations

import logging
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx

from .. import messages

MODES = ("auto", "compiled", "traced", "eager")
logger = logging.getLogger("pyro_fed")
#: TorchInductor compilations made in this process (see :func:`compiled_before`)
_compilations = 0


def compiled_before() -> bool:
    """Whether this process has compiled a function with TorchInductor: its first compilation also pays
    for importing and warming TorchInductor (13 s for a posteriordb regression's iteration on a 2-core CPU,
    with an empty on-disk cache), a later one of another function far less (4 to 5 s)."""
    return _compilations > 0


#: a tensor computed from constants alone is kept as a constant of the graph when it has at most this many
#: elements or shares its storage with an input (a view): a larger one (a gather of a tall data set) would
#: hold memory for the whole run
FOLD_ELEMENTS = 2**16
_ALIASES = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.alias.default,
}


def simplified(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module``, a graph traced by :func:`~torch.fx.experimental.proxy_tensor.make_fx`, with its operations
    that compute nothing removed, in place: a view, expansion or permutation whose result has its input's
    shape, strides and dtype is replaced by that input; an operation whose inputs are all constants is
    computed once and kept as a constant (see ``FOLD_ELEMENTS``), unless it draws random numbers or an
    in-place operation writes its result (or a view of it: it must be fresh at each call; a graph that writes
    a constant in place, carrying one call's values into the next, folds nothing); and what no output reads
    is dropped. The values are the same to the bit: the operations kept are the same, on the same inputs."""
    graph = module.graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    written = _written(graph)
    # a constant written in place carries one call's values into the next: nothing computed from it is fixed
    folds = not any(n.op == "get_attr" for n in written)
    constants = {n: getattr(module, n.target) for n in graph.nodes if n.op == "get_attr"}
    for node in calls:
        source, value = (node.args[0] if node.args else None), node.meta.get("val")
        if node.target in _ALIASES and isinstance(source, torch.fx.Node) and _same_layout(source, value):
            identity = list(range(value.dim()))
            if node.target is not torch.ops.aten.permute.default or list(node.args[1]) == identity:
                node.replace_all_uses_with(source)
                graph.erase_node(node)
                continue
        if not folds or node in written or not _foldable(node, constants):
            continue
        inputs = [constants[n] for n in node.all_input_nodes]
        args = torch.fx.node.map_arg(node.args, constants.get)
        result = node.target(*args, **torch.fx.node.map_arg(node.kwargs, constants.get))
        if not isinstance(result, torch.Tensor):
            continue
        storage = result.untyped_storage().data_ptr()
        if result.numel() > FOLD_ELEMENTS and all(t.untyped_storage().data_ptr() != storage for t in inputs):
            continue
        name = f"_folded_{len(constants)}"
        module.register_buffer(name, result, persistent=False)
        with graph.inserting_before(node):
            folded = graph.get_attr(name)
        folded.meta = dict(node.meta)
        node.replace_all_uses_with(folded)
        graph.erase_node(node)
        constants[folded] = result
    graph.eliminate_dead_code()
    module.recompile()
    return module


def _written(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose tensors an in-place operation of ``graph`` writes, with every node they are views of
    (a write to a view is a write to its base)."""
    pending = []
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                given = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
                pending.append(given)
    written = set()
    while pending:
        node = pending.pop()
        if not isinstance(node, torch.fx.Node) or node in written:
            continue
        written.add(node)
        target = node.target
        aliases = target is operator.getitem or (
            isinstance(target, torch._ops.OpOverload)
            and any(r.alias_info is not None for r in target._schema.returns)
        )
        if node.op == "call_function" and aliases and node.args:
            pending.append(node.args[0])
    return written


def _same_layout(source: torch.fx.Node, value) -> bool:
    """Whether ``value`` (a node's traced result) has the layout of ``source``'s: shape, strides, dtype."""
    given = source.meta.get("val")
    return (
        isinstance(given, torch.Tensor) and isinstance(value, torch.Tensor) and layout(given) == layout(value)
    )


def _foldable(node: torch.fx.Node, constants: dict) -> bool:
    """Whether ``node`` is an ATen operation of constants alone that draws no random numbers."""
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and all(n in constants for n in node.all_input_nodes)
    )


def layout(tensor: torch.Tensor) -> tuple:
    """What a compiled function assumes of an input tensor: a prepared function is called only with inputs
    of the layouts it was prepared for (its callers key their preparations by it or make inputs contiguous),
    since on the CPU the compiled code reads them with those strides, unchecked (see :func:`prepare`)."""
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def check_mode(mode: str) -> str:
    """Validate a ``gradient_mode`` argument."""
    if mode not in MODES:
        raise ValueError(f"gradient_mode={mode!r}: use one of {MODES}.")
    return mode


class Prepared:
    """A prepared function: callable, with the mode it actually runs in, the seconds its preparation
    took (tracing and compilation) and the bytes one call sends to other processes (``sent_bytes``, set by
    whoever counts them: :class:`~pyro_fed.engine.chunk_engine.ChunkEngine`). ``interpreted``, where not
    ``None``, runs the same traced graph in TorchScript's interpreter (:func:`interpreted`); it serves every
    call but those made while another function is being traced."""

    def __init__(self, function: Callable, mode: str, seconds: float, interpreted: Callable | None = None):
        self.function = function
        self.mode = mode
        self.seconds = seconds
        self.interpreted = interpreted
        self.sent_bytes = 0

    def __call__(self, *args):
        if self.interpreted is not None and get_proxy_mode() is None:
            return self.interpreted(*args)
        return self.function(*args)


def prepare(
    function: Callable,
    example_args: Sequence[torch.Tensor],
    mode: str,
    *,
    what: str,
    agree: Callable[[bool], bool] | None = None,
) -> Prepared:
    """Trace (and compile) ``function`` for inputs shaped as ``example_args``.

    :param function: a function of tensors returning a tensor or a tuple of tensors; it must not branch on
        the values of its inputs (the traced graph replays one path).
    :param example_args: inputs of the shapes, dtypes and devices of later calls.
    :param str mode: ``"compiled"``, ``"traced"`` or ``"eager"`` (``"auto"`` prepares as ``"traced"``: the
        caller decides when to compile).
    :param str what: what the function computes, for the log line and the fallback warning.
    :param agree: where several processes prepare the same function (clients held in several places),
        :meth:`~pyro_fed.network.base.Network.agree`: a fallback of one is then every one's, so that all
        run the same preparation and get the same bits.
    """
    check_mode(mode)
    mode = "traced" if mode == "auto" else mode
    start = time.perf_counter()
    prepared, used = function, "eager"
    versions = {"eager": function}
    try:
        if mode in ("traced", "compiled"):
            prepared = simplified(traced(function, example_args))
            used = "traced"
            versions[used] = prepared
        if mode == "compiled":
            # the graph is already traced to tensor operations: TorchInductor compiles it as it is
            # (torch.compile would trace it again with Dynamo and check guards at every call, which costs
            # more than a small compiled step)
            import torch._inductor  # imported only when needed: it takes seconds

            logger.info("pyro_fed: compiling %s (once per model and shape; seconds)", what)
            # on a copy of the graph (sharing its constants): TorchInductor rewrites the graph it is given
            # to return a list before it may fail, and the traced fallback must return what the function does
            copy = torch.fx.GraphModule(prepared, deepcopy(prepared.graph))
            # on the CPU, without a Python check of every input's sizes and strides at every call (a fifth of
            # a small compiled iteration's time): the compiled code reads its inputs with the strides of
            # ``example_args``, which its callers guarantee (see ``layout``). On a GPU the check stays: there
            # a chunk replays as a CUDA graph, which runs no Python, and its capture's static copies of the
            # inputs may be laid out otherwise (a clone of an expanded tensor is contiguous): the check then
            # stops the capture and the iterations run one by one
            on_cpu = all(a.device.type == "cpu" for a in example_args if isinstance(a, torch.Tensor))
            with torch._inductor.config.patch(size_asserts=not on_cpu):
                prepared, used = torch._inductor.compile(copy, list(example_args)), "compiled"
            global _compilations
            _compilations += 1
    except Exception as error:  # a model or platform that cannot be traced/compiled keeps what works
        messages.warn(
            f"pyro_fed could not prepare {what} in gradient_mode={mode!r} ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); running it {used} "
            "instead, which is slower.",
        )
    if agree is not None:
        # the same questions in every process, whatever each one's answer: did any fall short of compiling,
        # then of tracing?
        if mode == "compiled" and agree(used != "compiled"):
            used = "traced" if "traced" in versions else "eager"
        if mode in ("compiled", "traced") and agree(used == "eager"):
            used = "eager"
        prepared = prepared if used == "compiled" else versions[used]
    fast = interpreted(prepared, example_args) if used == "traced" else None
    return Prepared(prepared, used, time.perf_counter() - start, fast)


def traced(function: Callable, example_args: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """The graph of tensor operations ``function`` performs on ``example_args``
    (:func:`~torch.fx.experimental.proxy_tensor.make_fx`), each node's metadata (the shape and dtype of its
    value) made by one fake-tensor mode for the whole trace: left to itself, ``make_fx`` makes a new mode
    for every operation, each recording the Python stack, which is a third of a model's tracing time; the
    graph's metadata is then also consistent, as TorchInductor's C++ wrapper requires."""
    # through a plain function: make_fx counts a bound method's ``self`` as an input
    trace = make_fx(lambda *args: function(*args))
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        return trace(*example_args)


def follows_from(outputs, inputs) -> bool:
    """Whether, in a function being traced (:func:`traced`), every tensor of ``outputs`` (a tensor or a
    sequence of them) is computed from one of the tensors of ``inputs`` that the trace follows: ``False``
    where one is not, which is what a value that left torch on its way looks like (turned into NumPy and
    back, sent through a socket): the tracer keeps it as a constant of the graph, which every later call
    of the graph returns. ``True`` when nothing is being traced, or none of ``inputs`` is followed."""
    mode = get_proxy_mode()
    if mode is None:
        return True

    def node(value):
        slot = get_proxy_slot(value, mode.tracer, None) if isinstance(value, torch.Tensor) else None
        return None if slot is None else slot.proxy.node

    sources = {node(t) for t in inputs} - {None}
    if not sources:
        return True
    for output in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        start = node(output)
        if start is None:
            continue
        seen, stack = set(), [start]
        while stack and not sources & seen:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(current.all_input_nodes)
        if not sources & seen:
            return False
    return True


def interpreted(module: torch.fx.GraphModule, example_args: Sequence[torch.Tensor]) -> Callable | None:
    """``module``, a traced graph of ATen operations on CPU tensors, run by TorchScript's interpreter
    (:func:`torch.jit.trace` of the graph): the same operations on the same inputs, each dispatched from C++
    rather than from a line of Python, which costs about a third as much per operation (a posteriordb
    regression's iteration of 228 operations: 1.3 ms -> 0.5 ms). ``None`` where that does not apply: a graph
    with operations other than ATen's (a network's collectives), tensors off the CPU (TorchScript's fuser
    would fuse GPU operations, changing the bits; CUDA graphs remove the overhead there), a PyTorch without
    TorchScript, or a trace whose results are not the graph's to the bit on ``example_args``."""
    calls = [n for n in module.graph.nodes if n.op == "call_function"]
    if (
        not hasattr(torch, "jit")
        or any(a.device.type != "cpu" for a in example_args)
        or not all(n.target is operator.getitem or _aten(n.target) for n in calls)
        or any(n.op == "get_attr" for n in _written(module.graph))  # each check's call would change it
    ):
        return None

    def fresh():  # the checks' calls must not write to the caller's tensors
        return tuple(a.clone() for a in example_args)

    try:
        with warnings.catch_warnings():  # TorchScript is deprecated, for models; here it only runs a graph
            warnings.simplefilter("ignore")
            script = torch.jit.trace(module, fresh(), check_trace=False, strict=False)
        expected = module(*fresh())
        # its executor profiles the first calls and optimises the graph after them: each is checked
        for _ in range(3):
            if not _identical(script(*fresh()), expected):
                return None
    except Exception:  # an operation TorchScript cannot record: the graph runs as it is
        return None
    return script


def _aten(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"


def _identical(a, b) -> bool:
    """Whether two results (tensors, or sequences of them) are equal, NaNs in the same places."""
    if not isinstance(a, torch.Tensor):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    if a.is_floating_point() or a.is_complex():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
    return torch.equal(a, b)
