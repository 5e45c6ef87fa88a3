"""Per-client minibatches for a chunk of iterations, drawn without replacement on the device.

Client ``i`` (``N_i`` points, minibatch size ``n_i = min(batch_size, N_i)``, or
``n_i = max(1, ⌊batch_size · N_i⌋)`` for a fraction ``0 < batch_size < 1``) walks through random
permutations of its data, ``n_i`` points at a time, ``m_i = ⌊N_i / n_i⌋`` minibatches per permutation (a
local epoch, as a data loader with ``drop_last``). Every chunk of ``K`` iterations starts fresh epochs:
iteration ``k`` of the chunk uses slot ``k mod m_i`` of epoch ``⌊k / m_i⌋``. Every minibatch is therefore
marginally a uniform ``n_i``-subset of the client's data, so the gradient estimate
:math:`\\varpi^i \\nabla U^0 + (N_i/n_i) \\sum_{j \\in S} \\nabla U^i_j` is unbiased.

All the permutations a chunk needs are drawn at once, one row of uniform keys per (chain, client, epoch)
from the generator of the client's block (:class:`~pyro_fed.engine.randomness.Randomness`), sorted row by
row (``Σ_i ⌈K/m_i⌉ N_i`` keys, about ``K Σ_i n_i``: the cost per iteration is of the order of the
minibatches themselves), and the chunk's indices are read from them with one precomputed gather.
Clients whose data fit in one minibatch use all of it at every iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..engine.randomness import CLIENTS_PER_BLOCK, Randomness
from .partition import pad_indices


def client_batch_sizes(batch_size: int | float | torch.Tensor, client_sizes: torch.Tensor) -> torch.Tensor:
    """Each client's minibatch size :math:`n_i` (``[b]``, integers) for ``batch_size`` points per client
    (at most its :math:`N_i`), a fraction of each client's data (:math:`\\lfloor f N_i \\rfloor`, at
    least 1), or a tensor of one size per client (at most its :math:`N_i`; the warm-up's noise probe)."""
    if isinstance(batch_size, torch.Tensor):
        return torch.minimum(client_sizes, batch_size.to(client_sizes.device))
    if isinstance(batch_size, float):
        return (batch_size * client_sizes).floor().long().clamp(min=1)
    return client_sizes.clamp(max=batch_size)


class MinibatchSampler:
    """Draws the minibatch indices of every client of every chain for ``K`` iterations at once.

    :param client_indices: one LongTensor of data indices per client (``b`` of them).
    :param batch_size: requested minibatch size (clients with fewer points use all of them), a fraction
        in ``(0, 1)`` of each client's data (at least one point), or a LongTensor of one size per client of
        the run (``[B]``, wherever the clients are held).
    :param int chunk_size: iterations per chunk ``K``.
    :param int num_chains: independent copies of the clients (chains), each with its own minibatches.
    :param rng: randomness: each client's sort keys are drawn from the generator of its block
        (:meth:`~pyro_fed.engine.randomness.Randomness.block`).
    :param dtype: floating dtype of the datum weights.
    :param all_client_sizes: where ``client_indices`` are the clients held here of a run whose clients are
        held in several places: the data sizes of all of them (``[B]``), and
    :param held: which of them are held here (a slice). Each block that holds a client of ``held`` then
        draws its keys whole, as one holder of all of them would, and keeps its held clients'
        minibatches: the minibatches do not depend on where the clients are held.

    Attributes: ``datum_weights`` ``[C·b, n]`` (``N_i / n_i`` on real entries, 0 on padding) and
    ``batch_sizes`` (the ``n_i``).
    """

    def __init__(
        self,
        client_indices: Sequence[torch.Tensor],
        batch_size: int | float | torch.Tensor,
        *,
        chunk_size: int,
        num_chains: int = 1,
        rng: Randomness,
        dtype: torch.dtype,
        all_client_sizes: torch.Tensor | None = None,
        held: slice | None = None,
    ):
        if all_client_sizes is None:
            all_client_sizes, held = torch.tensor([len(ix) for ix in client_indices]), None
        held = slice(0, len(client_indices)) if held is None else held
        self.num_chains, everyone = num_chains, len(all_client_sizes)
        # the widest minibatch of all the clients, wherever they are held: the same shapes everywhere
        width = int(client_batch_sizes(batch_size, all_client_sizes).max())
        self.blocks = []
        for number in range(held.start // CLIENTS_PER_BLOCK, (held.stop - 1) // CLIENTS_PER_BLOCK + 1):
            first = number * CLIENTS_PER_BLOCK
            last = min(first + CLIENTS_PER_BLOCK, everyone)
            keep = slice(max(held.start, first), min(held.stop, last))
            self.blocks.append(
                _BlockSampler(
                    client_indices[keep.start - held.start : keep.stop - held.start],
                    batch_size[first:last] if isinstance(batch_size, torch.Tensor) else batch_size,
                    chunk_size=chunk_size,
                    num_chains=num_chains,
                    generator=rng.block(number),
                    device=rng.device,
                    dtype=dtype,
                    block_sizes=all_client_sizes[first:last],
                    held=slice(keep.start - first, keep.stop - first),
                    width=width,
                    first_client=first,
                )
            )
        self.datum_weights = self._joined([b.datum_weights for b in self.blocks])
        self.batch_sizes = [n for b in self.blocks for n in b.batch_sizes]

    def _joined(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The blocks' ``[..., C·b_j, n]`` rows joined into ``[..., C·b, n]``, chain by chain."""
        if len(parts) == 1:
            return parts[0]
        chains = [p.reshape(*p.shape[:-2], self.num_chains, -1, p.shape[-1]) for p in parts]
        joined = torch.cat(chains, -2)
        return joined.reshape(*joined.shape[:-3], -1, joined.shape[-1])

    def __call__(self, working: np.ndarray | None = None) -> torch.Tensor:
        """Indices ``[K, C·b, n]`` of the chunk's minibatches. With ``working`` (``[K', C, B]`` bool, every
        client of the run, ``K' <= K``: the clients whose gradients the chunk's first ``K'`` iterations read;
        see :meth:`~pyro_fed.algorithms.base.Algorithm.working_clients`), only the permutations those
        read are sorted: the others' minibatches are placeholders (valid indices of the client's data, never
        a draw's) and every read one is what it would be without ``working``, from the same keys."""
        parts = []
        for block in self.blocks:
            first = block.first_client
            parts.append(block(None if working is None else working[:, :, first : first + block.num_clients]))
        return self._joined(parts)


class _BlockSampler:
    """The minibatches of the held clients of one block: the keys of all its clients drawn from its
    generator, one row per (chain, client, epoch)."""

    def __init__(
        self,
        client_indices: Sequence[torch.Tensor],
        batch_size: int | float | torch.Tensor,
        *,
        chunk_size: int,
        num_chains: int,
        generator: torch.Generator,
        device: torch.device,
        dtype: torch.dtype,
        block_sizes: torch.Tensor,
        held: slice,
        width: int,
        first_client: int,
    ):
        self.generator, self.held, self.num_chains = generator, held, num_chains
        #: the block's first client in the run's order
        self.first_client = first_client
        self.num_clients = len(block_sizes)
        # the block's other clients only take their keys: placeholders of their sizes
        placeholders = [torch.zeros(int(n), dtype=torch.long) for n in block_sizes]
        client_indices = placeholders[: held.start] + list(client_indices) + placeholders[held.stop :]
        table, sizes = pad_indices(client_indices, device)  # [b, N_max], [b]
        batch = client_batch_sizes(batch_size, sizes)  # n_i
        per_epoch = sizes // batch  # m_i minibatches per permutation
        shuffled = batch < sizes  # the others use all their data every time and draw nothing
        epochs = torch.where(shuffled, (chunk_size + per_epoch - 1) // per_epoch, 1)  # per chunk
        rows_per_chain = int(epochs.sum())
        # one row per (chain, client, epoch): the client's data, padded
        client_of_row = torch.repeat_interleave(torch.arange(len(sizes), device=device), epochs).repeat(
            num_chains
        )
        self.table = table[client_of_row]  # [R, N_max]
        self.padding = torch.arange(table.shape[1], device=device) >= sizes[client_of_row, None]
        # iteration k reads slot k mod m_i of epoch floor(k / m_i) of its client's rows
        k = torch.arange(chunk_size, device=device)[:, None, None]  # [K, 1, 1]
        epoch = torch.where(shuffled, k // per_epoch, 0)  # [K, 1, b]
        slot = torch.where(shuffled, k % per_epoch, 0)
        first_row = (epochs.cumsum(0) - epochs) + rows_per_chain * torch.arange(num_chains, device=device)[
            :, None
        ]
        column = torch.arange(width, device=device)
        columns = slot[..., None] * batch[:, None] + torch.minimum(
            column, batch[:, None] - 1
        )  # padding repeats
        rows = (first_row + epoch)[..., None]  # [K, C, b, 1]
        # a chunk reads the first min(m_i, K) minibatches of a permutation (all the data of a client that
        # draws nothing): only that many of its smallest keys need ordering (see _smallest)
        read = torch.where(shuffled, per_epoch.clamp(max=chunk_size) * batch, sizes)
        self.sorted_width = int(read.max())
        # the row each iteration of each chain's client reads, and the rows unsorted: their table's order
        self.row_read = rows[..., 0].cpu().numpy()
        self.unsorted = torch.arange(self.sorted_width, device=device).expand(len(client_of_row), -1)
        self.gather = (rows * self.sorted_width + columns).reshape(chunk_size, num_chains * len(sizes), width)
        real = column < batch[:, None]
        weights = torch.where(real, (sizes / batch)[:, None].to(dtype), torch.zeros((), dtype=dtype))
        self.datum_weights = self._held_rows(weights.repeat(num_chains, 1))  # [C·b, n]
        self.batch_sizes = batch[held].tolist()

    def _held_rows(self, values: torch.Tensor) -> torch.Tensor:
        """The held clients' rows of ``[..., C·B, n]`` rows of every client of the block: ``[..., C·b,
        n]``."""
        per_chain = values.reshape(*values.shape[:-2], self.num_chains, -1, values.shape[-1])
        if self.held == slice(0, per_chain.shape[-2]):
            return values
        return per_chain[..., self.held, :].reshape(*values.shape[:-2], -1, values.shape[-1])

    def __call__(self, working: np.ndarray | None = None) -> torch.Tensor:
        """Indices ``[K, C·b, n]`` of the chunk's minibatches of the held clients; with ``working`` (``[K',
        C, b]``, this block's clients), only the rows those iterations read are sorted."""
        # float64 keys: ties (which would favour an order) are practically impossible; every key is drawn,
        # whichever rows are sorted, so that the stream is the same
        keys = torch.rand(
            self.table.shape, generator=self.generator, dtype=torch.float64, device=self.table.device
        )
        keys = keys.masked_fill(self.padding, 2.0)  # padding sorts last
        if working is None:
            order = self._smallest(keys)
        else:
            held = np.zeros(self.num_clients, dtype=bool)
            held[self.held] = True
            read = np.unique(self.row_read[: len(working)][working & held])
            read = torch.as_tensor(read, dtype=torch.long, device=keys.device)
            order = self.unsorted.clone()
            order[read] = self._smallest(keys[read])
        permuted = self.table.gather(1, order)  # [R, sorted_width]
        return self._held_rows(permuted.view(-1)[self.gather])

    def _smallest(self, keys: torch.Tensor) -> torch.Tensor:
        if keys.device.type == "cpu":
            return smallest_on_host(keys, self.sorted_width)
        return smallest_on_device(keys, self.sorted_width)


def smallest_on_host(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The positions of each row's ``width`` smallest keys (``[R, N]``, distinct), in increasing order of
    the keys, for keys on the CPU: NumPy's vectorised sort orders short rows several times faster than
    torch's (32,000 rows of 64 keys: 9 against 66 ms)."""
    return torch.from_numpy(np.argsort(keys.numpy(), axis=1)[:, :width])


def smallest_on_device(keys: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`smallest_on_host` for keys on a GPU: a partial sort (``topk``) when fewer than all are
    needed."""
    if width == keys.shape[1]:
        return keys.argsort(1)
    return keys.topk(width, 1, largest=False, sorted=True).indices
