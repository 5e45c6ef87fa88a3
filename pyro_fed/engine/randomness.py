"""Explicit randomness for the algorithms.

A run's randomness comes from seeded streams: one for the draws of the whole run (a server's noise, the
noise all clients share, initial points), one on the host for the coins, and one per **block** of
:data:`CLIENTS_PER_BLOCK` consecutive clients for the clients' own draws (their noise, minibatches,
compressor uniforms). A client's draws come from its block's stream wherever the client is held, so that a
process holding some of the clients draws only theirs (and the rest of the blocks they share with other
processes), and every process draws for its clients what one process holding them all would.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch

#: clients per block of the clients' own randomness: a block is drawn whole by every process that holds one
#: of its clients, so that a process's extra draws are at most two blocks
CLIENTS_PER_BLOCK = 256
_LOW_WORD = 2**32 - 1


class Randomness:
    """Seeded streams: a generator on the data's device for the run's shared draws, one per block of
    clients for the clients' own draws (:meth:`client_normal`, :meth:`client_uniform`,
    :meth:`for_clients`), and one on the host for the coins (communication, refresh, participation).

    Coins are drawn on the host, a chunk of iterations at a time, so that the bits they decide are counted
    exactly without waiting for the device, and the device receives them as a tensor.

    :param int seed: base seed (the kernels draw it from the global torch RNG at set-up, so that
        :func:`pyro.set_rng_seed` makes a run reproducible).
    :param device: the device of the data and parameters.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.seed = int(seed)
        self.device = torch.device(device)
        self.tensors = torch.Generator(self.device).manual_seed(seed)
        self.host = np.random.default_rng(seed + 1)
        #: the blocks' generators drawn from so far, by block number
        self.blocks: dict[int, torch.Generator] = {}
        self._block_seeds: list[int] = []  # of the blocks 0, 1, ... (see block_seed)
        self._low_words = {self.seed & _LOW_WORD}  # what a CPU generator reads of each seed, so far

    def coins(self, prob: float, *shape: int) -> np.ndarray:
        """Bernoulli(``prob``) draws as a boolean array; ``prob >= 1`` is always true and consumes no
        randomness."""
        if prob >= 1.0:
            return np.ones(shape, dtype=bool)
        return self.host.random(shape) < prob

    def normal(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Standard Gaussian noise on the device."""
        return torch.randn(shape, generator=self.tensors, dtype=dtype, device=self.device)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform(0, 1) draws on the device."""
        return torch.rand(shape, generator=self.tensors, dtype=dtype, device=self.device)

    def block(self, number: int) -> torch.Generator:
        """The generator of the clients ``number * CLIENTS_PER_BLOCK`` to ``(number + 1) * CLIENTS_PER_BLOCK -
        1``, seeded with :meth:`block_seed`."""
        if number not in self.blocks:
            self.blocks[number] = torch.Generator(self.device).manual_seed(self.block_seed(number))
        return self.blocks[number]

    def block_seed(self, number: int) -> int:
        """The seed of block ``number``: derived from the run's seed and the block's number, and derived
        again (with an attempt number) while its lowest 32 bits are those of a lower-numbered block's seed
        or of the run's. A CPU generator reads only those 32 bits of its seed: two blocks whose seeds shared
        them would draw the same numbers for their clients. The rule is the same wherever the blocks are
        drawn: a process holding the last block derives the seeds of all before it (a few microseconds
        each)."""
        while len(self._block_seeds) <= number:
            block, attempt = len(self._block_seeds), 0
            seed = _seed(self.seed, block)
            while seed & _LOW_WORD in self._low_words:
                attempt += 1
                seed = _seed(self.seed, block, attempt)
            self._block_seeds.append(seed)
            self._low_words.add(seed & _LOW_WORD)
        return self._block_seeds[number]

    def for_clients(
        self, draw: Callable[[torch.Generator, int], torch.Tensor], num_clients: int, held: slice, dim: int
    ) -> torch.Tensor:
        """The held clients' part of a draw for every client of a run of ``num_clients``, block by block:
        ``draw(generator, n)`` draws for the ``n`` clients of a block (on axis ``dim``) from its generator;
        each block that holds a client of ``held`` is drawn whole, and the held clients kept, in order."""
        parts = []
        for number in range(held.start // CLIENTS_PER_BLOCK, (held.stop - 1) // CLIENTS_PER_BLOCK + 1):
            first = number * CLIENTS_PER_BLOCK
            values = draw(self.block(number), min(CLIENTS_PER_BLOCK, num_clients - first))
            keep = range(max(held.start, first) - first, min(held.stop, first + CLIENTS_PER_BLOCK) - first)
            parts.append(values.narrow(dim, keep.start, len(keep)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def client_normal(
        self, *leading: int, num_clients: int, held: slice, dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Standard Gaussian noise of the held clients of a run of ``num_clients``, ``[*leading, b, dim]``
        (``b`` the held clients), each client's from its block's generator."""
        return self.for_clients(
            lambda g, n: torch.randn((*leading, n, dim), generator=g, dtype=dtype, device=self.device),
            num_clients,
            held,
            -2,
        )

    def client_uniform(
        self, *leading: int, num_clients: int, held: slice, dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Uniform(0, 1) draws of the held clients, as :meth:`client_normal`."""
        return self.for_clients(
            lambda g, n: torch.rand((*leading, n, dim), generator=g, dtype=dtype, device=self.device),
            num_clients,
            held,
            -2,
        )

    def state(self) -> dict[str, torch.Tensor]:
        """Both streams' states as tensors (for a checkpoint, read by ``torch.load(weights_only=True)``):
        ``tensors``, the device generator's :meth:`~torch.Generator.get_state` (a CPU ``uint8`` tensor), and
        ``host``, the host generator's ``bit_generator.state`` dictionary as UTF-8 JSON bytes (JSON keeps
        its 128-bit integers exactly), and the states of the clients' blocks drawn from so far
        (``block_numbers`` and ``blocks``)."""
        host = json.dumps(self.host.bit_generator.state).encode()
        numbers = sorted(self.blocks)
        return {
            "tensors": self.tensors.get_state(),
            "host": torch.frombuffer(bytearray(host), dtype=torch.uint8),
            # the blocks drawn from so far: their numbers, and their generators' states side by side
            "block_numbers": torch.tensor(numbers, dtype=torch.long),
            "blocks": torch.stack([self.blocks[n].get_state() for n in numbers])
            if numbers
            else torch.zeros(0, dtype=torch.uint8),
        }

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore both streams from :meth:`state`: the draws that follow are those that followed it."""
        self.tensors.set_state(state["tensors"].cpu())
        self.host.bit_generator.state = json.loads(bytes(state["host"].cpu().numpy()).decode())
        # into the blocks' generators themselves: a minibatch sampler holds them
        for number, block in zip(state["block_numbers"].tolist(), state["blocks"], strict=True):
            self.block(number).set_state(block.cpu().clone())  # its own memory, not a row of the stack


def _seed(*entropy: int) -> int:
    """A 63-bit seed derived from the integers ``entropy`` (NumPy's :class:`~numpy.random.SeedSequence`)."""
    words = np.random.SeedSequence(list(entropy)).generate_state(2, np.uint32)
    return int(words[0]) << 31 | int(words[1]) >> 1
