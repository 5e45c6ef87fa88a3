"""Per-client minibatches, drawn without replacement, at O(b·n) cost per iteration.

Each client walks through a random permutation of its own data, ``n_i = min(batch_size, N_i)`` points at a
time, and reshuffles when the next batch would cross the end of the permutation (as a data loader with
``drop_last`` does). Every minibatch is marginally a uniform ``n_i``-subset of the client's data, so the
gradient estimate :math:`\\varpi^i \\nabla U^0 + (N_i/n_i) \\sum_{j \\in S} \\nabla U^i_j` is unbiased,
and no ``[b, N_max]`` sort is needed on most iterations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .algorithms.rng import Randomness
from .potential import ClientBatches


class MinibatchSampler:
    """Draws one minibatch per client per call, as padded :class:`~pyro_fed.potential.ClientBatches`.

    :param client_indices: one LongTensor of data indices per client.
    :param int batch_size: requested minibatch size (clients with fewer points use all of them).
    :param rng: randomness (the device generator shuffles).
    :param dtype: floating dtype of the datum weights.
    """

    def __init__(self, client_indices: Sequence[torch.Tensor], batch_size: int, rng: Randomness, dtype):
        self.rng = rng
        self.sizes = np.array([len(ix) for ix in client_indices])
        self.batch_sizes = np.minimum(self.sizes, batch_size)
        b, n_max, device = len(client_indices), int(self.sizes.max()), rng.device
        self.table = torch.zeros(b, n_max, dtype=torch.long, device=device)
        for i, ix in enumerate(client_indices):
            self.table[i, : len(ix)] = ix.to(device)
        self.padding = (
            torch.arange(n_max, device=device) >= torch.as_tensor(self.sizes, device=device)[:, None]
        )
        n = int(self.batch_sizes.max())
        self.columns = torch.arange(n, device=device)
        real = self.columns < torch.as_tensor(self.batch_sizes, device=device)[:, None]
        weights = torch.as_tensor(self.sizes / self.batch_sizes, dtype=dtype, device=device)[:, None]
        self.datum_weights = torch.where(real, weights, torch.zeros((), dtype=dtype, device=device))
        self.permutations = self.table.clone()
        # clients whose whole data fit in one batch use all of it every time and never reshuffle
        self.shuffled = self.batch_sizes < self.sizes
        self.advance = np.where(self.shuffled, self.batch_sizes, 0)
        self.offsets = np.where(self.shuffled, self.sizes, 0)  # the others start with a reshuffle

    def _reshuffle(self, rows: np.ndarray) -> None:
        rows_t = torch.as_tensor(rows, device=self.rng.device)
        keys = self.rng.uniform(len(rows), self.table.shape[1])
        keys = keys.masked_fill(self.padding[rows_t], 2.0)  # padding sorts last
        self.permutations[rows_t] = self.table[rows_t].gather(1, keys.argsort(1))
        self.offsets[rows] = 0

    def __call__(self) -> ClientBatches:
        ended = np.flatnonzero(self.shuffled & (self.offsets + self.batch_sizes > self.sizes))
        if len(ended):
            self._reshuffle(ended)
        offsets = torch.as_tensor(self.offsets, device=self.rng.device)
        positions = (offsets[:, None] + self.columns).clamp(max=self.table.shape[1] - 1)
        self.offsets += self.advance
        return ClientBatches(self.permutations.gather(1, positions), self.datum_weights)
