"""
Client assignments: which client holds which point of the data plate.

An assignment is a ``torch.LongTensor`` of shape ``[N]`` whose entry ``n`` is the id (``0..b-1``) of the
client holding data point ``n``; every client holds at least one point. The generators below cover the
settings of the federated sampling literature (i.i.d. splits, Dirichlet label skew, the "80% of label ``y`` to
clients ``y`` and ``y + 10``" shards) and a user's own site column; :func:`to_index_lists` validates any
assignment a user passes to a kernel.

Random generators are deterministic for a given ``seed`` and never touch the global torch RNG.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch


def _on_host(function: Callable) -> Callable:
    """Run ``function`` with the CPU as default device: client assignments are host-side index tensors
    made with seeded CPU generators, which fail on tensors that ``torch.set_default_device("cuda")`` would
    otherwise put on the GPU."""

    @functools.wraps(function)
    def on_host(*args, **kwargs):
        with torch.device("cpu"):
            return function(*args, **kwargs)

    return on_host


@_on_host
def iid(num_data: int, num_clients: int, seed: int = 0) -> torch.LongTensor:
    """
    Splits ``num_data`` points uniformly at random into ``num_clients`` parts of nearly equal size (sizes
    differ by at most one).

    :param int num_data: number of data points ``N``.
    :param int num_clients: number of clients ``b``, ``1 <= b <= N``.
    :param int seed: seed of the random permutation.

    The counts and the seed are integers of any integer type (Python, NumPy, a 0-d integer tensor); a float
    (``2.5``, or ``6e1``) or a bool is refused.
    :returns: client ids, shape ``[N]``.
    :rtype: torch.LongTensor

    Example:

        >>> clients = iid(10, 3)
        >>> clients.bincount()
        tensor([4, 3, 3])
    """
    num_data = _count("num_data", num_data)
    if num_data < 1:
        raise ValueError(f"num_data must be >= 1, got {num_data}")
    num_clients = _check_num_clients(num_clients, num_data)
    perm = torch.randperm(num_data, generator=_generator(seed))
    clients = torch.empty(num_data, dtype=torch.long)
    clients[perm] = torch.arange(num_data) % num_clients
    return clients


@_on_host
def dirichlet(labels, num_clients: int, alpha: float, seed: int = 0) -> torch.LongTensor:
    r"""
    Label-skewed split: for each label :math:`c`, draws client proportions
    :math:`\pi_c \sim \mathrm{Dirichlet}(\alpha \mathbf{1}_b)` and splits the :math:`n_c` shuffled points of
    label :math:`c` among the clients in those proportions: client :math:`k` receives :math:`n_c \pi_{ck}`
    points, rounded up or down at random so that its expected number is exactly :math:`n_c \pi_{ck}`
    (systematic rounding: the points sit at :math:`(i + u_c) / n_c`, :math:`i = 0, \dots, n_c - 1`,
    :math:`u_c \sim \mathrm{Uniform}(0, 1)`, and client :math:`k` takes those in the :math:`k`-th interval of
    the cumulated proportions). A client's expected share of every label is thus :math:`1 / b`, and its
    expected size :math:`N / b`, however small the labels; flooring the boundaries, as common
    implementations do, gives a label of two points always to the same two clients. Small ``alpha`` gives
    each label to few clients (very heterogeneous clients); large ``alpha`` approaches an i.i.d. split.
    Clients left empty then receive one point each from the currently largest client.

    **References**

    [1] T.-M. H. Hsu, H. Qi, M. Brown (2019), "Measuring the Effects of Non-Identical Data Distribution for
        Federated Visual Classification", arXiv:1909.06335.

    [2] M. Yurochkin, M. Agarwal, S. Ghosh et al. (2019), "Bayesian Nonparametric Federated Learning of
        Neural Networks", ICML.

    :param labels: 1-D tensor, array or sequence of class labels, one per data point (e.g. the observed
        ``y`` of a classifier): integers, bools, strings, or floats with integer values (``0.0``, ``1.0``).
        Floats with other values (a continuous ``y``) are refused: bin them first, or split by a site
        column with :func:`by_group`.
    :param int num_clients: number of clients ``b``, ``1 <= b <= N``.
    :param float alpha: Dirichlet concentration, ``> 0``.
    :param int seed: seed of the shuffles, proportions and rounding.
    :returns: client ids, shape ``[N]``.
    :rtype: torch.LongTensor
    """
    codes, num_labels = _label_codes(labels, "dirichlet")
    num_clients = _check_num_clients(num_clients, len(codes))
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    generator = _generator(seed)
    concentration = torch.full((num_clients,), float(alpha), dtype=torch.float64)
    clients = torch.empty(len(codes), dtype=torch.long)
    for c in range(num_labels):
        points = _shuffled_points(codes, c, generator)
        # Dirichlet.sample() takes no generator; this is the op behind it.
        proportions = torch._sample_dirichlet(concentration, generator=generator)
        offset = torch.rand((), dtype=torch.float64, generator=generator)
        positions = (torch.arange(len(points), dtype=torch.float64) + offset) / len(points)
        # the client whose interval [cumsum_{k-1}, cumsum_k) holds each position; clamped because the
        # cumulated proportions may end a rounding error below 1
        boundaries = proportions.cumsum(0)[:-1]
        clients[points] = torch.bucketize(positions, boundaries, right=True).clamp(max=num_clients - 1)
    return _fill_empty_clients(clients, num_clients)


@_on_host
def shards(labels, num_clients: int, major: float = 0.8, seed: int = 0) -> torch.LongTensor:
    """
    The label-skewed split of the federated Langevin papers: with ``C`` distinct labels, a fraction
    ``major`` of the points of label ``c`` goes, split evenly, to the clients ``c, c + C, c + 2C, ...`` below
    ``num_clients`` (for 10 labels and 20 clients: clients ``c`` and ``c + 10``); the remaining points of all
    labels are spread evenly over all clients. Clients left empty then receive one point each from the
    currently largest client.

    **References**

    [1] V. Plassier, A. Durmus, E. Moulines et al. (2023), "Federated Averaging Langevin Dynamics: Toward a
        unified theory and new algorithms", AISTATS (arXiv:2211.00100).

    :param labels: 1-D tensor, array or sequence of class labels, one per data point (as in
        :func:`dirichlet`: a continuous ``y`` is refused).
    :param int num_clients: number of clients ``b``, ``C <= b <= N``.
    :param float major: fraction of each label given to its own clients, ``0 <= major <= 1``.
    :param int seed: seed of the shuffles.
    :returns: client ids, shape ``[N]``.
    :rtype: torch.LongTensor
    """
    codes, num_labels = _label_codes(labels, "shards")
    num_clients = _check_num_clients(num_clients, len(codes))
    if num_clients < num_labels:
        raise ValueError(
            f"num_clients={num_clients} is smaller than the number of distinct labels ({num_labels}); "
            "shards needs at least one client per label"
        )
    if isinstance(major, bool) or not isinstance(major, numbers.Real) or not 0 <= major <= 1:
        raise ValueError(f"major must be in [0, 1], got {major}")
    generator = _generator(seed)
    clients = torch.empty(len(codes), dtype=torch.long)
    rest = []
    for c in range(num_labels):
        points = _shuffled_points(codes, c, generator)
        num_major = int(major * len(points))
        own_clients = torch.arange(c, num_clients, num_labels)
        clients[points[:num_major]] = own_clients[torch.arange(num_major) % len(own_clients)]
        rest.append(points[num_major:])
    rest = torch.cat(rest)
    rest = rest[torch.randperm(len(rest), generator=generator)]
    clients[rest] = torch.arange(len(rest)) % num_clients
    return _fill_empty_clients(clients, num_clients)


@_on_host
def by_group(groups) -> torch.LongTensor:
    """
    One client per distinct group label (e.g. a hospital or site column): the distinct values of ``groups``,
    in sorted order, become clients ``0..b-1``.

    :param groups: 1-D tensor, or sequence of hashable and mutually comparable labels, one per data point.
    :returns: client ids, shape ``[N]``.
    :rtype: torch.LongTensor
    """
    return _codes(groups, "groups")[0]


#: the number of i.i.d. clients a kernel simulates when ``clients`` is not given
DEFAULT_CLIENTS = 10


def to_index_lists(clients, num_data: int | None = None) -> list[torch.LongTensor]:
    """
    Validates a user's ``clients`` argument and converts it to one index tensor per client.

    :param clients: ``None`` (``DEFAULT_CLIENTS`` i.i.d. clients, or one per datum when there are fewer
        data), a number of clients ``b`` (an i.i.d. split, :func:`iid` with ``seed=0``; an integer of any
        integer type, not a float or a bool), or
        client ids (a 1-D integer tensor or a sequence of ints of length ``N`` with values ``0..b-1``,
        every client non-empty), or a sequence of ``b`` non-empty 1-D integer index tensors, pairwise
        disjoint.
    :param num_data: number of points ``N`` of the data plate, if known; then the ids must have length
        ``N`` and the index tensors must cover ``0..N-1``.
    :type num_data: int or None
    :returns: the ``b`` sorted index tensors.
    :rtype: list[torch.LongTensor]
    """
    if clients is None and num_data is not None:
        clients = min(DEFAULT_CLIENTS, num_data)
    if integral(clients) is not None:
        clients = integral(clients)
        if num_data is None or not 1 <= clients <= num_data:
            raise ValueError(
                f"clients={clients}: a number of clients must be between 1 and the number of data points "
                f"({num_data}); or give one client id per data point, or one index tensor per client."
            )
        return _from_ids(iid(num_data, clients, seed=0), num_data)
    check_clients(clients)
    if isinstance(clients, torch.Tensor):
        return _from_ids(clients, num_data)
    if len(clients) == 0:
        raise ValueError("clients is empty; give one client id per data point or one index tensor per client")
    if _is_vector(clients[0]):
        return _from_index_lists([torch.as_tensor(part) for part in clients], num_data)
    return _from_ids(torch.as_tensor(clients), num_data)


def check_clients(clients) -> None:
    """Refuse a ``clients`` that is a single value but no whole number (``True``, ``2.5``): what it is can
    be told before any data is seen (a kernel checks it when it is built)."""
    if clients is not None and integral(clients) is None and _is_scalar(clients):
        raise ValueError(
            f"clients={clients!r}: give a whole number of clients (e.g. 10, for an i.i.d. split), one client "
            "id per data point, or one index tensor per client."
        )


def _from_ids(ids: torch.Tensor, num_data: int | None) -> list[torch.LongTensor]:
    if ids.dim() != 1 or len(ids) == 0:
        raise ValueError(
            f"clients must be a non-empty 1-D tensor of client ids, got shape {tuple(ids.shape)}"
        )
    if not _is_integer(ids):
        raise ValueError(f"clients must hold integer client ids, got dtype {ids.dtype}; convert with .long()")
    if num_data is not None and len(ids) != num_data:
        raise ValueError(
            f"clients has length {len(ids)} but the data plate has {num_data} points; "
            "give one client id per data point"
        )
    if ids.min() < 0:
        raise ValueError(
            f"clients has the negative id {int(ids.min())}; ids must be 0..b-1 and every client non-empty"
        )
    counts = torch.bincount(ids.long())
    if (counts == 0).any():
        client = int((counts == 0).nonzero()[0])
        raise ValueError(f"client {client} has no data points; ids must be 0..b-1 and every client non-empty")
    order = torch.argsort(ids, stable=True)
    return list(order.split(counts.tolist()))


def _from_index_lists(parts: list[torch.Tensor], num_data: int | None) -> list[torch.LongTensor]:
    for i, part in enumerate(parts):
        if part.numel() == 0:
            raise ValueError(f"clients[{i}] is empty; every client needs at least one data point")
        if part.dim() != 1 or not _is_integer(part):
            raise ValueError(
                f"clients[{i}] must be a 1-D tensor of integer indices, "
                f"got shape {tuple(part.shape)} and dtype {part.dtype}"
            )
        if part.min() < 0 or (num_data is not None and part.max() >= num_data):
            bad = int(part.min()) if part.min() < 0 else int(part.max())
            size = "" if num_data is None else f" of {num_data} points"
            raise ValueError(f"clients[{i}] has the index {bad}, out of range for the data plate{size}")
    counts = torch.bincount(torch.cat(parts).long(), minlength=num_data or 0)
    if (counts > 1).any():
        point = int((counts > 1).nonzero()[0])
        raise ValueError(
            f"data point {point} is in more than one client's index list; the index tensors in clients "
            "must be disjoint"
        )
    if num_data is not None and (counts == 0).any():
        point = int((counts == 0).nonzero()[0])
        raise ValueError(
            f"data point {point} is in no client's index list; the index tensors in clients must cover "
            f"all {num_data} points of the data plate"
        )
    return [part.long().sort().values for part in parts]


def integral(value) -> int | None:
    """``value`` as an ``int`` when it is an integer of any integer type (a Python ``int``, a NumPy integer,
    a 0-d integer tensor); ``None`` for anything else, bools (``True`` is no count) and floats (``2.0``
    included: a float where a count is due is a mistake more often than not) among them."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not _is_integer(value):
            return None
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _count(name: str, value) -> int:
    """An integer argument of a generator (a count or a seed), as an ``int``; anything else is refused
    naming the argument and the value."""
    found = integral(value)
    if found is None:
        kind = "a bool" if isinstance(value, (bool, np.bool_)) else f"of type {type(value).__name__}"
        raise ValueError(
            f"{name} must be an integer (a Python or NumPy int, or a 0-d integer tensor); got {value!r}, "
            f"{kind}. Pass int({name}) if it holds a whole number."
        )
    return found


