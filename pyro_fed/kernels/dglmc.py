"""DG-LMC as a Pyro MCMC kernel."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..algorithms import adaptation, dglmc
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
        ...     with pyro.plate("data", x.shape[0]):
        ...         logits = pyro.subsample(x, event_dim=1) @ w
        ...         pyro.sample("y", dist.Bernoulli(logits=logits), obs=pyro.subsample(y, event_dim=0))
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
        super().__init__(model, clients, **kwargs)
        self.tolerance = check_tolerance(tolerance)
        self.local_steps = check_positive_int("local_steps", local_steps)
        if self.step_size is not None and self.tolerance is None and not isinstance(self.preconditioner, str):
            raise ValueError(
                "tolerance=None is chosen from the warm-up's curvature, and with a step_size of yours the "
                "warm-up runs only to adapt a preconditioner: give tolerance too, or pass "
                "preconditioner='adapt', or leave step_size out."
            )
        if self.step_size is not None and self.tolerance is not None:
            self._check_step(self.step_size, float(torch.as_tensor(self.tolerance).min()))
        if self.local_steps > 1 and self.batch_size not in (None, "full"):
            raise ValueError(
                f"local_steps={self.local_steps} with batch_size={self.batch_size!r}: the local steps of an "
                "iteration would reuse its minibatch. Use full local batches (batch_size=None or 'full'), "
                "or local_steps=1."
            )
        # the tolerances and the steps' factors resolved for an adaptation (see _settings)
        self._resolved = None

    @staticmethod
    def _check_step(step: float, tolerance: float) -> None:
        if step >= 2 * tolerance:
            raise ValueError(
                f"step_size={step:.3g} is at least twice the tolerance {tolerance:.3g}: a client's "
                "conditional has curvature at least 1/tolerance, on which such a step diverges. Pass a "
                "step_size below 2 * tolerance (0.2 * tolerance keeps its bias near 10%), or leave it out."
            )

    # ---------------------------------------------------------------- set-up
    def chooses_batch_size(self) -> bool:
        # the local steps of an iteration share its minibatch: full local batches with more than one
        return super().chooses_batch_size() and self.local_steps == 1

    def gradient_evaluations(self, minibatches: bool) -> int:
        return self.local_steps

    def finish_adaptation(self, chosen):
        """With the warm-up's measures: the automatic tolerance (one more round of uploads: the clients'
        Hessians times their gradients at the mode), the automatic step for the clients' conditionals, and
        the thinning for the clients' centre's step :math:`\\gamma / b` on :math:`U`."""
        tolerance, steps, rounds = self._resolve(chosen)
        step = float(steps.max())
        thinning = chosen.thinning
        if self.thinning is None and self.step_size is None:  # 1 with a step of the user's, as elsewhere
            thinning = adaptation.thinning_for(float(steps.mean()) / self.network.num_clients, chosen.slowest)
        finished = chosen._replace(step_size=step, thinning=thinning, rounds=chosen.rounds + rounds)
        self._resolved = (finished, tolerance, steps / step)
        return finished

    def _resolve(self, chosen) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every client's tolerance and step (``[b]`` each) for the warm-up's measures ``chosen``, and the
        rounds of uploads they cost."""
        b = self.network.num_clients
        rounds = 0
        if self.tolerance is None:
            tolerance = torch.full(
                (b,), dglmc.automatic_tolerance(chosen.stiffness, chosen.slowest, self._pull(chosen))
            )
            rounds = 1
        else:
            tolerance = self._given_tolerance()
        if self.step_size is None:
            steps = dglmc.automatic_step(chosen.stiffness, tolerance, chosen.noise, b)
        else:
            self._check_step(self.step_size, float(tolerance.min()))
            steps = torch.full((b,), self.step_size, dtype=torch.float64)
        return tolerance.double(), steps, rounds

    def _pull(self, chosen) -> float:
        r""":math:`\|\sum_i \tilde A_i \tilde g_i\|`: the clients' Hessians times their gradients at the mode,
        in the preconditioned coordinates (:math:`R \nabla^2 U^i M \nabla U^i`; one Hessian-vector product per
        client, on its own data, summed by the network)."""
        pot = self.potential
        root = adaptation.square_root(chosen.preconditioner)
        grads = self._full_gradients(chosen.mode[None])  # [1, b, d]
        tangents = adaptation.whiten(root, adaptation.whiten(root, grads))  # M grad (R symmetric)
        products = adaptation.hessian_products(pot.full_gradient_fn, chosen.mode, tangents)
        return float(self.network.sum(adaptation.whiten(root, products)).double().norm())

    def _given_tolerance(self) -> torch.Tensor:
        b = self.network.num_clients
        if isinstance(self.tolerance, torch.Tensor):
            if len(self.tolerance) != b:
                raise ValueError(
                    f"tolerance has {len(self.tolerance)} values; the run has {b} clients: give one per "
                    "client, or a single number for all."
                )
            return self.tolerance.double()
        return torch.full((b,), self.tolerance, dtype=torch.float64)

    def _settings(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The run's tolerances and step factors :math:`\\gamma_i / \\gamma` (``None``: all 1)."""
        chosen = self.adaptation
        if chosen is None:
            return self._given_tolerance(), None
        if self._resolved is None or self._resolved[0] is not chosen:
            # resumed from a checkpoint: the warm-up's measures give the same settings again (the rounds
            # were counted by the run that chose them)
            tolerance, steps, _ = self._resolve(chosen)
            self._resolved = (chosen, tolerance, steps / float(steps.max()))
        _, tolerance, factors = self._resolved
        return tolerance, None if bool((factors == 1).all()) else factors

    @property
    def current_tolerance(self) -> torch.Tensor | None:
        """:math:`\\rho_i` of the current run, ``[b]`` (``None`` before set-up)."""
        algorithm = self.algorithm
        return None if algorithm is None else algorithm.tolerance

    def make_algorithm(self, **common) -> dglmc.Dglmc:
        tolerance, factors = self._settings()
        return dglmc.Dglmc(
            tolerance=tolerance,
            reference_step=self.current_step_size,
            step_factors=factors,
            local_steps=self.local_steps,
            **common,
        )
