"""Explicit randomness for the algorithms."""

from __future__ import annotations

import json

import numpy as np
import torch


class Randomness:
    """Two seeded streams: a generator on the data's device for Gaussian noise and minibatches, and one on
    the host for the coins (communication, refresh, participation).

    Coins are drawn on the host, a chunk of iterations at a time, so that the bits they decide are counted
    exactly without waiting for the device, and the device receives them as a tensor.

    :param int seed: base seed (the kernels draw it from the global torch RNG at set-up, so that
        :func:`pyro.set_rng_seed` makes a run reproducible).
    :param device: the device of the data and parameters.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tensors = torch.Generator(self.device).manual_seed(seed)
        self.host = np.random.default_rng(seed + 1)

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

    def state(self) -> dict[str, torch.Tensor]:
        """Both streams' states as tensors (for a checkpoint, read by ``torch.load(weights_only=True)``):
        ``tensors``, the device generator's :meth:`~torch.Generator.get_state` (a CPU ``uint8`` tensor), and
        ``host``, the host generator's ``bit_generator.state`` dictionary as UTF-8 JSON bytes (JSON keeps
        its 128-bit integers exactly)."""
        host = json.dumps(self.host.bit_generator.state).encode()
        return {
            "tensors": self.tensors.get_state(),
            "host": torch.frombuffer(bytearray(host), dtype=torch.uint8),
        }

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore both streams from :meth:`state`: the draws that follow are those that followed it."""
        self.tensors.set_state(state["tensors"].cpu())
        self.host.bit_generator.state = json.loads(bytes(state["host"].cpu().numpy()).decode())