def _generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(_count("seed", seed))


def _check_num_clients(num_clients, num_data: int) -> int:
    num_clients = _count("num_clients", num_clients)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > num_data:
        raise ValueError(
            f"num_clients={num_clients} exceeds the number of data points ({num_data}); "
            "every client needs at least one point"
        )
    return num_clients


def _label_codes(labels, function: str) -> tuple[torch.LongTensor, int]:
    """:func:`_codes` of class labels: a continuous ``labels`` (floats with non-integer values) is refused,
    since each of its values would become a class of its own."""
    if isinstance(labels, np.ndarray) and labels.dtype.kind == "f":
        floats = torch.from_numpy(labels.reshape(-1))
    elif isinstance(labels, torch.Tensor):
        floats = labels.reshape(-1) if labels.is_floating_point() else torch.empty(0)
    else:
        labels = list(labels)
        floats = [v for v in labels if isinstance(v, (float, np.floating))]
        floats = torch.tensor(floats, dtype=torch.float64)
    if bool(floats.isnan().any()):
        raise ValueError(
            f"labels holds NaN ({int(floats.isnan().sum())} of its values): a point without a label has no "
            f"place in {function}'s split. Drop those points, or give them a label of their own (e.g. -1)."
        )
    fractional = floats[floats != floats.round()]
    if len(fractional):
        distinct = len(torch.unique(floats))
        raise ValueError(
            f"labels must be class labels (integers, bools, strings, or floats with integer values), one "
            f"per data point; got floats with non-integer values such as {float(fractional[0])!r} "
            f"({distinct} distinct values in {len(floats)}). {function} splits each label's points among "
            "the clients, and a continuous y would make every value a label of its own. Bin it first "
            "(e.g. labels = torch.bucketize(y, torch.quantile(y, torch.linspace(0, 1, 11)[1:-1])) for 10 "
            "quantile bins), or split by a site column with partition.by_group."
        )
    return _codes(labels, "labels")


