"""SVRG-LD as a Pyro MCMC kernel: VR-FALD⋆ with one client and an average at every iteration."""

from __future__ import annotations

from .vr_fald import VrFaldKernel

#: VR-FALD⋆'s arguments that SVRG-LD fixes
FIXED = ("clients", "comm_prob", "noise_corr")


class SvrgLdKernel(VrFaldKernel):
    r"""SVRG-LD: stochastic gradient Langevin dynamics on the pooled data with SVRG's control variate around
    a snapshot :math:`\tilde x` at which the full gradient is known:

    .. math::

        g = \hat\nabla U(x_k; S_k) - \hat\nabla U(\tilde x; S_k) + \nabla U(\tilde x), \qquad
        x_{k+1} = x_k - \gamma\, m \odot g + \sqrt{2 \gamma m} \odot Z_{k+1},

    both minibatch terms on the same minibatch :math:`S_k`, :math:`Z \sim N(0, I_d)`. With probability
    ``refresh_prob`` :math:`q` per iteration a new snapshot is taken: :math:`\tilde x` becomes the iterate
    before the step, :math:`\nabla U(\tilde x)` is computed on all the data (one full-data gradient), and both
    serve from the next iteration on. Dubey et al. take a snapshot at the start of every epoch of a fixed
    length :math:`l`; here the epochs are geometric, of mean :math:`1/q`. :math:`m` is the preconditioner
    (adapted with an automatic step, see :class:`~pyro_fed.FederatedKernel`; the paper's rule is
    :math:`m = 1`).

    This is VR-FALD⋆ (:class:`~pyro_fed.VrFaldKernel`) with one client holding all the data, whose average is
    itself at every iteration (``comm_prob=1``; the noise correlation has nothing to correlate): the reference
    point :math:`Y` is the snapshot and the shift :math:`C = \nabla U(Y)` its full gradient. No algorithm
    module of its own is needed: it runs :mod:`pyro_fed.algorithms.vr_fald`. The bits it reports are
    VR-FALD⋆'s with one client (``32 d`` per iteration, twice that per snapshot), what its one holder of the
    data would send to a server; a centralised run sends nothing. ``sample_stats`` records ``refreshed``
    (a snapshot in the draw's iterations).

    **Reference:** Dubey, Reddi, Williamson, Poczos, Smola, Xing, *Variance reduction in stochastic gradient
    Langevin dynamics*, NeurIPS 2016 (SVRG-LD); as the limit of VR-FALD⋆: Plassier, Durmus, Moulines et al.,
    *Federated Averaging Langevin Dynamics*, AISTATS 2023, Section 3.

    :param float refresh_prob: :math:`q \in (0, 1]`, the probability of a new snapshot per iteration (default
        ``None``: snapshots take a tenth of the data evaluations, :math:`q = 0.1 \cdot 2 n / N` with
        minibatches of :math:`n` points, see :func:`~pyro_fed.algorithms.adaptation.refresh_probability`).
    :param batch_size: the minibatch size :math:`n` (default ``None``: chosen with an automatic step; with
        full batches the control variate is the exact gradient and SVRG-LD is ULA).

    The other arguments are those of :class:`~pyro_fed.FederatedKernel`; ``clients``, ``comm_prob`` and
    ``noise_corr`` are fixed (one client, an average every iteration) and refused.

    Example:

        >>> import pyro, pyro.distributions as dist, pyro_fed
        >>> from pyro.infer import MCMC
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        ...     logits = x @ w  # as written for NUTS: each client's rows of x and y are its data
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)
        >>> x, y = pyro_fed.datasets.titanic()
        >>> kernel = SvrgLdKernel(model, batch_size=32, refresh_prob=0.01)
        >>> mcmc = MCMC(kernel, num_samples=300, warmup_steps=100, disable_progbar=True)
        >>> mcmc.run(x, y)
        >>> mcmc.get_samples()["w"].shape
        torch.Size([300, 4])
    """

    def __init__(self, model, **kwargs):
        given = [name for name in FIXED if name in kwargs]
        if given:
            raise ValueError(
                f"SvrgLdKernel is centralized, with one client averaged every iteration: it takes no "
                f"{', '.join(given)}. For several clients use VrFaldKernel."
            )
        super().__init__(model, 1, comm_prob=1.0, noise_corr=1.0, **kwargs)
