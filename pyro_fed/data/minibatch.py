"""Per-client minibatches for a chunk of iterations, drawn without replacement on the device.

Client ``i`` (``N_i`` points, minibatch size ``n_i = min(batch_size, N_i)``, or
``n_i = max(1, ⌊batch_size · N_i⌋)`` for a fraction ``0 < batch_size < 1``) walks through random
permutations of its data, ``n_i`` points at a time, ``m_i = ⌊N_i / n_i⌋`` minibatches per permutation (a
local epoch, as a data loader with ``drop_last``). Every chunk of ``K`` iterations starts fresh epochs:
iteration ``k`` of the chunk uses slot ``k mod m_i`` of epoch ``⌊k / m_i⌋``. Every minibatch is therefore
marginally a uniform ``n_i``-subset of the client's data, so the gradient estimate
:math:`\\varpi^i \\nabla U^0 + (N_i/n_i) \\sum_{j \\in S} \\nabla U^i_j` is unbiased.

All the permutations a chunk needs are drawn at once, one row of uniform keys per (chain, client, epoch)
sorted row by row (``Σ_i ⌈K/m_i⌉ N_i`` keys, about ``K Σ_i n_i``: the cost per iteration is of the order of
the minibatches themselves), and the chunk's indices are read from them with one precomputed gather.
Clients whose data fit in one minibatch use all of it at every iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.randomness import Randomness
from .partition import pad_indices


def client_batch_sizes(batch_size: int | float, client_sizes: torch.Tensor) -> torch.Tensor:
    """Each client's minibatch size :math:`n_i` (``[b]``, integers) for ``batch_size`` points per client
    (at most its :math:`N_i`) or a fraction of each client's data (:math:`\\lfloor f N_i \\rfloor`, at
    least 1)."""
    if isinstance(batch_size, float):
        return (batch_size * client_sizes).floor().long().clamp(min=1)
    return client_sizes.clamp(max=batch_size)


class MinibatchSampler:
    """Draws the minibatch indices of every client of every chain for ``K`` iterations at once.

    :param client_indices: one LongTensor of data indices per client (``b`` of them).
    :param batch_size: requested minibatch size (clients with fewer points use all of them), or a fraction
        in ``(0, 1)`` of each client's data (at least one point).
    :param int chunk_size: iterations per chunk ``K``.
    :param int num_chains: independent copies of the clients (chains), each with its own minibatches.
    :param rng: randomness (the device generator draws the sort keys).
    :param dtype: floating dtype of the datum weights.
    :param all_client_sizes: where ``client_indices`` are the clients held here of a run whose clients are
        held in several places: the data sizes of all of them (``[B]``), and
    :param held: which of them are held here (a slice). The keys are then drawn for all ``B`` clients, as
        one holder of all of them would, and each holder keeps its own clients' minibatches: the
        minibatches do not depend on where the clients are held.

    Attributes: ``datum_weights`` ``[C·b, n]`` (``N_i / n_i`` on real entries, 0 on padding) and
    ``batch_sizes`` (the ``n_i``).
    """

    def __init__(
        self,
        client_indices: Sequence[torch.Tensor],
        batch_size: int | float,
        *,
        chunk_size: int,
        num_chains: int = 1,
        rng: Randomness,
        dtype: torch.dtype,
        all_client_sizes: torch.Tensor | None = None,
        held: slice | None = None,
    ):
        self.rng = rng
        device = rng.device
        self.held = None
        if all_client_sizes is not None and len(all_client_sizes) != len(client_indices):
            # the others' rows only take their keys: placeholders of their sizes
            self.held, self.num_chains = held, num_chains
            placeholders = [torch.zeros(int(n), dtype=torch.long) for n in all_client_sizes]
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
        n = int(batch.max())
        column = torch.arange(n, device=device)
        columns = slot[..., None] * batch[:, None] + torch.minimum(
            column, batch[:, None] - 1
        )  # padding repeats
        rows = (first_row + epoch)[..., None]  # [K, C, b, 1]
        self.gather = (rows * table.shape[1] + columns).reshape(chunk_size, num_chains * len(sizes), n)
        real = column < batch[:, None]
        weights = torch.where(real, (sizes / batch)[:, None].to(dtype), torch.zeros((), dtype=dtype))
        self.datum_weights = self._held_rows(weights.repeat(num_chains, 1))  # [C·b, n]
        self.batch_sizes = batch.tolist() if self.held is None else batch[self.held].tolist()

    def _held_rows(self, values: torch.Tensor) -> torch.Tensor:
        """The held clients' rows of ``[..., C·B, n]`` rows of every client: ``[..., C·b, n]``."""
        if self.held is None:
            return values
        per_chain = values.reshape(*values.shape[:-2], self.num_chains, -1, values.shape[-1])
        return per_chain[..., self.held, :].reshape(*values.shape[:-2], -1, values.shape[-1])

    def __call__(self) -> torch.Tensor:
        """Indices ``[K, C·b, n]`` of the chunk's minibatches."""
        # float64 keys: ties (which would favour an order) are practically impossible
        keys = self.rng.uniform(*self.table.shape, dtype=torch.float64)
        keys = keys.masked_fill(self.padding, 2.0)  # padding sorts last
        permuted = self.table.gather(1, keys.argsort(1))
        return self._held_rows(permuted.view(-1)[self.gather])
