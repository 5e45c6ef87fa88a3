"""The data rows of a model written for NUTS: the arguments that hold one entry per datum of the data plate.

A model written for Pyro's NUTS reads its data at full size: the mean computed before the plate from the
covariates, ``obs=y`` inside it::

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        mean = x @ w                                   # all N points
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(mean, 1.0), obs=y)

pyro_fed evaluates client ``i``'s potential on a minibatch :math:`S_i` of its data. Where the model reads its
data through the plate's indices (``pyro.subsample``, ``with pyro.plate(...) as idx: y[idx]``) the indices
are injected into the plate; a model written as above would compute all ``N`` means against ``|S_i|``
observations. It is run instead on the rows :math:`S_i` of its *data arguments* — every tensor argument
(positional or keyword, or an item of a list, tuple or dict argument) with a dimension of the plate's size
``N``, taken along that dimension — with the plate given the positions ``0..|S_i|-1`` of those rows. A plate
declared from the data (``len(x)``) then has ``|S_i|`` points and counts each once; one declared at a fixed
``N`` scales them by ``N / |S_i|``; both are brought to one datum each by the caller
(:meth:`~pyro_fed.model.sites.ModelSites.datum_log_prob`).

Which arguments are data is decided by their shapes and *checked* against the model's own trace before the
warm-up (by :class:`~pyro_fed.model.sites.ModelSites`): run on a few rows, in another order than the
data's, every likelihood site must give the log-densities the full-size run gives those data, and every site
outside the plate the same shape and density (a prior computed from the data, ``y.std()``, would change
with the rows). Data that reach the model another way (a closure or a module global at full size) fail this
check and are refused, by site and plate, with the two ways out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DataRows"]


@dataclass(frozen=True)
class DataArgument:
    """One data argument: where it is among the model's arguments, its name, and its axis of data."""

    #: ``("args", position)`` or ``("kwargs", name)``, then the key of an item in a list, tuple or dict
    path: tuple
    #: how messages name it (``x``, ``data['y']``, ``argument 2``)
    name: str
    #: the dimension along which the argument holds one entry per datum
    axis: int


class DataRows:
    """The model's data arguments (see the module's docstring), and their rows at given data indices.

    :param model: the Pyro model (for the arguments' names).
    :param tuple args: its positional arguments, as the user passes them.
    :param dict kwargs: its keyword arguments.
    :param int num_data: ``N``, the data plate's size.
    """

    def __init__(self, model: Callable, args: tuple, kwargs: dict, num_data: int):
        self.num_data = num_data
        positional = _positional_names(model)
        self.arguments: list[DataArgument] = []
        for path, value in _walk(args, kwargs):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            axes = [axis for axis, size in enumerate(value.shape) if size == num_data]
            if axes:  # the first such axis: data are laid out one row per datum
                self.arguments.append(DataArgument(path, _path_name(path, positional), axes[0]))

    def __bool__(self) -> bool:
        return bool(self.arguments)

    @property
    def names(self) -> list[str]:
        """The data arguments' names."""
        return [argument.name for argument in self.arguments]

    def holds_all_rows(self, args: tuple, kwargs: dict) -> bool:
        """Whether ``args`` and ``kwargs`` hold the whole data (``N`` rows), not a part of them."""
        first = self.arguments[0]
        return _get(args, kwargs, first.path).shape[first.axis] == self.num_data

    def select(self, args: tuple, kwargs: dict, indices: torch.Tensor) -> tuple[tuple, dict]:
        """The model's arguments with each data argument replaced by its rows at ``indices`` (``[n]``, data
        indices), in their order; the others as they are. A pure tensor function of ``indices``
        (:func:`torch.func.vmap` batches it over clients)."""
        args, kwargs = list(args), dict(kwargs)
        for argument in self.arguments:
            value = _get(args, kwargs, argument.path)
            rows = value.index_select(argument.axis, indices.to(value.device))
            _set(args, kwargs, argument.path, rows)
        return tuple(args), kwargs


def _walk(args: tuple, kwargs: dict):
    """``(path, value)`` of every argument and of the items of its lists, tuples and dicts."""
    top = [(("args", i), v) for i, v in enumerate(args)] + [(("kwargs", k), v) for k, v in kwargs.items()]
    for path, value in top:
        yield path, value
        if isinstance(value, list | tuple):
            yield from (((*path, i), v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            yield from (((*path, k), v) for k, v in value.items())


def model_signature(model: Callable) -> inspect.Signature:
    """The signature the model is called with (a :class:`~torch.nn.Module`'s ``forward``'s); raises
    ``TypeError`` or ``ValueError`` where it cannot be read."""
    return inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)


def _positional_names(model: Callable) -> list[str]:
    """The names of the model's positional parameters (none where its signature cannot be read)."""
    try:
        parameters = model_signature(model).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _path_name(path: tuple, positional: list[str]) -> str:
    """How messages name the argument at ``path``: ``x``, ``data['y']``, ``argument 2``."""
    where, key = path[:2]
    head = key if where == "kwargs" else positional[key] if key < len(positional) else f"argument {key}"
    return head + "".join(f"[{item!r}]" for item in path[2:])


def _get(args, kwargs, path: tuple):
    value = (args if path[0] == "args" else kwargs)[path[1]]
    for key in path[2:]:
        value = value[key]
    return value


def _set(args: list, kwargs: dict, path: tuple, new) -> None:
    """Replace the argument at ``path`` by ``new``, copying the containers on the way (the user's lists and
    dicts are never modified)."""
    holder = args if path[0] == "args" else kwargs
    if len(path) == 2:
        holder[path[1]] = new
        return
    container = holder[path[1]]
    if isinstance(container, dict):
        holder[path[1]] = {**container, path[2]: new}
    else:
        items = list(container)
        items[path[2]] = new
        holder[path[1]] = type(container)(items) if isinstance(container, tuple) else items
