"""FSGLD as a Pyro MCMC kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import messages
from ..algorithms import adaptation, fsgld
from .arguments import check_positive_int
from .base import FederatedKernel

#: the surrogates' forms: ``"auto"`` is dense up to ``adaptation.DENSE_DIMENSIONS`` coordinates
SURROGATE_FORMS = ("auto", "dense", "diagonal")
#: the run is warned before it starts when the conducive gradient's noise makes the automatic step more than
#: this many times smaller than exact gradients would
SURROGATE_WARNING = 10.0


class FsgldKernel(FederatedKernel):
    r"""Federated stochastic gradient Langevin dynamics (FSGLD) with conducive gradients.

    Before sampling, every client :math:`i` fits a Gaussian surrogate :math:`\tilde U^i(x) = \frac12 (x -
    \mu_i)^\top \Lambda_i (x - \mu_i)` of its potential and uploads it once. Each round the server draws one
    client :math:`s \sim \mathrm{Cat}(p)` and sends it :math:`x`; the client takes :math:`K` =
    ``local_steps`` Langevin steps with the conducive gradient and sends :math:`x` back:

    .. math::

        g(x) = \frac1{p_s} \Big(\hat\nabla U^s(x) - \nabla\tilde U^s(x)\Big) + \sum_i \nabla\tilde U^i(x),
        \qquad x \leftarrow x - \gamma\, m \odot g(x) + \sqrt{2\gamma m} \odot Z.

    :math:`g` is an unbiased estimate of :math:`\nabla U` whatever the surrogates, and equals it where they
    are exact (Gaussian clients): the better the surrogates, the smaller the noise the round's single client
    adds (see :mod:`pyro_fed.algorithms.fsgld`). Each draw is :math:`x` after one local step (``thinning``
    steps with ``thinning > 1``); :math:`m` is the preconditioner (see :class:`~pyro_fed.FederatedKernel`).

    **Surrogates.** By default each client's is its second-order Taylor expansion at the mode :math:`\hat x`
    of :math:`U` (the warm-up's, or found by L-BFGS with a given ``step_size``): :math:`\Lambda_i =
    \nabla^2 U^i(\hat x)`, :math:`\Lambda_i \mu_i = \Lambda_i \hat x - \nabla U^i(\hat x)` — a Laplace
    approximation of :math:`U^i` whose error is smallest where the chains go, exact for Gaussian clients
    (:func:`~pyro_fed.algorithms.fsgld.fit_surrogates`). It costs each client :math:`d` Hessian-vector
    products and a gradient, computed locally; each client uploads :math:`d^2 + d` floats (:math:`2d` for a
    diagonal :math:`\Lambda_i`) and downloads their sums, counted once in the bits at set-up.

    **Cost per round:** ``32 d`` bits down and ``32 d`` up, one client's gradients per local step.
    ``sample_stats`` records per draw ``client`` (the client that took the draw's last step) and
    ``new_round`` (a round started within the draw's iterations), beside the cumulative bits.

    **Reference:** El Mekkaoui, Mesquita, Blomstedt, Kaski, *Federated stochastic gradient Langevin
    dynamics*, UAI 2021.

    :param int local_steps: :math:`K`, the local steps of a round (default 1: a fresh client every
        iteration, whose error is independent from one step to the next, which is the noise the warm-up's
        step rule accounts for exactly; a larger :math:`K` sends :math:`K` times fewer messages, but the
        round's client errs the same way for :math:`K` steps, which the automatic step pays for as :math:`K`
        times the variance, and with surrogates that are not exact the stationary mean moves off the
        posterior's: :math:`K` steps of one random client are not :math:`K` steps of their average).
    :param client_probs: :math:`p`, the law of the round's client: ``None`` (default: :math:`p_i = N_i / N`,
        each client's share of the data) or ``b`` positive numbers (normalised).
    :param surrogates: ``None`` (default: fitted, see above) or ``(means, precisions)``: :math:`\mu_i`
        ``[b, d]`` and :math:`\Lambda_i` ``[b, d, d]`` (symmetric) or ``[b, d]`` (diagonal), for every
        client in the global order, in the model's flat unconstrained coordinates (e.g. Laplace
        approximations at the clients' own modes, or Gaussians fitted to local draws as in the paper).
    :param str surrogate_form: the fitted precisions' form: ``"auto"`` (default: dense up to
        ``DENSE_DIMENSIONS`` = 200 coordinates, else diagonal), ``"dense"`` or ``"diagonal"``.

    The other arguments are those of :class:`~pyro_fed.FederatedKernel`; the prior is split among the
    clients (their surrogates fit their shares of it), so ``prior_weights="server"`` is refused. The
    automatic step size is the server's on the whole potential, with the noise of the conducive estimate
    (the random client and its minibatch, scaled by :math:`K`) measured at draws of the Laplace
    approximation.
    """

    def __init__(
        self,
        model: Callable,
        clients=None,
        *,
        local_steps: int = 1,
        client_probs=None,
        surrogates: tuple[torch.Tensor, torch.Tensor] | None = None,
        surrogate_form: str = "auto",
        **kwargs,
    ):
        if isinstance(kwargs.get("prior_weights"), str) and kwargs["prior_weights"] == "server":
            raise ValueError(
                "prior_weights='server': FSGLD's clients fit their surrogates to their own potentials, "
                "shares of the prior included (a likelihood alone may have no mode to expand around): split "
                "the prior among the clients ('proportional', the default, 'uniform' or a tensor)."
            )
        self.local_steps = check_positive_int("local_steps", local_steps)
        self.client_probs = _check_client_probs(client_probs)
        self.surrogates = _check_surrogates(surrogates)
        if surrogate_form not in SURROGATE_FORMS:
            raise ValueError(f"surrogate_form must be one of {SURROGATE_FORMS}; got {surrogate_form!r}.")
        if surrogates is not None and surrogate_form != "auto":
            raise ValueError(
                "surrogate_form is the form of the fitted surrogates; the surrogates given have their own "
                "(their precisions' shape): leave surrogate_form out."
            )
        self.surrogate_form = surrogate_form
        algorithm = fsgld.Fsgld(
            local_steps=self.local_steps,
            client_probs=self.client_probs,
            surrogate_moments=self.surrogates,
            surrogate_form=surrogate_form,
        )
        super().__init__(model, clients, algorithm=algorithm, **kwargs)

    def warn_before_run(self) -> None:
        """Warn when the conducive gradient's noise makes the automatic step more than ``SURROGATE_WARNING``
        times smaller than exact gradients would (:func:`~pyro_fed.algorithms.adaptation.step_shrink` of the
        noise the warm-up measured): the round's client stands for all of them, scaled by :math:`1/p_s`,
        and what its surrogate misses of its potential (and its minibatch, and its ``local_steps``) is the
        noise; the chains need that many times the iterations of exact gradients."""
        chosen = self.adaptation
        if chosen is None or self.step_size is not None:
            return
        shrink = adaptation.step_shrink(chosen.noise, chosen.stiffness)
        if shrink <= SURROGATE_WARNING:
            return
        bias = (
            f" With local_steps={self.local_steps}, surrogates that are not exact also move the stationary "
            "mean off the posterior's (the round's client errs the same way for all its steps): "
            "local_steps=1 does not."
            if self.local_steps > 1
            else ""
        )
        messages.warn(
            f"{type(self).__name__}: the conducive gradient's noise (the round's one client of "
            f"{self.network.num_clients}, what its surrogate misses of its potential scaled by 1/p_s"
            + (f", held for local_steps={self.local_steps}" if self.local_steps > 1 else "")
            + (", and its minibatch" if not self.full_local_batches else "")
            + f") makes the automatic step {shrink:.3g} times smaller than exact gradients would (noise "
            f"{chosen.noise:.3g} against a curvature of {chosen.stiffness:.3g}, preconditioned): the chains "
            f"need {shrink:.3g} times the iterations for the same accuracy. Surrogates closer to the "
            "clients' potentials (surrogate_form='dense', or your own, e.g. fitted to local draws), fewer "
            "local_steps or a larger batch_size reduce it." + bias,
        )


def _check_client_probs(value) -> torch.Tensor | None:
    if value is None:
        return None
    try:
        probs = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        probs = None
    if (
        probs is None
        or probs.dim() != 1
        or len(probs) == 0
        or not bool((probs.isfinite() & (probs > 0)).all())
    ):
        raise ValueError(
            "client_probs must be None (p_i = N_i / N) or a 1-D sequence of positive finite numbers, one per "
            f"client (normalised; every client needs a chance, or its data are never read); got {value!r}."
        )
    return probs


def _check_surrogates(value):
    if value is None:
        return None
    if not (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(t, torch.Tensor) for t in value)
    ):
        raise ValueError(
            "surrogates must be None (fitted at the mode) or a pair (means, precisions) of tensors: means "
            f"[b, d], precisions [b, d, d] or [b, d] (diagonal); got {value!r}."
        )
    means, precisions = (t.detach() for t in value)
    if not bool(means.isfinite().all() and precisions.isfinite().all()):
        raise ValueError("surrogates: the means and precisions must be finite.")
    if precisions.dim() == 3 and not torch.allclose(precisions, precisions.transpose(-1, -2)):
        raise ValueError(
            "surrogates: a dense precision is a Hessian, symmetric; these are not (symmetrise them, "
            "(L + L.T) / 2, or give the inverse covariances)."
        )
    return means, precisions
