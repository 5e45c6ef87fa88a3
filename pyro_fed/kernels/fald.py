"""FALD as a Pyro MCMC kernel."""

from __future__ import annotations

from collections.abc import Callable

from ..algorithms import fald
from .arguments import check_probability
from .base import FederatedKernel


class FaldKernel(FederatedKernel):
    r"""Federated Averaging Langevin Dynamics (FALD).

    Each client :math:`i` takes local Langevin steps on :math:`U^i` from its own minibatches; with
    probability ``comm_prob`` the server averages the client iterates:

    .. math::

        \tilde X^i_{k+1} = X^i_k - \gamma \hat\nabla U^i(X^i_k; S^i_k) + \sqrt{2\gamma}\, Z^i_{k+1},
        \qquad Z^i = \sqrt{\tau/b}\,\tilde Z + \sqrt{1-\tau}\,\tilde Z^i,

        X^i_{k+1} = \tfrac1b \textstyle\sum_l \tilde X^l_{k+1} \text{ if } B_{k+1} = 1
        \text{ else } \tilde X^i_{k+1}, \qquad B_{k+1} \sim \mathrm{Ber}(p_c).

    With an inverse mass :math:`m` (``preconditioner``, adapted by default), the local step is
    :math:`X^i_k - \gamma\, m \odot \hat\nabla U^i + \sqrt{2\gamma m} \odot Z^i_{k+1}`: FALD in the
    coordinates :math:`x / \sqrt m` (see :mod:`pyro_fed.algorithms.adaptation`).

    Each :meth:`~pyro_fed.FederatedKernel.sample` call returns the client average :math:`\bar X_k` after one
    iteration (``thinning`` iterations with ``thinning > 1``); the iterations run a chunk at a time (see
    :class:`~pyro_fed.FederatedKernel`), and ``MCMC(kernel, num_chains=C)`` runs ``C`` chains as one batch. At
    consensus the average follows Langevin dynamics with step :math:`\gamma/b` on the full potential
    :math:`U`, so a centralised SGLD step :math:`h` corresponds to ``step_size = b * h``. With
    ``comm_prob < 1`` and heterogeneous clients each :math:`X^i` drifts toward its own local posterior
    between rounds (a bias growing with :math:`\gamma` and heterogeneity); see
    :class:`~pyro_fed.VrFaldKernel` for the cure.

    **Reference:** Plassier, Durmus, Moulines et al., *Federated Averaging Langevin Dynamics: Toward a
    unified theory and new algorithms*, AISTATS 2023, Section 2.

    :param model: a Pyro model whose likelihood is a plate over data, declared at full size: as written for
        NUTS (its data as arguments, read at full size: each client's potential is the model run on its rows
        of them, :mod:`pyro_fed.model.rows`), or reading its data through the plate's indices
        (``pyro.subsample`` or ``with pyro.plate(...) as idx``).
    :param clients: a number of clients ``b`` (an i.i.d. split of the data, seed 0), a LongTensor of length
        ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index tensors (see
        :mod:`pyro_fed.data.partition`); default: 10 i.i.d. clients (one per datum with fewer than 10 data).
    :param float step_size: :math:`\gamma > 0` (default: chosen from the potential's curvature before the
        chains start, and checked by a pilot run within the warm-up; see
        :mod:`pyro_fed.algorithms.adaptation`).
    :param preconditioner: the inverse mass :math:`m` of preconditioned steps (default: adapted with an
        automatic ``step_size``, none with a given one), ``"adapt"`` or a tensor of ``d`` positive numbers;
        see :class:`~pyro_fed.FederatedKernel`.
    :param float comm_prob: :math:`p_c \in (0, 1]`, the probability of an averaging round per iteration
        (default 1: an average every iteration). With ``comm_prob < 1`` and an automatic step the warm-up
        models the clients as quadratics at the mode, cuts the step (at most 4-fold) until the predicted
        drift error of the draws is within 0.05 posterior sd, and warns before the draws where it is not
        (the error, its cause and the ``comm_prob`` that meets it). ``None``: the warm-up chooses the least
        rounds within that target (from :math:`2^{-10}` to 1, VR-FALD⋆'s refresh probability with it), or 1
        where rare rounds would need a smaller step; at most 1's traffic on conjugate models, a median of
        3.3 times fewer MB per effective draw for VR-FALD⋆ on posteriordb's i.i.d. splits and none saved on
        sorted ones, where an average every iteration is cheapest (see
        :func:`~pyro_fed.algorithms.drift.finish_communication`).
    :param float noise_corr: :math:`\tau \in [0, 1]`, the correlation of the clients' noises.
    :param batch_size: minibatch size :math:`n_i` per client, a fraction of each client's data, or
        ``"full"`` (default ``None``: chosen with an automatic step, else full); see
        :class:`~pyro_fed.FederatedKernel`.
    :param prior_weights: :math:`\varpi^i`: ``"proportional"`` (``N_i/N``), ``"uniform"`` or a tensor.
    :param str plate: the data plate's name, when the model has several plates with observed sites.
    :param init_strategy: a Pyro init strategy (default: a draw of the warm-up's Laplace approximation when
        the preconditioner is adapted, else the prior median); see :class:`~pyro_fed.FederatedKernel`.
    :param str gradient_mode: ``"auto"`` (default: compiled when the run is long enough to pay for it),
        ``"compiled"``, ``"traced"`` or ``"eager"``; see :class:`~pyro_fed.FederatedKernel`.
    :param int thinning: iterations per draw (default: about half an autocorrelation time with an
        automatic step, else 1); see :class:`~pyro_fed.FederatedKernel`.
    :param int chunk_size: iterations run per chunk (default 64).
    :param network: where the clients meet (default: all in this process); see
        :class:`~pyro_fed.FederatedKernel`.
    :param checkpoint: a file where the run keeps a checkpoint to resume from (default ``None``: none).
    :param int checkpoint_every: draws per chain between checkpoints; see :class:`~pyro_fed.FederatedKernel`.

    Example: a Bayesian logistic regression of Titanic survival, its data split over 10 clients.

        >>> import pyro, pyro.distributions as dist, pyro_fed
        >>> from pyro.infer import MCMC
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        ...     logits = x @ w  # as written for NUTS: each client's rows of x and y are its data
        ...     with pyro.plate("data", x.shape[0]):
        ...         pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)
        >>> x, y = pyro_fed.datasets.titanic()
        >>> mcmc = MCMC(FaldKernel(model), num_samples=300, warmup_steps=100, disable_progbar=True)
        >>> mcmc.run(x, y)  # 10 i.i.d. clients, step size and preconditioner chosen
        >>> mcmc.get_samples()["w"].shape
        torch.Size([300, 4])
        >>> clients = pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5)  # label-skewed sites
        >>> kernel = FaldKernel(model, clients, comm_prob=0.2, batch_size=32)
    """

    def __init__(
        self,
        model: Callable,
        clients=None,
        *,
        step_size: float | None = None,
        preconditioner=None,
        comm_prob: float | None = 1.0,
        noise_corr: float = 1.0,
        batch_size: int | float | str | None = None,
        prior_weights="proportional",
        plate: str | None = None,
        init_strategy: Callable | None = None,
        gradient_mode: str = "auto",
        thinning: int | None = None,
        chunk_size: int = 64,
        network=None,
        checkpoint=None,
        checkpoint_every: int | None = None,
    ):
        self.comm_prob = None if comm_prob is None else check_probability("comm_prob", comm_prob)
        self.noise_corr = check_probability("noise_corr", noise_corr, allow_zero=True)
        super().__init__(
            model,
            clients,
            algorithm=self._algorithm(),
            step_size=step_size,
            preconditioner=preconditioner,
            batch_size=batch_size,
            prior_weights=prior_weights,
            plate=plate,
            init_strategy=init_strategy,
            gradient_mode=gradient_mode,
            thinning=thinning,
            chunk_size=chunk_size,
            network=network,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
        )

    def _algorithm(self) -> fald.Fald:
        return fald.Fald(comm_prob=self.comm_prob, noise_corr=self.noise_corr)

    @property
    def current_comm_prob(self) -> float | None:
        """:math:`p_c` of the current run: the user's, or the one the warm-up chose (before set-up, the
        user's: ``None`` when automatic)."""
        return self.comm_prob if self.algorithm is None else self.algorithm.comm_prob
