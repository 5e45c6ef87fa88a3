"""The draws of a run and their statistics, filled a chunk at a time and served to Pyro one at a time."""

from __future__ import annotations

import numpy as np
import torch


class DrawBuffer:
    """Every ``thinning``-th iterate of ``C`` chains, with per-draw statistics, in chunks.

    Pyro's ``MCMC`` asks for the draws of one chain after another; the kernel computes all chains at once.
    Draws of a chain nobody will ask for again are dropped as soon as they are served, so that memory
    holds one chunk; otherwise the later chains' draws wait here until Pyro asks for them. A dropped draw
    asked for again (a run resumed from a checkpoint serves its draws from the first) is read back from
    :attr:`history`, exactly: the host copy is in float64, which holds every float of a narrower type.

    :param int thinning: iterations per draw.
    :param bool keep: keep served chunks (other chains will be served from them later).
    """

    def __init__(self, thinning: int, keep: bool):
        self.thinning = thinning
        self.keep = keep
        self.draws_per_chunk = None
        self.dtype, self.device = None, None  # of the draws, from the first chunk
        self.positions: list[torch.Tensor | None] = []  # per chunk: [draws, C, d]
        self.stats: dict[str, list[np.ndarray]] = {}  # per chunk: [draws, C]
        self.rounds: list[np.ndarray] = []  # per chunk: cumulative averaging rounds at each draw, [draws, C]
        self.divergences: list[np.ndarray] = []  # per chunk: cumulative diverging draws, [draws, C]
        #: per chunk: the draws on the host, [draws, C, d] (for the end-of-run convergence check)
        self.history: list[np.ndarray] = []

    def add(
        self,
        positions: torch.Tensor,
        valid: torch.Tensor,
        statistics: dict[str, torch.Tensor],
        coins: dict[str, np.ndarray],
        bits: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        """Add a chunk of iterations (every array ``[K, C, ...]``, ``K`` a multiple of ``thinning``).

        :param valid: whether each step was kept (``diverging`` is its negation).
        :param statistics: the algorithm's per-iteration values (e.g. ``dispersion``), on the device.
        :param coins: host-side per-iteration coins: boolean flags (whether it happened in any of a draw's
            ``thinning`` iterations) or integer counts (summed over them).
        :param bits: cumulative uploaded and downloaded bits and rounds (values at a draw's last iteration).
        """
        t = self.thinning
        self.draws_per_chunk = self.draws_per_chunk or len(positions) // t
        self.dtype, self.device = positions.dtype, positions.device

        def window(a: np.ndarray) -> np.ndarray:
            a = a.reshape(-1, t, *a.shape[1:])
            return a.any(1) if a.dtype == bool else a.sum(1)

        uploaded, downloaded, rounds = bits
        stats = {
            "diverging": window(~valid.cpu().numpy()),
            "uploaded_bits": uploaded[t - 1 :: t],
            "downloaded_bits": downloaded[t - 1 :: t],
            **{name: value[t - 1 :: t].cpu().numpy() for name, value in statistics.items()},
            **{name: window(value) for name, value in coins.items()},
        }
        for name, value in stats.items():
            self.stats.setdefault(name, []).append(value)
        self.rounds.append(rounds[t - 1 :: t])
        previous = self.divergences[-1][-1] if self.divergences else 0
        self.divergences.append(previous + np.cumsum(stats["diverging"], 0))
        if self.positions and not self.keep:
            self.positions[-1] = None
        self.positions.append(positions[t - 1 :: t])
        self.history.append(self.positions[-1].detach().cpu().double().numpy())

    def _locate(self, draw: int) -> tuple[int, int]:
        return divmod(draw, self.draws_per_chunk)

    def draw(self, draw: int, chain: int) -> torch.Tensor:
        """Draw ``draw`` (counted from the start of warm-up) of chain ``chain``, ``[d]``."""
        chunk, row = self._locate(draw)
        if self.positions[chunk] is None:  # dropped: read back from the host copy
            return torch.tensor(self.history[chunk][row, chain], dtype=self.dtype, device=self.device)
        return self.positions[chunk][row, chain]

    def all_draws(self, start: int) -> np.ndarray:
        """Every chain's draws from draw ``start`` on, ``[C, draws, d]`` (float64, on the host)."""
        return np.concatenate(self.history)[start:].transpose(1, 0, 2)

    def sample_stats(self, chain: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """The statistics of draws ``start .. stop - 1`` of chain ``chain``."""
        if not self.stats or stop <= start:
            return {}
        return {name: np.concatenate(chunks)[start:stop, chain] for name, chunks in self.stats.items()}

    def bits(self, direction: str, draw: int, chain: int) -> int:
        """Bits ``"uploaded"`` or ``"downloaded"`` by the clients of chain ``chain`` up to draw ``draw`` (0
        before the first draw)."""
        return self._cumulative(self.stats.get(f"{direction}_bits", []), draw, chain)

    def rounds_at(self, draw: int, chain: int) -> int:
        """Averaging rounds of chain ``chain`` up to draw ``draw`` (0 before the first draw)."""
        return self._cumulative(self.rounds, draw, chain)

    def divergences_at(self, draw: int, chain: int) -> int:
        """Diverging draws of chain ``chain`` up to draw ``draw``, warm-up included."""
        return self._cumulative(self.divergences, draw, chain)

    def state(self) -> dict[str, torch.Tensor]:
        """The buffer's contents as CPU tensors (for a checkpoint): ``lengths`` (draws per chunk),
        ``history`` (every draw, ``[draws, C, d]``, float64), ``rounds`` and ``divergences`` (cumulative,
        ``[draws, C]``) and ``stats.<name>`` for each statistic, in order; chunks concatenated."""
        if not self.history:
            return {"lengths": torch.zeros(0, dtype=torch.long)}
        tensors = {
            "lengths": torch.tensor([len(h) for h in self.history], dtype=torch.long),
            "history": torch.from_numpy(np.concatenate(self.history)),
            "rounds": torch.from_numpy(np.concatenate(self.rounds)),
            "divergences": torch.from_numpy(np.concatenate(self.divergences)),
        }
        for name, chunks in self.stats.items():
            tensors[f"stats.{name}"] = torch.from_numpy(np.concatenate(chunks))
        return tensors

    def load_state(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        """Refill an empty buffer from :meth:`state`, its draws of type ``dtype`` on ``device``: it serves
        and reports them as the buffer that wrote it did (the served draws are read back from the history,
        see :meth:`draw`)."""
        lengths = tensors["lengths"].tolist()
        if not lengths:
            return
        self.dtype, self.device = dtype, torch.device(device)
        self.draws_per_chunk = lengths[0]
        splits = np.cumsum(lengths)[:-1]

        def chunks(name: str) -> list[np.ndarray]:
            return np.split(tensors[name].numpy(), splits)

        self.history = chunks("history")
        self.rounds, self.divergences = chunks("rounds"), chunks("divergences")
        self.stats = {key[len("stats.") :]: chunks(key) for key in tensors if key.startswith("stats.")}
        self.positions = [None] * len(lengths)

    def _cumulative(self, chunks: list[np.ndarray], draw: int, chain: int) -> int:
        if draw < 0 or not chunks:
            return 0
        chunk, row = self._locate(draw)
        return int(chunks[chunk][row, chain])
