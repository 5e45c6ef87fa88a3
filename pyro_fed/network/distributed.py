r"""Clients held in several processes: a :class:`~pyro_fed.network.base.Network` over a
:mod:`torch.distributed` process group.

The ``b`` clients of a run are split over the ``W`` ranks of the group in contiguous blocks, in their global
order: rank ``r`` holds the clients

.. math::

    \lfloor r b / W \rfloor, \dots, \lfloor (r + 1) b / W \rfloor - 1

(:meth:`TorchDistributedNetwork.held`), so that blocks differ in size by at most one client and every rank
holds at least one when ``W <= b``. Each rank passes the network tensors that carry only its held clients on
their client axis (``[C, b_r, d]``); the server's tensors (``[C, d]``, QLSD's :math:`\theta`) are replicated:
every rank computes them, from the same reductions, to the same bits. A client's randomness is drawn from
its block's stream (:class:`~pyro_fed.engine.randomness.Randomness`), the same wherever the client is held;
the host coins are drawn for all clients on every rank, each keeping its own, so that every rank counts the
bits of all of them.

The tensor operations run eagerly and inside a traced (:func:`~torch.fx.experimental.proxy_tensor.make_fx`)
or TorchInductor-compiled iteration: they use only the functional collectives of
:mod:`torch.distributed._functional_collectives`, which trace to graph nodes that return their result (the
in-place :func:`torch.distributed.all_reduce` traces into a graph that silently returns its unreduced input).
The set-up operations are host calls made once (the in-place collectives, pickled objects).

A run under ``torchrun --nproc-per-node W script.py``, each rank loading only its own clients' data:

.. code-block:: python

    network = join()  # the group torchrun describes in the environment
    rows, clients = shard(assignment, num_data, network)  # this rank's data rows and clients
    kernel = FaldKernel(model, clients, network=network, ...)
    MCMC(kernel, ...).run(x[rows], y[rows])
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..data.partition import integral, to_index_lists
from .base import Network

__all__ = [
    "CENSUS_SECONDS",
    "DEFAULT_TIMEOUT_SECONDS",
    "ENVIRONMENT",
    "TorchDistributedNetwork",
    "blocks",
    "join",
    "shard",
]

#: seconds a rank waits for the others in a collective before failing: longer than a first compilation
#: (tens of seconds) or a slow rank's set-up, so that the others wait for it rather than fail
DEFAULT_TIMEOUT_SECONDS = 600.0

#: seconds a rank that lost a peer waits for the other survivors to say so too, to tell the lost ranks apart
CENSUS_SECONDS = 2.0
#: the environment variables that describe the process group to :func:`join` (``torchrun`` sets them)
ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: the group store's keys of pyro_fed's fault reports
_KEYS = "pyro_fed/faults"

# ``all_gather_single`` is the newer name of ``all_gather_tensor`` (deprecated since torch 2.6)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def blocks(num_clients: int, world_size: int) -> list[slice]:
    """The contiguous block of the ``num_clients`` global clients that each of ``world_size`` ranks holds:
    rank ``r``'s is ``slice(r * b // W, (r + 1) * b // W)``."""
    return [
        slice(r * num_clients // world_size, (r + 1) * num_clients // world_size) for r in range(world_size)
    ]


class TorchDistributedNetwork(Network):
    """The clients split over the ranks of a :mod:`torch.distributed` process group, rank ``r`` holding the
    contiguous block :meth:`held`; every reduction over the clients is a collective of the group, and every
    rank gets the same result (to the bit, with ``ordered``).

    Every rank must make the same calls in the same order (a collective waits for all ranks), starting with
    the construction itself: the kernels do, since each call depends only on the run's global sizes, coins
    and the decisions taken through :meth:`agree`.

    :param group: the process group (``None``: the default group, initialized for example by :func:`join`).
    :param bool ordered: sum over the ranks by gathering their partial sums and adding them in rank order on
        every rank (the default), so that the sums are the same on every rank and from run to run whatever
        the backend's reduction algorithm; ``False`` uses the backend's all-reduce, which sends less for a
        large group but leaves the order of the additions, and the bits that follow, to the backend.
    """

    def __init__(self, group: torch.distributed.ProcessGroup | None = None, *, ordered: bool = True):
        if not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedNetwork needs an initialized torch.distributed process group: call "
                "pyro_fed.network.distributed.join() (under torchrun) or "
                "torch.distributed.init_process_group first."
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ordered = bool(ordered)
        self.remote = self.world_size > 1
        self._exchanges: dict[int, _Exchange] = {}  # neighbours', by graph
        # the fault reports of this network's runs go under keys of their own in the group's store, apart
        # from those of another network on the same group: rank 0 numbers the network, and tells the others
        joined = [self._store().add(f"{_KEYS}/networks", 1) if self.rank == 0 else None]
        dist.broadcast_object_list(joined, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._reports = f"{_KEYS}/{joined[0]}"
        self._runs = 0
        # host collectives run on the device the backend communicates from: the CPU for gloo, the current
        # GPU for NCCL
        backend = str(dist.get_backend(self.group)).lower()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        )

    def attach(self, num_clients: int, dim: int, num_chains: int = 1) -> TorchDistributedNetwork:
        """Size the network for a run of ``num_clients`` clients in all (the global count), as
        :meth:`~pyro_fed.network.base.Network.attach`; the ranks check that they agree on the sizes (a
        mismatch would otherwise hang in a collective or mix different runs)."""
        sizes = (int(num_clients), int(dim), int(num_chains))
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, sizes, group=self.group)
        if any(other != sizes for other in everyone):
            raise ValueError(
                f"the ranks attach different runs (num_clients, dim, num_chains): {everyone}; every rank "
                "must give the global number of clients and the same sizes."
            )
        self._check_blocks(sizes[0])
        return super().attach(*sizes)

    def new_run(self) -> None:
        # every rank starts the same runs in the same order: the count is the same everywhere, with no
        # message, and a run's fault reports are not read as another's
        self._runs += 1

    # ------------------------------------------------------------- tensors
    def sum(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return self._sum_over_ranks(values.sum(dim))

    def average(self, uploads: torch.Tensor) -> torch.Tensor:
        return self.sum(uploads) / self.num_clients

    def maximum(self, values: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # the maximum does not depend on the order of the comparisons: the backend's reduction is exact
        return self._all_reduce(values.amax(dim), "max")

    def sums(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # the partial sums side by side, one collective: each entry is added over the ranks as it would be
        # alone, to the same bits
        partial = torch.cat([v.sum(-2) for v in values], -1)
        return tuple(self._sum_over_ranks(partial).split([v.shape[-1] for v in values], -1))

    def everywhere(self, flags: torch.Tensor) -> torch.Tensor:
        # the minimum of 0/1 over the ranks is exact
        return self._all_reduce(flags.to(torch.int32), "min").bool()

    def stacked(self, part: torch.Tensor) -> torch.Tensor:
        return self._all_gather(part.unsqueeze(0))

    def neighbours(self, graph, agents: torch.Tensor) -> torch.Tensor:
        # one all-to-all: each rank sends every other rank those of its agents that neighbour the other's
        # (for a ring, the two at its block's ends)
        exchange = self._exchange(graph)
        rows = agents.movedim(-2, 0)  # the all-to-all splits its first axis
        received = self._all_to_all(rows[exchange.send], exchange.receive_sizes, exchange.send_sizes)
        return torch.cat([rows, received]).movedim(0, -2)

    def neighbour_agents(self, graph) -> torch.Tensor:
        return self._exchange(graph).agents

    # ------------------------------------------------------------- set-up
    def held(self, num_clients: int) -> slice:
        """Rank ``r`` of ``W`` holds the global clients ``slice(r * b // W, (r + 1) * b // W)``: contiguous
        blocks in rank order, whose sizes differ by at most one."""
        self._check_blocks(num_clients)
        return blocks(int(num_clients), self.world_size)[self.rank]

    def holdings(self, num_clients: int) -> list[slice]:
        self._check_blocks(num_clients)
        return blocks(int(num_clients), self.world_size)

    def gather(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Every client's ``values`` in the global order (each rank's block after the previous rank's). The
        blocks may differ in size (by one client under :meth:`held`'s rule, which is checked: each rank must
        pass exactly its held clients): their sizes are gathered first, and the blocks padded to the largest
        for the gather."""
        dim = dim % values.dim()
        sizes = self._host_all_gather(torch.tensor([values.shape[dim]], device=self.device))
        sizes = [int(s) for s in sizes]
        expected = [len(range(b.start, b.stop)) for b in blocks(sum(sizes), self.world_size)]
        if sizes != expected:
            raise ValueError(
                f"the ranks hold {sizes} clients; with {sum(sizes)} clients over {self.world_size} ranks, "
                f"rank r must hold the clients slice(r * b // W, (r + 1) * b // W), i.e. {expected} "
                "(see pyro_fed.network.distributed.shard)."
            )
        largest = max(sizes)
        padded = values.to(self.device)
        if padded.shape[dim] < largest:
            shape = list(padded.shape)
            shape[dim] = largest - padded.shape[dim]
            padded = torch.cat([padded, padded.new_zeros(shape)], dim)
        parts = self._host_all_gather(padded.contiguous())
        return torch.cat(
            [part.narrow(dim, 0, size) for part, size in zip(parts, sizes, strict=True)], dim
        ).to(values.device)

    def agree(self, flag: bool) -> bool:
        vote = torch.tensor([int(bool(flag))], device=self.device)
        dist.all_reduce(vote, dist.ReduceOp.MAX, group=self.group)
        return bool(vote.item())

    def share(self, value):
        """The value of the group's rank 0 (a tensor, a number, or a list, tuple or dict of them), on every
        rank; tensors travel through the host, and arrive on the device of this rank's own ``value`` (on the
        CPU where it has none)."""
        payload = [_on_cpu(value) if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(self.group, 0), group=self.group)
        return value if self.rank == 0 else _like(payload[0], value)

    def explain(self, error: Exception) -> Exception:
        """A collective that failed because another process of the group is gone (gloo's "connection
        closed/reset by peer") or did not come (the group's timeout) as an error that names it and says why,
        as far as the group's store tells:

        - a rank that failed with an error of its own (and left the group, :meth:`leave`): its error;
        - else the ranks that did not report within :data:`CENSUS_SECONDS` that they lost a peer or timed
          out too: they stopped (killed, out of memory), hang, or are busy elsewhere.

        Other errors are returned as they are."""
        text = str(error)
        timed_out = _timed_out(text)
        if not (timed_out or _lost_peer(text)):
            return error

        def settled() -> bool:  # a peer's own error is known, or every other rank reported
            failed, silent = self._census()
            return bool(failed) or not silent

        try:
            self._report("lost", "1", settled)
            failed, silent = self._census()
        except Exception:  # the store went with the lost process (it held it): nothing more is known
            failed, silent = {}, []
        ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
        if failed:
            what = "; ".join(f"rank {r} failed: {message}" for r, message in failed.items())
        elif silent and timed_out:
            what = (
                f"{ranks} did not come to a collective within the group's timeout: hung, or much slower "
                "than this one (join(timeout_seconds=...) sets the timeout)"
            )
        elif silent:
            what = (
                f"{ranks} did not say within {CENSUS_SECONDS:g} s that {'they' if len(silent) > 1 else 'it'} "
                "lost a peer too: stopped (killed, out of memory), hung, or busy elsewhere"
            )
        else:
            what = "a process stopped (killed, out of memory, or an error of its own, which its log names)"
        return RuntimeError(
            f"pyro_fed: rank {self.rank} of {self.world_size} lost another process of its group: "
            f"{what.rstrip('.')}. Started again with the same checkpoint= files, the run resumes where they "
            f"all were. (gloo: {text.strip().splitlines()[0]})"
        )

    def leave(self, error: BaseException) -> None:
        """This rank stops with ``error``, raised here and not in a collective. It says so in the group's
        store. If every other rank says the same within :data:`CENSUS_SECONDS` (an input that every rank
        refuses alike), none waits for another, and the group stays as it is, for another run. Otherwise
        this rank aborts its connections in the group, so that the others, waiting for it in a collective
        or at their next, fail then rather than at the group's timeout, and their error names this one's
        (:meth:`explain`)."""
        text = str(error).strip()
        if self.world_size == 1 or _lost_peer(text) or _timed_out(text):
            return  # nobody to tell, or not this rank's own error: another's, which explain() names
        message = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:500]
        try:
            if self._report("failed", message, lambda: len(self._reported("failed")) == self.world_size - 1):
                return
        except Exception:  # no store to tell: the others learn of this rank's loss from the connections
            pass
        self.group.abort()

    def shard(self, clients, num_data: int) -> tuple[torch.LongTensor, list[torch.LongTensor]]:
        """:func:`shard` with this network."""
        return shard(clients, num_data, self)

    # ------------------------------------------------------------- helpers
    def _check_blocks(self, num_clients: int) -> None:
        if not 1 <= self.world_size <= int(num_clients):
            raise ValueError(
                f"{num_clients} clients cannot be split over {self.world_size} ranks: every rank must hold "
                "at least one client; use at most as many ranks as clients."
            )

    def _sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        if self.ordered:
            # [W, ...] partial sums, added in rank order: the same operation on the same inputs everywhere
            return self._all_gather(partial.unsqueeze(0)).sum(0)
        return self._all_reduce(partial, "sum")

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' ``tensor`` concatenated along the first axis (traceable); counts what it sends."""
        # this rank's tensor reaches each of the others (directly, or passed along a ring)
        self.sent_bytes += (self.world_size - 1) * tensor.numel() * tensor.element_size()
        return _all_gather(tensor.contiguous(), 0, self.group)

    def _all_reduce(self, tensor: torch.Tensor, operation: str) -> torch.Tensor:
        """The ranks' ``tensor`` reduced by ``operation`` (traceable); counts what it sends."""
        # a ring's reduce-scatter and all-gather each send (W - 1) / W of the tensor
        self.sent_bytes += (
            2 * (self.world_size - 1) * tensor.numel() * tensor.element_size() // self.world_size
        )
        return _waited(funcol.all_reduce(tensor.contiguous(), operation, self.group))

    def _exchange(self, graph) -> _Exchange:
        """Who sends which agents to whom in :meth:`neighbours` over ``graph`` (computed once per graph, the
        same on every rank from the graph and the blocks)."""
        cache = self._exchanges
        if id(graph) not in cache:
            held = blocks(self.num_clients, self.world_size)
            pattern = graph.laplacian != 0
            # the agents each rank's rows read, in the global order
            reads = [torch.nonzero(pattern[b].any(0)).flatten() for b in held]
            mine = held[self.rank]

            def wanted(reader: int, holder: int) -> torch.Tensor:
                block = held[holder]
                return reads[reader][(reads[reader] >= block.start) & (reads[reader] < block.stop)]

            others = [r for r in range(self.world_size) if r != self.rank]
            send = [wanted(r, self.rank) - mine.start for r in others]
            receive = [wanted(self.rank, r) for r in others]
            sizes = {
                r: (len(sending), len(receiving))
                for r, sending, receiving in zip(others, send, receive, strict=True)
            }
            cache[id(graph)] = _Exchange(
                agents=torch.cat([torch.arange(mine.start, mine.stop), *receive]),
                send=torch.cat(send) if send else torch.zeros(0, dtype=torch.long),
                send_sizes=[sizes.get(r, (0, 0))[0] for r in range(self.world_size)],
                receive_sizes=[sizes.get(r, (0, 0))[1] for r in range(self.world_size)],
                graph=graph,
            )
        return cache[id(graph)]

    def _all_to_all(
        self, tensor: torch.Tensor, receive_sizes: list[int], send_sizes: list[int]
    ) -> torch.Tensor:
        """Rows of ``tensor`` (its first axis) sent to each rank, ``send_sizes[r]`` to rank ``r`` in rank
        order, and those received from each, ``receive_sizes[r]`` (traceable); counts what it sends."""
        self.sent_bytes += (
            sum(send_sizes) * (tensor.numel() // max(tensor.shape[0], 1)) * tensor.element_size()
        )
        return _waited(funcol.all_to_all_single(tensor.contiguous(), receive_sizes, send_sizes, self.group))

    def _store(self):
        return dist.distributed_c10d._get_process_group_store(self.group)

    def _key(self, kind: str, rank: int) -> str:
        """The group store's key of a fault report of this network's current run: ``kind`` is ``"failed"``
        (the rank's own error) or ``"lost"`` (it lost a peer)."""
        return f"{self._reports}/{self._runs}/{kind}/{rank}"

    def _report(self, kind: str, value: str, settled: Callable[[], bool]) -> bool:
        """Report ``kind`` (see :meth:`_key`) for this rank in the group's store, then wait, at most
        :data:`CENSUS_SECONDS`, until the other ranks' reports have ``settled()``: whether they have."""
        self._store().set(self._key(kind, self.rank), value)
        deadline = time.monotonic() + CENSUS_SECONDS
        while not settled():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _census(self) -> tuple[dict[int, str], list[int]]:
        """What this run's reports say of the other ranks: the errors of those that failed by themselves,
        and those that reported nothing (neither an error nor the loss of a peer)."""
        store = self._store()
        failed = {r: store.get(self._key("failed", r)).decode() for r in self._reported("failed")}
        lost = self._reported("lost")
        return failed, [r for r in range(self.world_size) if r not in (self.rank, *failed, *lost)]

    def _reported(self, kind: str) -> set[int]:
        """The other ranks that reported ``kind`` in this run."""
        store = self._store()
        return {r for r in range(self.world_size) if r != self.rank and store.check([self._key(kind, r)])}

    def _host_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return parts


def shard(clients, num_data: int, network: Network) -> tuple[torch.LongTensor, list[torch.LongTensor]]:
    """The part of a global client assignment that this rank holds: which data rows it must load, and its
    clients' indices into those rows.

    :param clients: the global assignment of the ``num_data`` points to the ``b`` clients, in any form that
        :func:`~pyro_fed.data.partition.to_index_lists` accepts (client ids ``[N]``, ``b`` index tensors, a
        number of i.i.d. clients); the same on every rank (checked: a different one is refused on every rank).
    :param int num_data: ``N``, the points of the whole data plate.
    :param network: the network that says which clients are held here
        (:meth:`~pyro_fed.network.base.Network.held`).
    :returns: ``(rows, local)``: ``rows``, the sorted global indices of the data points of the held clients
        (``LongTensor``), and ``local``, one index tensor per held client, in the global client order, into
        the loaded rows ``data[rows]`` (a partition of ``range(len(rows))``, to pass as a kernel's
        ``clients``).

    Example, on one process (which holds every client):

        >>> from pyro_fed.network.in_process import InProcessNetwork
        >>> rows, local = shard(torch.tensor([1, 0, 1, 0]), 4, InProcessNetwork())
        >>> rows.tolist(), [ix.tolist() for ix in local]
        ([0, 1, 2, 3], [[1, 3], [0, 2]])
    """
    _check_shard_arguments(clients, num_data, network)
    parts = to_index_lists(clients, num_data)
    _check_same_assignment(parts, num_data, network)
    held = parts[network.held(len(parts))]
    rows = torch.cat(held).sort().values
    # each held point's position among the loaded rows: rows is sorted and holds every held index
    return rows, [torch.searchsorted(rows, part) for part in held]


def _check_same_assignment(parts: list[torch.LongTensor], num_data: int, network: Network) -> None:
    """Every process passed :func:`shard` the same assignment of the same ``num_data`` points, else every
    one raises a ``ValueError``: one drawn with another seed in some process would load some points in two
    processes and others in none, a posterior of other data, without a word. Compared by a digest (one
    small broadcast)."""
    digest = hashlib.sha256(str(int(num_data)).encode())
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    here = digest.hexdigest()
    if network.compare_with_first(here)[1]:
        raise ValueError(
            "shard: the processes passed different assignments of the data points to the clients (or "
            "different numbers of points): each would load rows the others do not expect, some points twice "
            "and others never. Compute the assignment alike in every process (the same seed for a random "
            "split, or load a saved one) and pass it whole, with the whole data's number of points."
        )


def _check_shard_arguments(clients, num_data, network) -> None:
    """:func:`shard`'s arguments are in their order (a network third, the number of data points second),
    else a ``ValueError`` says which is where."""
    if not isinstance(network, Network):
        elsewhere = [n for n, v in (("clients", clients), ("num_data", num_data)) if isinstance(v, Network)]
        if elsewhere:
            raise ValueError(
                f"shard(clients, num_data, network): the network was passed as {elsewhere[0]}, and "
                f"{type(network).__name__} {_shown(network)} as network. Pass the arguments in this order: "
                "shard(assignment, num_data, network), e.g. shard(clients, len(y), join())."
            )
        raise ValueError(
            f"shard: network must be a pyro_fed Network (e.g. pyro_fed.distributed.join()); got "
            f"{type(network).__name__} {_shown(network)}."
        )
    if integral(num_data) is None:
        swapped = " (clients and num_data swapped?)" if integral(clients) is not None else ""
        raise ValueError(
            f"shard: num_data must be the number of data points N, an integer; got {type(num_data).__name__} "
            f"{_shown(num_data)}{swapped}. Pass the arguments in this order: shard(assignment, num_data, "
            "network), the assignment first (client ids [N], index tensors or a number of clients)."
        )


def _shown(value) -> str:
    """A short description of an argument for an error message: a tensor or array by its shape."""
    if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
        return f"of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join(
    backend: str = "gloo",
    *,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    ordered: bool = True,
) -> TorchDistributedNetwork:
    """Join the process group that ``torchrun`` describes in the environment (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; initialized here unless it already is) and return its
    :class:`TorchDistributedNetwork`.

    :param str backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (GPU tensors: each rank then uses the GPU of
        its ``LOCAL_RANK``).
    :param float timeout_seconds: how long a rank waits for the others in a collective before failing; the
        default, :data:`DEFAULT_TIMEOUT_SECONDS` (10 minutes), leaves time for a rank's first compilation
        (tens of seconds) while the others wait. Not applied to a group that is already initialized.
    :param bool ordered: see :class:`TorchDistributedNetwork`.
    :raises RuntimeError: outside ``torchrun``, when the group is not initialized and some of
        :data:`ENVIRONMENT` is not set, naming those missing.
    """
    if not dist.is_initialized():
        missing = [name for name in ENVIRONMENT if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"join() joins the process group that torchrun describes, and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: run the script under torchrun (e.g. "
                "torchrun --nproc-per-node=2 script.py), or set RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT in each process. For one process, leave the kernel's network out."
            )
        if "nccl" in backend.lower():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(seconds=timeout_seconds)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's store outlives a restart of the group (--max-restarts): each attempt's keys apart,
            # or a restarted rank reads the address of a peer of the attempt before and waits for it
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"pyro_fed/attempt_{restart}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return TorchDistributedNetwork(ordered=ordered)


class _Exchange(NamedTuple):
    """A rank's part of a neighbour exchange (:meth:`TorchDistributedNetwork.neighbours`)."""

    agents: torch.Tensor  #: the global indices of its agents then of those received
    send: torch.Tensor  #: its agents (held indices) to send, to each other rank in rank order
    send_sizes: list[int]  #: how many to each rank
    receive_sizes: list[int]  #: how many from each rank
    graph: object  #: the graph (kept, so that its id is not reused while the exchange is cached)


def _lost_peer(text: str) -> bool:
    """Whether a collective's error says that another process of the group is gone."""
    return any(sign in text for sign in ("closed by peer", "reset by peer", "Connection closed"))


def _timed_out(text: str) -> bool:
    """Whether a collective's error says that it waited for another process longer than the group's
    timeout."""
    return "Timed out waiting" in text


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """An eager functional collective's result as a plain tensor (waited for); a traced one as it is."""
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def _on_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [_on_cpu(v) for v in value])
    return value


def _like(received, mine):
    """``received`` with its tensors on the devices of ``mine``'s (the same structure, or the CPU)."""
    if isinstance(received, torch.Tensor):
        return received.to(mine.device) if isinstance(mine, torch.Tensor) else received
    if isinstance(received, dict):
        mine = mine if isinstance(mine, dict) else {}
        return {k: _like(v, mine.get(k)) for k, v in received.items()}
    if isinstance(received, (list, tuple)):
        mine = mine if isinstance(mine, Sequence) and len(mine) == len(received) else [None] * len(received)
        return _rebuilt(received, [_like(v, m) for v, m in zip(received, mine, strict=True)])
    return received


def _rebuilt(sequence, items: list):
    """A list or tuple of the type of ``sequence`` (a named tuple too) holding ``items``."""
    if isinstance(sequence, tuple) and hasattr(sequence, "_fields"):
        return type(sequence)(*items)
    return type(sequence)(items)
