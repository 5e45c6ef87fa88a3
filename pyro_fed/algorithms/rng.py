"""Explicit randomness for the algorithms."""

from __future__ import annotations

import torch


class Randomness:
    """Two seeded generators: one on the data's device for Gaussian noise and minibatches, one on the host
    for the scalar coins (communication, refresh, participation).

    Coins are drawn on the host so that the Python branch they decide never waits for the device.

    :param int seed: base seed (the kernels draw it from the global torch RNG at set-up, so that
        :func:`pyro.set_rng_seed` makes a run reproducible).
    :param device: the device of the data and parameters.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tensors = torch.Generator(self.device).manual_seed(seed)
        self.coins = torch.Generator().manual_seed(seed + 1)

    def coin(self, prob: float) -> bool:
        """One Bernoulli(``prob``) draw; ``prob >= 1`` is always true and consumes no randomness."""
        return prob >= 1.0 or float(torch.rand((), generator=self.coins)) < prob

    def normal(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Standard Gaussian noise on the device."""
        return torch.randn(shape, generator=self.tensors, dtype=dtype, device=self.device)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform(0, 1) draws on the device."""
        return torch.rand(shape, generator=self.tensors, dtype=dtype, device=self.device)
