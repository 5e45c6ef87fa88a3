"""pSGLD as a Pyro MCMC kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import messages
from ..algorithms import psgld
from .arguments import check_positive, check_probability
from .base import FederatedKernel

#: :math:`(1 - \rho)\tau` of the slowest direction above which the kernel warns before the run: there the
#: dropped :math:`\Gamma` term makes that direction's variance about 13% wider than unadjusted Langevin's at
#: the same step (see :mod:`pyro_fed.algorithms.psgld`)
MEMORY_WARNING = 0.5
#: the :math:`(1 - \rho)\tau` the warning's suggested ``decay`` aims at (2.5% wider)
MEMORY_TARGET = 0.1


class PsgldKernel(FederatedKernel):
    r"""pSGLD: a server takes Langevin steps preconditioned by a running second moment of its gradient
    estimate, the sum of the clients' minibatch gradients.

    .. math::

        g = \sum_{i=1}^b \hat\nabla U^i(x; S^i), \quad
        V \leftarrow \rho V + (1 - \rho)\, g \odot g, \quad
        G = \frac{1}{\sqrt V + \epsilon}, \quad
        x \leftarrow x - \gamma\, G \odot g + \sqrt{2 \gamma G} \odot Z,

    with :math:`V` starting at 1 and the :math:`\Gamma` correction term of the exact preconditioned dynamics
    dropped, as is usual (see :mod:`pyro_fed.algorithms.psgld` for what that costs). Each iteration every
    client uploads its gradient (``32 d`` bits) and downloads :math:`x` (``32 d``); each draw is the server's
    :math:`x`. With one client (``clients=1``) it is pSGLD on the pooled data. :math:`G` is the kernel's
    only preconditioner: ``preconditioner`` is refused, and ``step_size`` is :math:`\gamma` in the model's
    unconstrained units, as in the paper (up to its scale convention, see the module).

    **The automatic step.** At stationarity on a Gaussian posterior of Hessian :math:`H`, :math:`E[g g^\top]`
    is the Fisher information :math:`H` plus the minibatches' noise, so :math:`G` settles near
    :math:`G_\star = 1 / (\sqrt{\mathrm{diag}\, H} + \epsilon)`
    (:func:`~pyro_fed.algorithms.psgld.stationary_preconditioner`), and below it with minibatch noise. The
    warm-up finds the mode and the Hessian diagonal there, then chooses :math:`\gamma` (and the minibatch
    and the thinning) as for every kernel's step with the fixed inverse mass :math:`G_\star` (see
    :mod:`pyro_fed.algorithms.adaptation`): the server's step on the whole potential, stable with the
    stiffness of :math:`G_\star^{1/2} H G_\star^{1/2}` measured at typical points and by the pilot run, and
    stable too for any smaller :math:`G`. The run itself has no fixed preconditioner (its inverse mass is
    the identity; :math:`G_\star` is kept in ``stationary_preconditioner``), and its chains start at
    the init strategy's points pulled toward the mode until their potential is at the posterior's typical
    level (``init_strategy``, see :class:`~pyro_fed.FederatedKernel`), not at draws of the Laplace
    approximation. Since :math:`G_\star` whitens only the square root of the curvature, directions whose
    curvatures differ by :math:`10^4` relax at rates :math:`10^2` apart; when the slowest one relaxes over
    more than ``MEMORY_WARNING`` / :math:`(1 - \rho)` iterations, :math:`G` follows the chain there, the
    dropped :math:`\Gamma` term widens that direction by more than 13%, and a warning before the run names
    the ``decay`` that keeps it within 2.5%.

    **Reference:** Li, Chen, Carlson, Carin, *Preconditioned stochastic gradient Langevin dynamics for deep
    neural networks*, AAAI 2016.

    :param model: a Pyro model whose likelihood is a plate over data (see :class:`~pyro_fed.FaldKernel`).
    :param clients: the clients (see :class:`~pyro_fed.FederatedKernel`); ``1`` for pSGLD on the pooled
        data.
    :param float decay: :math:`\rho \in [0, 1]`, the second moment's decay per iteration (default 0.99;
        0.95 is also common; 1 keeps :math:`V = 1`, ULA with the fixed :math:`G = 1/(1 + \epsilon)`).
    :param float damping: :math:`\epsilon > 0`, added to :math:`\sqrt V` (default ``1e-5``).

    The other arguments are those of :class:`~pyro_fed.FederatedKernel` but ``preconditioner`` (:math:`G` is
    pSGLD's own) and ``prior_weights="server"``.

    Example:

        >>> import pyro, pyro.distributions as dist, pyro_fed
        >>> from pyro.infer import MCMC
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        ...     logits = x @ w  # as written for NUTS: each client's rows of x and y are its data
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)
        >>> x, y = pyro_fed.datasets.titanic()
        >>> kernel = PsgldKernel(model, 1, step_size=0.03, batch_size=64, thinning=20)  # the paper's way
        >>> mcmc = MCMC(kernel, num_samples=300, warmup_steps=100, disable_progbar=True)
        >>> mcmc.run(x, y)
        >>> mcmc.get_samples()["w"].shape
        torch.Size([300, 4])
        >>> kernel = PsgldKernel(model)  # 10 i.i.d. clients, step, minibatch and thinning chosen
    """

    def __init__(
        self,
        model: Callable,
        clients=None,
        *,
        decay: float = 0.99,
        damping: float = 1e-5,
        **kwargs,
    ):
        if "preconditioner" in kwargs:
            raise ValueError(
                "PsgldKernel's preconditioner is its own G = 1 / (sqrt(V) + damping), from the running "
                "second moment V of its gradients: leave preconditioner out (decay sets how fast G follows "
                "them)."
            )
        weights = kwargs.get("prior_weights")
        if isinstance(weights, str) and weights == "server":
            raise ValueError(
                "PsgldKernel: prior_weights='server' is QlsdKernel's option; pSGLD's clients hold the prior "
                "('proportional', the default, 'uniform' or a tensor): their gradients sum to the full one."
            )
        self.decay = check_probability("decay", decay, allow_zero=True)
        self.damping = check_positive("damping", damping)
        algorithm = psgld.Psgld(decay=self.decay, damping=self.damping)
        super().__init__(model, clients, algorithm=algorithm, **kwargs)

    @property
    def stationary_preconditioner(self) -> torch.Tensor | None:
        """:math:`G_\\star`, the preconditioner the automatic step was chosen for (``[d]``; ``None`` with a
        given ``step_size``, or before the warm-up): see
        :meth:`~pyro_fed.algorithms.psgld.Psgld.warmup_preconditioner`."""
        if self.adaptation is None:
            return None
        return self.settings.warmup_preconditioner(self.adaptation.curvature)

    def warn_before_run(self) -> None:
        """Warn when the slowest direction relaxes over more than ``MEMORY_WARNING / (1 - decay)`` iterations
        at the automatic step (Gaussian, exact gradients: :math:`\\tau = (2 - h)/h`, :math:`h` the step times
        the slowest curvature preconditioned by :math:`G_\\star`), naming the ``decay`` that makes :math:`(1 -
        \\rho)\\tau` = ``MEMORY_TARGET``."""
        chosen = self.adaptation
        if chosen is None or self.decay == 1.0:
            return
        moved = min(chosen.step_size * chosen.slowest, 1.0)
        relaxation = (2.0 - moved) / moved
        memory = (1.0 - self.decay) * relaxation
        if memory <= MEMORY_WARNING:
            return
        messages.warn(
            f"{type(self).__name__}: at the automatic step the slowest direction relaxes over about "
            f"{relaxation:.3g} iterations, while V averages the squared gradients over 1 / (1 - decay) = "
            f"{1 / (1 - self.decay):.3g}: G then follows the chain in that direction and the dropped Gamma "
            f"term widens it (by more than 13% at (1 - decay) * relaxation = {memory:.3g}, exact gradients "
            f"on a Gaussian). decay={1 - MEMORY_TARGET / relaxation:.6g} keeps it within 2.5% (V then takes "
            "that many more iterations to settle: a longer warm-up); a kernel with the warm-up's full "
            "preconditioner (FaldKernel, SgldKernel) has no such bias.",
        )
