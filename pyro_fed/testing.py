r"""Exact answers for testing samplers on Gaussian targets.

On a Gaussian target every sampler of this package, with full local batches, is a linear recursion
:math:`z_{k+1} = A z_k + c + \xi_{k+1}` (with random :math:`A` when coins are involved). This module gives
the exact posterior of conjugate models and the exact stationary moments and Monte Carlo standard errors
of a linear recursion, so that tests separate algorithm bugs from discretisation bias and from Monte Carlo
noise.
"""

from __future__ import annotations

import torch


def gaussian_regression_posterior(
    x: torch.Tensor, y: torch.Tensor, noise_sd: float, prior_sd: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Exact posterior of :math:`w \sim N(0, s^2 I)`, :math:`y \mid w \sim N(x w, \sigma^2 I)`.

    :returns: the posterior mean :math:`m = P^{-1} x^\top y / \sigma^2` and precision
        :math:`P = I / s^2 + x^\top x / \sigma^2`; the potential is :math:`\frac12 (w-m)^\top P (w-m)`
        up to a constant.
    """
    precision = torch.eye(x.shape[-1], dtype=x.dtype) / prior_sd**2 + x.T @ x / noise_sd**2
    mean = torch.linalg.solve(precision, x.T @ y / noise_sd**2)
    return mean, precision


def stationary_moments(
    transition: torch.Tensor, offset: torch.Tensor, noise_cov: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Stationary mean and covariance of :math:`z' = A z + c + \xi`, :math:`\xi \sim N(0, Q)`.

    The mean solves :math:`(I - A)\mu = c`; the covariance solves the discrete Lyapunov equation
    :math:`S = A S A^\top + Q` (vectorised: :math:`(I - A \otimes A)\,\mathrm{vec}\,S = \mathrm{vec}\,Q`).
    """
    d = transition.shape[0]
    eye = torch.eye(d, dtype=transition.dtype)
    mean = torch.linalg.solve(eye - transition, offset)
    vec = torch.linalg.solve(
        torch.eye(d * d, dtype=transition.dtype) - torch.kron(transition, transition), noise_cov.reshape(-1)
    )
    return mean, vec.reshape(d, d)


def autocovariances(transition: torch.Tensor, covariance: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    r"""Stationary autocovariances :math:`\Gamma_l = A^l S` for :math:`l = 0, 1, \dots` until negligible."""
    lags = [covariance]
    scale = covariance.abs().max()
    while lags[-1].abs().max() > tol * scale and len(lags) < 100_000:
        lags.append(transition @ lags[-1])
    return torch.stack(lags)


def mean_standard_error(transition: torch.Tensor, covariance: torch.Tensor, num_draws: int) -> torch.Tensor:
    r"""Standard error of each coordinate of the sample mean of ``num_draws`` stationary draws.

    Uses the long-run covariance :math:`\sum_{l \in \mathbb Z} \Gamma_l = \Gamma_0 + \sum_{l>0}
    (\Gamma_l + \Gamma_l^\top)` (the effective sample size made exact).
    """
    gammas = autocovariances(transition, covariance)
    long_run = gammas[0] + (gammas[1:] + gammas[1:].transpose(-1, -2)).sum(0)
    return (long_run.diagonal() / num_draws).sqrt()


def covariance_standard_error(
    transition: torch.Tensor, covariance: torch.Tensor, num_draws: int
) -> torch.Tensor:
    r"""Standard error of each entry of the sample covariance of ``num_draws`` stationary Gaussian draws.

    By Isserlis' theorem :math:`\mathrm{Cov}(z_a z_b, z'_a z'_b) = \Gamma_{aa}\Gamma_{bb} +
    \Gamma_{ab}\Gamma_{ba}` at each lag, so :math:`\mathrm{Var}(\hat S_{ab}) \approx \frac1K
    \sum_{l \in \mathbb Z} (\Gamma_{l,aa}\Gamma_{l,bb} + \Gamma_{l,ab}\Gamma_{l,ba})`.
    """
    gammas = autocovariances(transition, covariance)
    diag = gammas.diagonal(dim1=-2, dim2=-1)  # [L, d]
    terms = diag[:, :, None] * diag[:, None, :] + gammas * gammas.transpose(-1, -2)
    long_run = terms[0] + 2 * terms[1:].sum(0)
    return (long_run / num_draws).sqrt()
