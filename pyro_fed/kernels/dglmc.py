"""DG-LMC as a Pyro MCMC kernel."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..algorithms import dglmc
from .arguments import check_positive, check_positive_int
from .base import FederatedKernel


def check_tolerance(value) -> float | torch.Tensor | None:
    """``None`` (automatic), a finite positive number, or a 1-D sequence of them (one per client)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return check_positive("tolerance", value)
    if isinstance(value, (list, tuple, torch.Tensor, np.ndarray)):
        values = torch.as_tensor(value, dtype=torch.float64).detach()
        if values.dim() == 1 and len(values) and bool((values.isfinite() & (values > 0)).all()):
            return values
        raise ValueError(
            "tolerance must be a finite positive number, one per client (a 1-D sequence of finite positive "
            f"numbers) or None (chosen from the warm-up's curvature); got {value!r}."
        )
    return check_positive("tolerance", value)


class DglmcKernel(FederatedKernel):
    r"""DG-LMC: distributed Gibbs sampling of a posterior augmented by one auxiliary variable per client,
    with Langevin steps within it.

    Each client :math:`i` holds :math:`z_i`, tied to the server's :math:`\theta` with tolerance
    :math:`\rho_i`; each iteration every client takes ``local_steps`` Langevin steps on its conditional, then
    the server draws :math:`\theta` exactly from its own:

    .. math::

        z_i \leftarrow z_i - \gamma_i M \hat\nabla U^i(z_i) - \frac{\gamma_i}{\rho_i}(z_i - \theta)
        + \sqrt{2\gamma_i}\, R\, \xi_i, \qquad
        \theta \sim N\Big(\frac{\sum_i z_i/\rho_i}{\sum_i 1/\rho_i},
        \Big(\sum_i \frac1{\rho_i}\Big)^{-1} M\Big),

    with :math:`M = R R^\top` the preconditioner (adapted by default; see
    :class:`~pyro_fed.FederatedKernel`): the paper's algorithm in the coordinates where :math:`M` is the
    identity, so that the tolerance is measured in posterior variances (see
    :mod:`pyro_fed.algorithms.dglmc`). Each draw is :math:`\theta`. Its stationary law is that of the
    augmented target's :math:`\theta`-marginal — the posterior with each client's likelihood smoothed by
    :math:`N(0, \rho_i M)` — up to the discretisation's :math:`O(\gamma)`; on Gaussian clients its mean is
    that marginal's exactly, whatever :math:`\gamma`.

    Every iteration each client uploads :math:`z_i` and downloads :math:`\theta` (``32 d`` bits each way).

    **Automatic settings.** The tolerance and the step are chosen from the warm-up's measures (the mode, the
    clients' largest preconditioned curvature :math:`L`, the posterior's slowest, the gradient noise
    :math:`V`) so that each of them adds at most :math:`\varepsilon = \sqrt{1.1} - 1` to the stationary
    variance's excess in the stiffest direction, 10% together as for the other kernels: :math:`\rho L =
    \varepsilon / (1 + \varepsilon)`, or less where the clients' heterogeneity (their Hessians times their
    gradients at the mode: one more round of uploads) would move the mean by more than a tenth of a posterior
    sd; :math:`\gamma = 2\varepsilon b / (V + (1 + \varepsilon) b (L + 1/\rho))`, a client step stable and
    accurate on its conditional (see :func:`~pyro_fed.algorithms.dglmc.automatic_tolerance`,
    :func:`~pyro_fed.algorithms.dglmc.automatic_step`). The clients' centre relaxes like Langevin with step
    :math:`\gamma / b` on :math:`U`, some 45 times slower per iteration than FALD at the same accuracy: the
    thinning (half the slowest direction's autocorrelation time, at most 100) grows with it. The
    preconditioner is the warm-up's for the whole run: the other kernels measure it again from their first
    draws, which here would change the units of the tolerance, and the step chosen for it, mid-run.

    **Reference:** Plassier, Vono, Durmus, Moulines, *DG-LMC: a turn-key and scalable synchronous
    distributed MCMC algorithm via Langevin Monte Carlo within Gibbs*, ICML 2021, Algorithm 1.

    :param tolerance: :math:`\rho`, a positive number or one per client (default ``None``: chosen, see
        above; with a ``step_size`` of the user's the warm-up runs only with ``preconditioner="adapt"``, so
        give ``tolerance`` then).
    :param float step_size: :math:`\gamma` (default: chosen, see above; per client :math:`\gamma_i` for the
        curvature :math:`L + 1/\rho_i` of each client's conditional when the tolerances differ, the kernel's
        ``step_size`` their largest). Must be below :math:`2\rho_i`: the tie alone makes a larger step
        diverge.
    :param int local_steps: :math:`N`, the clients' Langevin steps per iteration (default 1), all toward the
        same :math:`\theta`; more than 1 needs full local batches (a minibatch is drawn per iteration).

    The other arguments are those of :class:`~pyro_fed.FederatedKernel`.

    Example: a Bayesian logistic regression of Titanic survival, its data split over 10 clients.

        >>> import pyro, pyro.distributions as dist, pyro_fed
        >>> from pyro.infer import MCMC
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        ...     logits = x @ w  # as written for NUTS: each client's rows of x and y are its data
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)
        >>> x, y = pyro_fed.datasets.titanic()
        >>> kernel = DglmcKernel(model)  # 10 i.i.d. clients; tolerance, step, preconditioner chosen
        >>> # a wider tie in the adapted preconditioner's units (posterior variances) and a larger step mix
        >>> # faster, at the price of a wider stationary law
        >>> kernel = DglmcKernel(model, tolerance=1.0, step_size=0.2, preconditioner="adapt")
        >>> mcmc = MCMC(kernel, num_samples=300, warmup_steps=100, disable_progbar=True)
        >>> mcmc.run(x, y)
        >>> mcmc.get_samples()["w"].shape
        torch.Size([300, 4])
        >>> kernel.current_tolerance.tolist()  # one per client
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        model: Callable,
        clients=None,
        *,
        tolerance: float | torch.Tensor | None = None,
        local_steps: int = 1,
        **kwargs,
    ):
        self.tolerance = check_tolerance(tolerance)
        self.local_steps = check_positive_int("local_steps", local_steps)
        algorithm = dglmc.Dglmc(tolerance=self.tolerance, local_steps=self.local_steps)
        super().__init__(model, clients, algorithm=algorithm, **kwargs)
        if self.step_size is not None and self.tolerance is None and not isinstance(self.preconditioner, str):
            raise ValueError(
                "tolerance=None is chosen from the warm-up's curvature, and with a step_size of yours the "
                "warm-up runs only to adapt a preconditioner: give tolerance too, or pass "
                "preconditioner='adapt', or leave step_size out."
            )
        if self.step_size is not None and self.tolerance is not None:
            dglmc.check_step(self.step_size, float(torch.as_tensor(self.tolerance).min()))
        if self.local_steps > 1 and self.batch_size not in (None, "full"):
            raise ValueError(
                f"local_steps={self.local_steps} with batch_size={self.batch_size!r}: the local steps of an "
                "iteration would reuse its minibatch. Use full local batches (batch_size=None or 'full'), "
                "or local_steps=1."
            )

    @property
    def current_tolerance(self) -> torch.Tensor | None:
        """:math:`\\rho_i` of the current run, ``[b]`` (``None`` before set-up)."""
        algorithm = self.algorithm
        return None if algorithm is None else algorithm.tolerance
