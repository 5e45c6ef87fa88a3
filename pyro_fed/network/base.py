"""The network: the one place where clients meet.

An algorithm never reduces over its clients itself: every sum, average or exchange across clients is a call
to a :class:`Network`, so that the same algorithm runs whether the clients are rows of one tensor
(:class:`~pyro_fed.network.in_process.InProcessNetwork`) or live in other processes. Tensors carry the
clients *held here* on their client axis, the second to last (``[..., b, d]``), after any chain dimensions;
a result is the same on every holder.

Three kinds of operation:

- **tensor operations** (:meth:`~Network.sum`, :meth:`~Network.sums`, :meth:`~Network.average`,
  :meth:`~Network.broadcast`, :meth:`~Network.average_where`, :meth:`~Network.stacked`,
  :meth:`~Network.everywhere`, :meth:`~Network.maximum`, :meth:`~Network.neighbours`):
  pure functions of tensors, which run inside a traced or compiled iteration (where the network is
  :attr:`~Network.traceable`) and count nothing;
- **set-up operations** on the host (:meth:`~Network.held`, :meth:`~Network.gather`, :meth:`~Network.agree`,
  :meth:`~Network.share`): which clients are held here, every client's value (the global client sizes),
  a decision made the same everywhere (an error, a fallback), the first holder's value (a seed, an initial
  point);
- **accounting**, on the host: which messages an iteration sent is decided by coins drawn ahead, so their
  bits are counted from the coins (:meth:`~Network.record`), exactly and without waiting for the device. A
  float on the wire costs :data:`BITS_PER_FLOAT` bits.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np
import torch

from ..engine.compile import follows_from

#: bits of one float on the wire
BITS_PER_FLOAT = 32
#: the tensor operations, which run inside a traced or compiled iteration where the network is
#: :attr:`~Network.traceable`: a subclass's own are checked as they are traced (``Network.__init_subclass__``)
TENSOR_OPERATIONS = (
    "sum",
    "sums",
    "average",
    "broadcast",
    "average_where",
    "stacked",
    "maximum",
    "everywhere",
    "neighbours",
)


def held_finite(tensors) -> torch.Tensor:
    """``[C]``: whether every entry of the tensors held here (``[C, ...]`` each) is finite, per chain: one
    reduction per chain, since a non-finite entry makes its sum non-finite."""
    return torch.stack([t.flatten(1).sum(1) for t in tensors]).sum(0).isfinite()


class Network:
    """What every network provides; subclasses implement the tensor operations.

    A kernel hands its network the run's sizes with :meth:`attach` at set-up, before any call. Counters, per
    chain (NumPy integer arrays, so that reading them never waits for the device):

    - ``uploaded_bits``: bits sent by clients to the server (or to their neighbours), summed over clients;
    - ``downloaded_bits``: bits received by clients, summed over clients;
    - ``rounds``: communication rounds (FALD: averaging rounds of the iterates; QLSD: iterations with at
      least one active client; D-ULA: exchanges with the neighbours).
    """

    num_clients: int  #: all clients, wherever they are held
    dim: int  #: floats in one message (the parameter dimension ``d``)
    #: whether some clients are held in other processes: an iteration that meets no other client is then
    #: worth running without the network (see :meth:`~pyro_fed.algorithms.base.Algorithm.local_step`)
    remote = False
    #: whether the tensor operations can run inside a traced or compiled iteration (those of this package's
    #: networks can: in one process, and with :mod:`torch.distributed`'s functional collectives). A network
    #: whose operations leave torch (a socket, another framework's messages) says ``False``: the iterations
    #: whose step meets other clients then run eagerly, as written, while those that meet nobody (FALD's
    #: local steps between rounds: :meth:`~pyro_fed.algorithms.base.Algorithm.meeting_iterations`) still run
    #: traced or compiled, a chunk cut at its communication rounds. The warm-up's pilot, which meets at every
    #: iteration, runs eagerly. Say it: a tracer does not see where a tensor leaves torch (through NumPy, say)
    #: and keeps what was sent while it traced as a constant, so that every later meeting would receive the
    #: first one's values (FALD's draws were off by 2 on a logistic regression). A network that says
    #: ``True`` and leaves torch anyway is caught as it is traced (``__init_subclass__``): the iteration
    #: then runs eagerly, with a warning that names the operation (tested)
    traceable = True
    #: bytes this process sent to the others in the tensor operations so far (none in one process): the
    #: floats actually on the wire, beside the bits the algorithm's messages are counted as
    sent_bytes = 0

    def __init_subclass__(cls, **kwargs):
        """A subclass's own tensor operations (:data:`TENSOR_OPERATIONS`) check, while an iteration is
        traced, that what they return is computed from what they were given
        (:func:`~pyro_fed.engine.compile.follows_from`): one that is not has left torch, and the tracer
        would replay the values it saw at every later meeting. A network that says it is
        :attr:`traceable` and does so stops the tracing with an error naming the operation; the iteration
        then runs eagerly (:func:`~pyro_fed.engine.compile.prepare`'s fallback, with its warning), as it
        would had the network said ``traceable = False``."""
        super().__init_subclass__(**kwargs)
        for name in TENSOR_OPERATIONS:
            if name in vars(cls):
                setattr(cls, name, _checked_when_traced(vars(cls)[name]))

    def attach(self, num_clients: int, dim: int, num_chains: int = 1) -> Network:
        """Size the network for a run of ``num_chains`` chains of ``num_clients`` clients exchanging ``dim``
        floats, with its counters at zero; returns the network."""
        self.num_clients, self.dim = int(num_clients), int(dim)
        self.uploaded_bits = np.zeros(num_chains, dtype=np.int64)
        self.downloaded_bits = np.zeros(num_chains, dtype=np.int64)
        self.rounds = np.zeros(num_chains, dtype=np.int64)
        self.sent_bytes = 0
        return self

    # ------------------------------------------------------------- tensors
    def sum(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """The sum over all clients of ``values``, whose axis ``dim`` holds the clients (``-2`` for
        ``[..., b, d]`` vectors, ``-1`` for ``[..., b]`` scalars)."""
        raise NotImplementedError

    def sums(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sums over all clients of several tensors ``[..., b, d_j]`` (clients on the second to last
        axis), in one meeting where the clients are held in several places: ``([..., d_j], ...)``."""
        return tuple(self.sum(v) for v in values)

    def average(self, uploads: torch.Tensor) -> torch.Tensor:
        """Every client uploads its row of ``uploads`` (``[..., b, d]``); the server's mean ``[..., d]``."""
        raise NotImplementedError

    def broadcast(self, value: torch.Tensor, num_clients: int) -> torch.Tensor:
        """The server sends ``value`` (``[..., d]``) to the ``num_clients`` clients held here: their copies
        ``[..., b, d]``."""
        return value.unsqueeze(-2).expand(*value.shape[:-1], num_clients, value.shape[-1])

    def average_where(self, communicate: torch.Tensor, clients: torch.Tensor) -> torch.Tensor:
        """Clients of the chains whose coin ``communicate`` (``[C]``, boolean) is set are replaced by their
        average; the others keep their iterates. A select, not a branch: the compiled iteration is the same
        whatever the coins."""
        averaged = self.broadcast(self.average(clients), clients.shape[-2])
        return torch.where(communicate[:, None, None], averaged, clients)

    def stacked(self, part: torch.Tensor) -> torch.Tensor:
        """Every holder's ``part`` (the same shape on each), stacked in holder order: ``[W, ...]`` for ``W``
        holders of clients (``[1, ...]`` in one process)."""
        raise NotImplementedError

    def maximum(self, values: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The largest over all clients of ``values``, whose axis ``dim`` holds the clients (``-1`` for
        ``[..., b]`` scalars)."""
        raise NotImplementedError

    def everywhere(self, flags: torch.Tensor) -> torch.Tensor:
        """Whether ``flags`` (booleans of any shape, the same on every holder) hold for every holder of
        clients."""
        raise NotImplementedError

    def neighbours(self, graph, agents: torch.Tensor) -> torch.Tensor:
        """One round of neighbour exchange over ``graph`` (a :class:`~pyro_fed.network.graphs.Graph`): the
        held agents ``[..., b_h, d]`` followed by the agents of other holders that are neighbours of a held
        one, ``[..., m, d]``, in the order :meth:`neighbour_agents` gives. What the agents do with them is
        the algorithm's (D-ULA's mixing, :func:`~pyro_fed.algorithms.dula.mix`)."""
        raise NotImplementedError

    def neighbour_agents(self, graph) -> torch.Tensor:
        """Host-side: the global indices ``[m]`` of the agents :meth:`neighbours` returns, in its order (the
        held agents first). The same for every call with ``graph``."""
        raise NotImplementedError

    # ------------------------------------------------------------- set-up
    def held(self, num_clients: int) -> slice:
        """Which of the ``num_clients`` clients of the run (in their global order) are held here."""
        raise NotImplementedError

    def holdings(self, num_clients: int) -> list[slice]:
        """Which clients every holder holds, in holder order (:meth:`held` of each): the host decides
        shapes that every holder must share from them (the gradient oracle's rows of working clients)."""
        return [self.held(num_clients)]

    def gather(self, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Every client's ``values`` in the global client order, from the held clients' ``values`` whose axis
        ``dim`` holds the clients (for example the global client sizes from the local ones, ``dim=-1``)."""
        raise NotImplementedError

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` is true for any holder of clients: a host decision (an error, a fallback) that
        every holder then takes, so that none waits for the others in a reduction they skipped."""
        raise NotImplementedError

    def share(self, value):
        """The first holder's ``value`` (a seed, initial points: a tensor, a number or a list of them), the
        same for every holder."""
        raise NotImplementedError

    def compare_with_first(self, value, differ: Callable = operator.ne) -> tuple[object, bool]:
        """The first holder's ``value`` (:meth:`share`) and whether any holder's differs from it
        (``differ(first, mine)``, :meth:`agree`): a check that every holder then refuses alike, none left
        waiting for the others (the same settings, model and data assignment in every process)."""
        first = self.share(value)
        return first, self.agree(differ(first, value))

    def new_run(self) -> None:
        """A run begins (its set-up): where clients are held in several processes, its fault reports are
        kept apart from earlier runs'. Nothing to do by default."""

    def leave(self, error: BaseException) -> None:
        """This holder stops with ``error`` (its own, not one of meeting the others): where clients are held
        in several processes, the others are told, so that none waits for it. Nothing to do by default."""

    def explain(self, error: Exception) -> Exception:
        """The error to raise for ``error``, raised while the clients met: as it is by default; a network of
        several processes says that another process was lost."""
        return error

    # ------------------------------------------------------------- accounting
    def record_averages(self, count: int, *, shared: bool = False) -> None:
        """Count ``count`` averages of ``d`` floats made outside the iterations (set-up work: a mode search,
        curvatures, a first refresh): every client uploads ``d`` floats and downloads ``d``; they are not
        rounds of the iterates. Work done for each chain (its first refresh) is counted on every chain;
        ``shared`` work, done once for all of them (the warm-up's adaptation, a mode search), on the first
        chain only, so that the chains' counts add up to what the run sent."""
        chains = len(self.uploaded_bits)
        bits = np.zeros((1, chains), dtype=np.int64)
        bits[0, : 1 if shared else chains] = count * BITS_PER_FLOAT * self.dim * self.num_clients
        self.record(bits, bits, np.zeros((1, chains), dtype=bool))

    def record(
        self, uploaded: np.ndarray, downloaded: np.ndarray, rounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Count the messages of a chunk of iterations.

        :param uploaded: ``[K, C]`` bits each iteration of each chain uploaded (summed over clients).
        :param downloaded: ``[K, C]`` bits each iteration of each chain downloaded (summed over clients).
        :param rounds: ``[K, C]`` whether each iteration was a communication round.
        :returns: ``[K, C]`` cumulative uploaded bits, downloaded bits and rounds per chain after each
            iteration.
        """
        totals = []
        for name, counts in (
            ("uploaded_bits", uploaded),
            ("downloaded_bits", downloaded),
            ("rounds", rounds),
        ):
            cumulative = getattr(self, name) + np.cumsum(
                np.rint(np.asarray(counts, np.float64)).astype(np.int64), 0
            )
            if len(cumulative):
                setattr(self, name, cumulative[-1].copy())
            totals.append(cumulative)
        return tuple(totals)


def _checked_when_traced(operation):
    """``operation``, a tensor operation of a network, raising where an iteration is traced and what it
    returns does not follow from its tensor arguments (see :meth:`Network.__init_subclass__`)."""

    @functools.wraps(operation)
    def checked(self, *args, **kwargs):
        result = operation(self, *args, **kwargs)
        if self.traceable and not follows_from(result, (*args, *kwargs.values())):
            raise RuntimeError(
                f"{type(self).__name__}.{operation.__name__} returned a value that the traced iteration "
                "does not compute from its input: it left torch (through NumPy, a socket, another "
                "framework), and the trace would replay the values of its first call at every meeting. Say "
                "traceable = False on the network: its meetings then run eagerly, as written"
            )
        return result

    return checked
