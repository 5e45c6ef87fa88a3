r"""End-of-run convergence checks, as Stan makes them: rank-normalised split :math:`\hat R`, bulk and tail
effective sample sizes of every coordinate, computed from all chains at once.

For draws :math:`x_{c,s}` of ``C`` chains of ``S`` draws, each chain is split in halves (``2C`` chains of
``S/2``: a trend within a chain shows as disagreement between its halves) and

- :math:`\hat R` is the larger of Gelman and Rubin's potential scale reduction of the rank-normalised draws
  :math:`z = \Phi^{-1}((r - 3/8) / (2CS/2 + 1/4))` (``r`` the ranks of all draws together, ties averaged) and
  of the rank-normalised folded draws :math:`|x - \mathrm{median}(x)|` (which catches chains that agree on
  location but not on scale);
- the bulk ESS is the effective sample size of :math:`z`, from the chains' autocorrelations combined as in
  Stan (Geyer's initial monotone sequence);
- the tail ESS is the smaller of the effective sample sizes of the indicators :math:`x \le q_{0.05}` and
  :math:`x \le q_{0.95}`.

:func:`check` flags :math:`\hat R > 1.01` and an ESS below 100 per chain (the thresholds of Stan's
diagnostics). The numbers agree with ArviZ's ``rhat(method="rank")``, ``ess(method="bulk")`` and
``ess(method="tail")``; they are computed here, vectorised over coordinates with NumPy, so that they work
whatever the installed ArviZ and cost well under a second for thousands of draws of hundreds of coordinates.

**Reference:** Vehtari, Gelman, Simpson, Carpenter, Bürkner, *Rank-normalization, folding, and
localization: an improved R-hat for assessing convergence of MCMC*, Bayesian Analysis 2021.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

#: :math:`\hat R` above this is a warning (Stan's threshold)
RHAT_THRESHOLD = 1.01
#: effective draws per chain below this (bulk or tail) are a warning (Stan's threshold)
ESS_PER_CHAIN = 100
#: coordinates named in a warning, at most
WORST_NAMED = 3
#: draws per chain below which nothing is computed (split halves of 5 draws at least)
MIN_DRAWS = 10


def split_chains(draws: np.ndarray) -> np.ndarray:
    """``[C, S, ...]`` -> ``[2C, S // 2, ...]``: each chain's first and last halves (the middle draw of an
    odd ``S`` left out)."""
    half = draws.shape[1] // 2
    return np.concatenate([draws[:, :half], draws[:, draws.shape[1] - half :]], axis=0)


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks (1-based, ties averaged) of each column of ``values`` ``[n, k]``."""
    rows = np.ascontiguousarray(values.T)  # sorting along contiguous rows is several times faster
    k, n = rows.shape
    order = np.argsort(rows, axis=1)
    ordered = np.take_along_axis(rows, order, axis=1)
    index = np.arange(n)
    new = np.ones(ordered.shape, dtype=bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # each sorted position's tie group runs from its first to its last position
    first = np.maximum.accumulate(np.where(new, index, 0), axis=1)
    ends = np.ones(ordered.shape, dtype=bool)
    ends[:, :-1] = new[:, 1:]
    last = np.minimum.accumulate(np.where(ends, index, n - 1)[:, ::-1], axis=1)[:, ::-1]
    ranks = np.empty(rows.shape, dtype=float)
    np.put_along_axis(ranks, order, (first + last) / 2.0 + 1.0, axis=1)
    return ranks.T


def _z_scale(draws: np.ndarray) -> np.ndarray:
    """Rank-normalised draws: :math:`\\Phi^{-1}((r - 3/8) / (n + 1/4))` over all draws of each coordinate
    (``[C, S, k]``)."""
    c, s, k = draws.shape
    ranks = _ranks(draws.reshape(c * s, k))
    quantiles = torch.as_tensor((ranks - 0.375) / (c * s + 0.25), dtype=torch.float64, device="cpu")
    return torch.special.ndtri(quantiles).numpy().reshape(c, s, k)


def _rhat(draws: np.ndarray) -> np.ndarray:
    """Gelman and Rubin's :math:`\\hat R` of each coordinate of ``[C, S, k]`` draws."""
    s = draws.shape[1]
    between = s * draws.mean(1).var(0, ddof=1)
    within = draws.var(1, ddof=1).mean(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt((between / within + s - 1) / s)


def _autocovariance(draws: np.ndarray) -> np.ndarray:
    """Each chain's autocovariance at every lag, by FFT: ``[C, S, k]`` -> ``[C, S, k]``."""
    s = draws.shape[1]
    centred = draws - draws.mean(1, keepdims=True)
    size = 2 ** int(np.ceil(np.log2(2 * s)))
    spectrum = np.fft.rfft(centred, n=size, axis=1)
    return np.fft.irfft(spectrum * np.conjugate(spectrum), n=size, axis=1)[:, :s].real / s


def _ess(draws: np.ndarray) -> np.ndarray:
    """The effective sample size of each coordinate of ``[C, S, k]`` draws, with Stan's estimator of the
    autocorrelations across chains and Geyer's initial monotone sequence."""
    c, s, k = draws.shape
    acov = _autocovariance(draws)
    mean_var = acov[:, 0].mean(0) * s / (s - 1.0)
    var_plus = mean_var * (s - 1.0) / s
    if c > 1:
        var_plus = var_plus + draws.mean(1).var(0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var - acov.mean(0)) / var_plus  # [S, k]
    rho[0] = 1.0
    kept = np.zeros_like(rho)
    kept[:2] = rho[:2]
    # Geyer's initial positive sequence: the pairs (rho_2m, rho_2m+1), m = 1, 2, ..., while the sums of the
    # previous pairs stay positive (a pair of negative sum is dropped, and ends it)
    active = np.ones(k, dtype=bool)
    last_pair, last_even, last_kept = np.zeros(k, dtype=int), np.ones(k), np.ones(k, dtype=bool)
    t, m = 1, 1
    while t < s - 3 and active.any():
        even, odd = rho[t + 1], rho[t + 2]
        positive = active & (even + odd >= 0)
        kept[t + 1] = np.where(positive, even, 0.0)
        kept[t + 2] = np.where(positive, odd, 0.0)
        last_pair = np.where(active, m, last_pair)
        last_even = np.where(active, even, last_even)
        last_kept = np.where(active, positive, last_kept)
        active = active & (even + odd > 0)
        t, m = t + 2, m + 1
    # Geyer's initial monotone sequence: the pair sums never increase; the pairs before the last examined
    # count twice, the last one's even lag once (where kept, or positive: Stan's "improved estimation")
    half = s // 2
    sums = np.minimum.accumulate(kept[0 : 2 * half : 2] + kept[1 : 2 * half : 2], axis=0)  # [S/2, k]
    before_last = np.arange(half)[:, None] < last_pair[None, :]
    tau = -1.0 + 2.0 * np.where(before_last, sums, 0.0).sum(0)
    tau = tau + np.where(last_kept | (last_even > 0), last_even, 0.0)
    total = c * s
    tau = np.maximum(tau, 1.0 / np.log10(total))
    return total / tau


def rhat(draws: np.ndarray) -> np.ndarray:
    """Rank-normalised split :math:`\\hat R` of each coordinate of ``[C, S, k]`` draws (the larger of the
    bulk's and the folded tail's)."""
    split = split_chains(np.asarray(draws, dtype=float))
    folded = np.abs(split - np.median(split.reshape(-1, split.shape[-1]), axis=0))
    return np.maximum(_rhat(_z_scale(split)), _rhat(_z_scale(folded)))


def ess_bulk(draws: np.ndarray) -> np.ndarray:
    """Bulk effective sample size of each coordinate of ``[C, S, k]`` draws."""
    return _ess(_z_scale(split_chains(np.asarray(draws, dtype=float))))


def ess_tail(draws: np.ndarray) -> np.ndarray:
    """Tail effective sample size of each coordinate of ``[C, S, k]`` draws: the smaller of those of the
    indicators of the 5% and 95% quantiles."""
    draws = np.asarray(draws, dtype=float)
    flat = draws.reshape(-1, draws.shape[-1])
    sizes = []
    for q in (0.05, 0.95):
        below = (draws <= np.quantile(flat, q, axis=0)).astype(float)
        sizes.append(_ess(split_chains(below)))
    return np.minimum(*sizes)


class Convergence(NamedTuple):
    """The end-of-run figures of every coordinate, and what they flag."""

    names: list[str]  #: each coordinate's name (``"w[3]"``)
    rhat: np.ndarray  #: rank-normalised split :math:`\hat R`, ``[k]``
    ess_bulk: np.ndarray  #: ``[k]``
    ess_tail: np.ndarray  #: ``[k]``
    num_chains: int
    #: what failed, each a sentence naming the worst coordinates (empty on a healthy run)
    problems: list[str]

    def as_dict(self) -> dict:
        """The figures keyed by coordinate (for ``mcmc.diagnostics()``), and the problems."""
        return {
            "r_hat": dict(zip(self.names, self.rhat.tolist(), strict=True)),
            "ess_bulk": dict(zip(self.names, self.ess_bulk.tolist(), strict=True)),
            "ess_tail": dict(zip(self.names, self.ess_tail.tolist(), strict=True)),
            "problems": list(self.problems),
        }


def _worst(names: Sequence[str], values: np.ndarray, flagged: np.ndarray, largest: bool) -> str:
    order = np.argsort(-values if largest else values, kind="stable")
    chosen = [j for j in order if flagged[j]][:WORST_NAMED]
    return ", ".join(f"{names[j]} ({values[j]:.3g})" for j in chosen)


def check(draws: np.ndarray, names: Sequence[str]) -> Convergence:
    """:math:`\\hat R`, bulk and tail ESS of every coordinate of ``[C, S, k]`` draws (``names``: one per
    coordinate), and a sentence per threshold they miss (Stan's: :math:`\\hat R > 1.01`, ESS below 100 per
    chain), naming the worst coordinates. A coordinate that never moved (every draw the same) counts as not
    converged."""
    draws = np.asarray(draws, dtype=float)
    c = draws.shape[0]
    names = list(names)
    if draws.shape[1] < MIN_DRAWS:
        empty = np.full(draws.shape[-1], np.nan)
        return Convergence(
            names, empty, empty, empty, c, [f"{draws.shape[1]} draws per chain: too few to check"]
        )
    r, bulk, tail = rhat(draws), ess_bulk(draws), ess_tail(draws)
    frozen = draws.reshape(-1, draws.shape[-1]).std(0) == 0
    r, bulk, tail = (np.where(frozen, value, x) for value, x in ((np.inf, r), (0.0, bulk), (0.0, tail)))
    problems, minimum = [], ESS_PER_CHAIN * c
    if (flagged := ~(r <= RHAT_THRESHOLD)).any():
        problems.append(
            f"R-hat above {RHAT_THRESHOLD} for {int(flagged.sum())} of {len(names)} coordinates (worst: "
            f"{_worst(names, np.where(np.isnan(r), np.inf, r), flagged, True)}): the chains disagree"
        )
    for label, values in (("bulk", bulk), ("tail", tail)):
        if (flagged := ~(values >= minimum)).any():
            problems.append(
                f"{label} ESS below {ESS_PER_CHAIN} per chain ({minimum} for {c} chain{'s' * (c > 1)}) for "
                f"{int(flagged.sum())} of {len(names)} coordinates (worst: "
                f"{_worst(names, np.where(np.isnan(values), 0.0, values), flagged, False)})"
            )
    return Convergence(names, r, bulk, tail, c, problems)
