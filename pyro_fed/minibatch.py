"""Per-client minibatches for a chunk of iterations, drawn without replacement on the device.

Client ``i`` (``N_i`` points, minibatch size ``n_i = min(batch_size, N_i)``) walks through random
permutations of its data, ``n_i`` points at a time, ``m_i = ⌊N_i / n_i⌋`` minibatches per permutation (a
local epoch, as a data loader with ``drop_last``). Every chunk of ``K`` iterations starts fresh epochs:
iteration ``k`` of the chunk uses slot ``k mod m_i`` of epoch ``⌊k / m_i⌋``. Every minibatch is therefore
marginally a uniform ``n_i``-subset of the client's data, so the gradient estimate
:math:`\\varpi^i \\nabla U^0 + (N_i/n_i) \\sum_{j \\in S} \\nabla U^i_j` is unbiased.

All the permutations a chunk needs are drawn at once, by one segmented sort of uniform keys over the
concatenated epochs (``Σ_i ⌈K/m_i⌉ N_i`` keys, about ``K Σ_i n_i``: the cost per iteration is of the order of
the minibatches themselves), and the chunk's indices are read from them with one precomputed gather.
Clients whose data fit in one minibatch use all of it at every iteration and draw nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .algorithms.rng import Randomness


class MinibatchSampler:
    """Draws the minibatch indices of every client of every chain for ``K`` iterations at once.

    :param client_indices: one LongTensor of data indices per client (``b`` of them).
    :param int batch_size: requested minibatch size (clients with fewer points use all of them).
    :param int chunk_size: iterations per chunk ``K``.
    :param int num_chains: independent copies of the clients (chains), each with its own minibatches.
    :param rng: randomness (the device generator draws the sort keys).
    :param dtype: floating dtype of the datum weights.

    Attributes: ``datum_weights`` ``[C·b, n]`` (``N_i / n_i`` on real entries, 0 on padding) and
    ``batch_sizes`` (the ``n_i``).
    """

    def __init__(
        self,
        client_indices: Sequence[torch.Tensor],
        batch_size: int,
        *,
        chunk_size: int,
        num_chains: int = 1,
        rng: Randomness,
        dtype: torch.dtype,
    ):
        self.rng = rng
        self.chunk_size = chunk_size
        device = rng.device
        sizes = [len(ix) for ix in client_indices]
        self.batch_sizes = [min(batch_size, size) for size in sizes]
        n = max(self.batch_sizes)
        data, rows, gather, weights = [], [], [], []
        num_rows, offset = 0, 0
        for _ in range(num_chains):
            for ix, size, batch in zip(client_indices, sizes, self.batch_sizes, strict=True):
                per_epoch = size // batch
                epochs = 1 if batch == size else math.ceil(chunk_size / per_epoch)
                starts = offset + size * torch.arange(epochs)
                data.append(ix.to(device).repeat(epochs))
                rows.append(torch.arange(num_rows, num_rows + epochs).repeat_interleave(size))
                k = torch.arange(chunk_size)
                slot = k % per_epoch if batch < size else torch.zeros_like(k)
                first = starts[k // per_epoch if batch < size else slot] + slot * batch  # [K]
                columns = torch.arange(n).clamp(max=batch - 1)  # padding repeats a real index, weight 0
                gather.append(first[:, None] + columns)
                weights.append(torch.where(torch.arange(n) < batch, size / batch, 0.0))
                num_rows += epochs
                offset += epochs * size
        self.data = torch.cat(data)  # [L] each client's indices, once per epoch of the chunk
        self.rows = torch.cat(rows).to(device)  # [L] epoch of each entry (non-decreasing)
        self.gather = torch.stack(gather, 1).to(device)  # [K, C·b, n] positions in the permuted data
        self.datum_weights = torch.stack(weights).to(device=device, dtype=dtype)  # [C·b, n]

    def __call__(self) -> torch.Tensor:
        """Indices ``[K, C·b, n]`` of the chunk's minibatches."""
        keys = self.rng.uniform(len(self.data), dtype=torch.float64)  # no ties: each order equally likely
        # segmented shuffle: order by key, then (stably) by epoch, so each epoch is permuted uniformly
        order = keys.argsort()
        order = order[self.rows[order].argsort(stable=True)]
        return self.data[order][self.gather]