def _codes(values, name: str) -> tuple[torch.LongTensor, int]:
    """Maps the distinct values of a 1-D sequence, in sorted order, to ``0..k-1``; returns codes and ``k``."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or len(values) == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(values.shape)}")
        distinct, codes = torch.unique(values, sorted=True, return_inverse=True)
        return codes, len(distinct)
    values = list(values)
    if not values:
        raise ValueError(f"{name} is empty; give one label per data point")
    try:
        distinct = sorted(set(values))
    except TypeError as e:
        raise ValueError(f"{name} must be a 1-D sequence of hashable, mutually comparable labels") from e
    code = {value: i for i, value in enumerate(distinct)}
    return torch.tensor([code[value] for value in values], dtype=torch.long), len(distinct)


def _shuffled_points(codes: torch.Tensor, label: int, generator: torch.Generator) -> torch.LongTensor:
    points = (codes == label).nonzero().squeeze(-1)
    return points[torch.randperm(len(points), generator=generator)]


def _fill_empty_clients(clients: torch.LongTensor, num_clients: int) -> torch.LongTensor:
    # Each empty client takes the first point of the currently largest one, which has >= 2 points because
    # num_clients <= N.
    counts = torch.bincount(clients, minlength=num_clients)
    for client in (counts == 0).nonzero().squeeze(-1).tolist():
        largest = int(counts.argmax())
        clients[(clients == largest).nonzero()[0]] = client
        counts[largest] -= 1
        counts[client] += 1
    return clients


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _is_scalar(x) -> bool:
    return isinstance(x, (numbers.Number, np.generic)) or (isinstance(x, torch.Tensor) and x.dim() == 0)


def _is_vector(x) -> bool:
    return isinstance(x, Sequence) or getattr(x, "ndim", 0) == 1


def pad_indices(indices: Sequence[torch.Tensor], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One index tensor per client as a padded table ``[b, n_max]`` (padding 0) and the lengths ``[b]``,
    built with a few tensor operations whatever ``b``."""
    lengths = torch.tensor([len(ix) for ix in indices], device=device)
    flat = torch.cat([ix.reshape(-1) for ix in indices]).to(device=device, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(indices), device=device), lengths)
    columns = torch.arange(len(flat), device=device) - torch.repeat_interleave(
        lengths.cumsum(0) - lengths, lengths
    )
    table = torch.zeros(len(indices), int(lengths.max()), dtype=torch.long, device=device)
    table[rows, columns] = flat
    return table, lengths
