r"""Consensus Monte Carlo: every client samples its own sub-posterior, once; the server merges the draws.

With ``b`` clients, client ``i`` holding the data :math:`y_{(i)}` (``N_i`` points of the data plate) and a
share :math:`\varpi_i` of the prior (:math:`\sum_i \varpi_i = 1`; by default :math:`\varpi_i = N_i / N`, as
pyro_fed's kernels split it), the posterior factors into the clients' *sub-posteriors*

.. math::

    \pi(\theta) \propto \prod_{i=1}^b \pi_i(\theta), \qquad
    \pi_i(\theta) \propto p(\theta)^{\varpi_i} \prod_{j \in \text{client } i} p(y_j \mid \theta).

Each client draws :math:`\theta_{i,1}, \dots, \theta_{i,S}` from its own :math:`\pi_i` with any MCMC
sampler (Pyro's NUTS by default), independently of the others, and uploads them once. The server merges the
:math:`s`-th draws of all clients by consensus weighting, on the unconstrained scale
:math:`u = T^{-1}(\theta)` of the latent sites (:mod:`pyro_fed.model.unconstrained`):

.. math::

    u_s = \Big(\sum_{i=1}^b W_i\Big)^{-1} \sum_{i=1}^b W_i\, u_{i,s}, \qquad
    W_i = \widehat{\Sigma}_i^{-1},

with :math:`\widehat\Sigma_i` the sample covariance of client ``i``'s draws, and returns the constrained
draws :math:`\theta_s = T(u_s)`. When every sub-posterior is Gaussian, :math:`N(\mu_i, \Sigma_i)`, the merge
with :math:`W_i = \Sigma_i^{-1}` turns independent draws of the sub-posteriors into exact draws of their
product, :math:`N(A^{-1} \sum_i W_i \mu_i, A^{-1})` with :math:`A = \sum_i W_i`: the posterior.

**On the unconstrained scale.** The merge is exact when the sub-posteriors are Gaussian *in* :math:`u`, so
each client's sub-model is the density of :math:`u` whose product over the clients is the posterior density
of :math:`u`: the prior's share :math:`\varpi_i` takes the log-det-Jacobian of :math:`T` along,

.. math::

    \log \pi_i^u(u) = \varpi_i \big(\log p(T(u)) + \log |\det \partial T(u) / \partial u|\big)
    + \sum_{j \in \text{client } i} \log p(y_j \mid T(u)) + \text{const},

which is exactly the client potential :math:`-U^i` of pyro_fed's kernels
(:class:`~pyro_fed.FederatedPotential`).
(Sub-posteriors :math:`p(\theta)^{\varpi_i} L_i(\theta)` each carrying the whole Jacobian, as a sampler of
the constrained density gives them, would multiply to the posterior times :math:`|\det \partial T|^{b-1}`.)
Unconstrained sites have no Jacobian: their sub-posterior is :math:`p(\theta)^{\varpi_i} L_i(\theta)` as
written. An improper flat prior (:class:`~pyro.distributions.ImproperUniform`) stays flat in every
sub-posterior.

**Cost.** One upload per client, its draws: :math:`S \times d` floats per chain (:math:`32 S d` bits), and no
other message; each client runs a whole MCMC on its own data (gradients of :math:`N_i` data, not :math:`N`).
The server's merge costs :math:`O(b\, d^3 + b\, S\, d^2)`.

**When it is biased.** The merge is exact for Gaussian sub-posteriors only. A sub-posterior far from Gaussian
— few data per client, a skewed or multimodal likelihood, a weak prior share :math:`\varpi_i` that leaves
a client's sub-posterior heavy-tailed or barely proper — biases the draws, and the bias does not shrink
with more draws; it shrinks as each client's data grow (the Bernstein–von Mises regime). The weights'
sampling error adds a Monte Carlo error of the order of that of the draws' means (a few times
:math:`1/\sqrt{\mathrm{ESS}}`). Compare with a federated kernel (:class:`~pyro_fed.FaldKernel`...) when
clients hold few data.

**Reference:** Scott, Blocker, Bonassi, Chipman, George, McCulloch, *Bayes and big data: the consensus Monte
Carlo algorithm*, International Journal of Management Science and Engineering Management 11(2), 2016.

Example: a Bayesian linear regression, its data split over 2 clients, each sampled by NUTS.

    >>> import pyro, pyro.distributions as dist, torch
    >>> import pyro_fed.consensus as consensus
    >>> def model(x, y):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    ...     mean = x @ w
    ...     with pyro.plate("data", x.shape[0]):
    ...         pyro.sample("y", dist.Normal(mean, 0.5), obs=y)
    >>> pyro.set_rng_seed(0)
    >>> x = torch.randn(200, 2)
    >>> y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(200)
    >>> result = consensus.sample(model, 2, x, y, num_samples=50, warmup_steps=100)
    >>> result.samples["w"].shape
    torch.Size([50, 2])
    >>> result.uploaded_bits  # 2 clients x 50 draws x 2 floats x 32 bits
    6400
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS
from pyro.infer.autoguide.initialization import init_to_median, init_to_uniform
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.util import site_is_subsample
from torch.distributions import biject_to
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from .data.partition import to_index_lists
from .model import predictive
from .model.gradients import make_prior_weights
from .model.sites import ModelSites, full_size_plate, is_random_variable, sampling_free
from .model.unconstrained import UnconstrainedSpace
from .network.base import BITS_PER_FLOAT

__all__ = ["ClientModel", "ConsensusResult", "JACOBIAN_SITE", "client_models", "merge", "sample"]

#: the name of the factor that gives a client's sub-model its share of the log-det-Jacobian (see
#: :class:`ClientModel`)
JACOBIAN_SITE = "_consensus_jacobian"


def _is_identity(transform: torch.distributions.Transform) -> bool:
    """Whether ``transform`` is the identity (``biject_to`` of ``real`` and ``real_vector``): no Jacobian."""
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return isinstance(transform, ComposeTransform) and not transform.parts


class _ClientRestriction(Messenger):
    """While the user's model runs: its data plate of ``N`` points becomes client ``i``'s plate of ``N_i``
    points, whose index ``k`` reads datum ``indices[k]``; its likelihood counts each datum once; its other
    sites (the prior, global observed sites and factors) are scaled by ``prior_weight``; and the constrained
    values of the ``latent`` sites are recorded (for :meth:`log_abs_det_jacobian`)."""

    def __init__(self, plate: str, indices: torch.Tensor, prior_weight: float, latent, full, positions: bool):
        super().__init__()
        self.plate, self.indices = plate, indices
        self.prior_weight = prior_weight
        self.latent = set(latent)
        #: whether the user's plate is declared with ``subsample_size`` equal to its size (a full plate)
        self.full = full
        #: whether the plate's index ``k`` reads row ``k`` of the data arguments (already the client's rows:
        #: a model that reads its data at full size), rather than datum ``indices[k]``
        self.positions = positions
        #: the plate's size as the model declares it (``N``, or ``N_i`` for one sized from the client's rows)
        self.declared = len(indices)
        self.values: dict[str, tuple[torch.Tensor, torch.distributions.constraints.Constraint]] = {}

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg):
            if msg["name"] == self.plate:
                # the plate's size as the sampler sees it: N_i (a sampler injecting indices draws them in
                # 0..N_i-1; NUTS takes them all); the indices are mapped to the client's data afterwards
                size, self.declared = len(self.indices), msg["fn"].size
                msg["fn"] = _Subsample(size, size if self.full else None, device=msg["fn"].device)
            return
        if not is_random_variable(msg):
            return
        if any(frame.name == self.plate for frame in msg["cond_indep_stack"]):
            # Pyro's plate scales by its declared size over the subsample's: N_i / declared makes it
            # N_i / (subsample size), i.e. 1 per datum when the sampler takes the client's whole plate
            msg["scale"] = msg["scale"] * (len(self.indices) / self.declared)
        else:
            msg["scale"] = msg["scale"] * self.prior_weight

    def _pyro_post_sample(self, msg) -> None:
        if site_is_subsample(msg) and msg["name"] == self.plate:
            if not self.positions:
                msg["value"] = self.indices.to(msg["value"].device)[msg["value"]]
        elif msg["name"] in self.latent:  # observed too: samplers condition the latent sites on their values
            self.values[msg["name"]] = (msg["value"], msg["fn"].support)

    def log_abs_det_jacobian(self) -> torch.Tensor | None:
        """:math:`\\log|\\det \\partial T(u) / \\partial u|` at the recorded latent values, summed over the
        sites whose transform is not the identity (``None`` when there is none)."""
        terms = []
        for value, support in self.values.values():
            transform = biject_to(support)
            if not _is_identity(transform):
                terms.append(transform.log_abs_det_jacobian(transform.inv(value), value).sum())
        return sum(terms) if terms else None


class ClientModel:
    r"""Client ``i``'s sub-model: the user's Pyro model restricted to the client's data, whose density on the
    unconstrained scale is the sub-posterior

    .. math::

        \log \pi_i^u(u) = \varpi_i \big(\log p(T(u)) + \log |\det \partial T(u)/\partial u|\big)
        + \sum_{j \in \text{client } i} \log p(y_j \mid T(u)) + \text{const}.

    It is an ordinary Pyro model, called with the user's model's arguments, for any sampler: Pyro's ``NUTS``
    or ``HMC``, or a pyro_fed kernel (which may split the client's data further). Its data plate has the
    client's ``N_i`` points: the plate's index ``k`` (``0 <= k < N_i``) reads the user's datum
    ``indices[k]``, and each datum counts once (Pyro's plate would scale a plate of ``N`` by
    ``N / N_i``). Every site outside the data plate (the latent sites' priors, global observed sites and
    factors) is scaled by :math:`\varpi_i` (``pyro.poutine.scale``'s rule: a log-density times
    :math:`\varpi_i`); for latent sites with a constrained support, a factor :data:`JACOBIAN_SITE` adds
    :math:`(\varpi_i - 1) \log |\det \partial T / \partial u|`, so that a sampler of the unconstrained
    density, which adds the whole Jacobian, samples :math:`\pi_i^u` (see :mod:`pyro_fed.consensus`).

    :param model: the user's model (a data plate declared at full size; see :func:`sample`).
    :param sites: the model's sites (:class:`~pyro_fed.model.sites.ModelSites`).
    :param torch.Tensor indices: the client's data indices in the plate, ``[N_i]``.
    :param float prior_weight: :math:`\varpi_i \ge 0`.
    """

    def __init__(self, model: Callable, sites: ModelSites, indices: torch.Tensor, prior_weight: float):
        self.model, self.sites = model, sites
        self.indices = indices
        self.prior_weight = float(prior_weight)

    @property
    def num_data(self) -> int:
        """The client's number of data ``N_i``."""
        return len(self.indices)

    @property
    def max_plate_nesting(self) -> int:
        """The model's deepest nesting of vectorised plates, read from the run that read the model: pass it
        to ``NUTS(sub_model, max_plate_nesting=...)``, which would otherwise guess it by sampling the model
        once, which an improper prior (:class:`~pyro.distributions.ImproperUniform`) cannot do."""
        dims = [
            frame.dim
            for site in self.sites.initial_trace.nodes.values()
            if site["type"] == "sample"
            for frame in site["cond_indep_stack"]
            if frame.vectorized
        ]
        return -min(dims) if dims else 0

    def arguments(self, *args, **kwargs) -> tuple[tuple, dict]:
        """The arguments to run this sub-model with, from the user's model's: the client's rows of the data
        arguments for a model that reads its data at full size (a model written for NUTS; see
        :mod:`pyro_fed.model.rows`), which a pyro_fed kernel then splits further; the same arguments for one
        that reads them through the plate's indices. (Called with the whole data, the sub-model takes its
        rows itself: a sampler that does not split the data further, as NUTS, can be given either.)"""
        rows = self.sites.rows
        if rows is not None and rows.holds_all_rows(args, kwargs):
            return rows.select(args, kwargs, self.indices)
        return args, kwargs

    def __call__(self, *args, **kwargs):
        args, kwargs = self.arguments(*args, **kwargs)
        restriction = _ClientRestriction(
            self.sites.plate,
            self.indices,
            self.prior_weight,
            self.sites.latent_names,
            self.sites.full_size_subsample,
            positions=self.sites.rows is not None,
        )
        # a plate declared with subsample_size = N would refuse the client's N_i indices
        full = (
            full_size_plate(self.sites.plate) if self.sites.full_size_subsample else contextlib.nullcontext()
        )
        with full, restriction:
            result = self.model(*args, **kwargs)
        log_det = restriction.log_abs_det_jacobian()
        if log_det is not None and self.prior_weight != 1.0:
            pyro.factor(JACOBIAN_SITE, (self.prior_weight - 1.0) * log_det)
        return result

    def __repr__(self) -> str:
        name = getattr(self.model, "__name__", type(self.model).__name__)
        return f"ClientModel({name}, {self.num_data} data, prior_weight={self.prior_weight:.4g})"


def _read_model(model: Callable, model_args: tuple, model_kwargs: dict, plate: str | None) -> ModelSites:
    if not callable(model):
        raise TypeError(f"model must be a Pyro model (a callable); got {type(model).__name__}.")
    return ModelSites(model, model_args, model_kwargs, plate=plate, init_strategy=init_to_median)


def client_models(
    model: Callable,
    clients,
    *model_args,
    prior_weights: str | torch.Tensor = "proportional",
    plate: str | None = None,
    **model_kwargs,
) -> list[ClientModel]:
    r"""Every client's sub-model (:class:`ClientModel`) of ``model``, to sample each sub-posterior
    yourself (then merge the draws with :func:`merge`).

    :param model: a Pyro model whose likelihood is a plate over data, declared at full size, its latent
        sites outside it: as written for NUTS (its data as arguments, read at full size), or reading its data
        through the plate's indices (``pyro.subsample(x, event_dim=...)``).
    :param clients: a number of clients ``b`` (an i.i.d. split of the data, seed 0), a LongTensor of length
        ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index tensors (see
        :mod:`pyro_fed.data.partition`).
    :param model_args: the model's positional arguments.
    :param prior_weights: :math:`\varpi_i`: ``"proportional"`` (``N_i/N``), ``"uniform"`` (``1/b``) or a
        tensor of ``b`` non-negative weights summing to one.
    :param str plate: the data plate's name, when the model has several plates with observed sites.
    :param model_kwargs: the model's keyword arguments.
    """
    sites = _read_model(model, model_args, model_kwargs, plate)
    return _client_models(model, sites, clients, prior_weights)


def _client_models(model, sites: ModelSites, clients, prior_weights) -> list[ClientModel]:
    if sites.row_latents:
        raise ValueError(
            f"The model has a parameter per data point ({', '.join(sites.row_latents)}) sized from its data "
            "arguments: each client's sub-model would have its own parameters, and their draws could not "
            "be merged. Size it from a number passed to the model, and read it and the data through the "
            f"plate's indices (`with pyro.plate({sites.plate!r}, N) as idx: theta[idx]`, pyro.subsample)."
        )
    indices = to_index_lists(clients, sites.num_data)
    if isinstance(prior_weights, str) and prior_weights == "server":
        raise ValueError(
            "prior_weights='server': consensus Monte Carlo has no server sampler to hold the prior. Split it "
            "among the clients: 'proportional', 'uniform' or a tensor of weights summing to 1."
        )
    sizes = torch.tensor([len(ix) for ix in indices])
    weights = make_prior_weights(prior_weights, sizes, torch.float64).tolist()
    return [ClientModel(model, sites, ix, w) for ix, w in zip(indices, weights, strict=True)]


# ------------------------------------------------------------------ the merge
def sample_covariances(client_draws: torch.Tensor, names: Sequence[str] | None = None) -> torch.Tensor:
    """The sample covariance of each client's draws, ``[b, d, d]``, from draws ``[b, ..., d]`` (all the
    leading dimensions after the client's — chains, draws — pooled). Refuses fewer than ``d + 1`` draws per
    client: below that the covariance is singular.

    :param names: a name per coordinate, for the errors (default ``x[0]``, ``x[1]``...).
    """
    if client_draws.dim() < 3:
        raise ValueError(
            f"client_draws must have shape [clients, ..., draws, d] (at least 3 dimensions); got shape "
            f"{tuple(client_draws.shape)}."
        )
    b, d = client_draws.shape[0], client_draws.shape[-1]
    flat = client_draws.reshape(b, -1, d)
    m = flat.shape[1]
    if m < d + 1:
        raise ValueError(
            f"Each client has {m} draws of {d} unconstrained coordinates: the sample covariance that weighs "
            f"a client's draws needs at least d + 1 = {d + 1} draws to be invertible (and many more to be "
            "precise: its relative error is about sqrt(d / ESS)). Draw more (num_samples, num_chains)."
        )
    centred = flat - flat.mean(1, keepdim=True)
    return centred.transpose(1, 2) @ centred / (m - 1)


def _consensus_weights(covariances: torch.Tensor, jitter: float, names: Sequence[str] | None) -> torch.Tensor:
    """:math:`W_i = (\\hat\\Sigma_i + \\text{jitter}\\, I)^{-1}`, ``[b, d, d]``, refusing a singular one
    with the client and the coordinates at fault."""
    d = covariances.shape[-1]
    names = list(names) if names is not None else [f"x[{j}]" for j in range(d)]
    eye = torch.eye(d, dtype=covariances.dtype, device=covariances.device)
    regularised = covariances + jitter * eye
    cholesky, info = torch.linalg.cholesky_ex(regularised)
    if bool((info != 0).any()):
        client = int((info != 0).nonzero()[0])
        variances = regularised[client].diagonal()
        flat = [names[j] for j in (variances <= 0).nonzero().flatten().tolist()]
        cause = (
            f"the coordinates {flat} do not move in its draws (zero variance: a stuck chain, or a site the "
            "sampler does not sample)"
            if flat
            else "some linear combination of its coordinates does not move in its draws (collinear "
            "coordinates, or too few distinct draws)"
        )
        raise ValueError(
            f"The sample covariance of client {client}'s draws is singular: {cause}. Check that client's "
            "chain (mcmc.summary()), draw more, or pass jitter > 0 (added to every client's covariance, in "
            "unconstrained units) to regularise the weights."
        )
    return torch.cholesky_inverse(cholesky)


def merge(
    client_draws: torch.Tensor | Sequence[torch.Tensor],
    *,
    jitter: float = 0.0,
    names: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Consensus weighting of the clients' draws (Scott et al. 2016, Section 2):

    .. math::

        u_s = \Big(\sum_{i=1}^b W_i\Big)^{-1} \sum_{i=1}^b W_i\, u_{i,s}, \qquad
        W_i = (\widehat\Sigma_i + \text{jitter}\, I)^{-1},

    with :math:`\widehat\Sigma_i` the sample covariance of all of client ``i``'s draws. Exact (up to the
    weights' sampling error) when the sub-posteriors are Gaussian.

    :param client_draws: ``[b, ..., S, d]`` (or a sequence of ``b`` tensors ``[..., S, d]`` of one shape):
        client ``i``'s draws on the unconstrained scale, a leading chain dimension allowed; the ``s``-th draws
        of the clients (in each chain) are merged together.
    :param float jitter: added to the diagonal of every sample covariance before its inversion (default 0:
        a singular covariance is refused, naming the client and the coordinates).
    :param names: a name per coordinate, for the errors.
    :returns: the merged draws ``[..., S, d]`` and the weights :math:`W_i`, ``[b, d, d]``.
    """
    if not isinstance(client_draws, torch.Tensor):
        shapes = {tuple(t.shape) for t in client_draws}
        if len(shapes) != 1:
            raise ValueError(
                "The clients' draws must all have one shape [..., S, d] to be merged draw by draw; got "
                f"shapes {sorted(shapes)}. Run every client with the same num_samples and num_chains."
            )
        client_draws = torch.stack(list(client_draws))
    if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not jitter >= 0:
        raise ValueError(f"jitter must be a number >= 0; got {jitter!r}.")
    weights = _consensus_weights(sample_covariances(client_draws, names), float(jitter), names)
    b, d = client_draws.shape[0], client_draws.shape[-1]
    # sum_i W_i u_{i,s}, [..., d], with W_i symmetric
    weighted = torch.einsum("bij,b...j->...i", weights, client_draws)
    precision = weights.sum(0)
    merged = torch.linalg.solve(precision, weighted.reshape(-1, d).T).T
    return merged.reshape(client_draws.shape[1:]), weights.reshape(b, d, d)


# ------------------------------------------------------------------ the run
@dataclass
class ConsensusResult:
    """The outcome of :func:`sample`.

    ``samples``: the consensus draws, constrained, ``{site: [C * S, ...]}`` (Pyro's ``get_samples()``
    layout; :meth:`get_samples` gives them by chain); ``client_samples``: each client's sub-posterior draws
    in the same layout; ``client_runs``: each client's :class:`~pyro.infer.MCMC` object (for
    ``mcmc.summary()``, diagnostics); ``weights``: the consensus weights :math:`W_i` ``[b, d, d]``;
    ``prior_weights``: :math:`\\varpi_i`; ``client_indices``: each client's data indices;
    ``uploaded_bits``: the bits the clients upload, all together (:math:`b\\, C\\, S\\, d \\times 32`: their
    draws, once).
    """

    samples: dict[str, torch.Tensor]
    client_samples: list[dict[str, torch.Tensor]]
    client_runs: list[MCMC]
    weights: torch.Tensor
    prior_weights: torch.Tensor
    client_indices: list[torch.Tensor]
    uploaded_bits: int
    num_chains: int
    sites: ModelSites = field(repr=False)
    space: UnconstrainedSpace = field(repr=False)

    def get_samples(self, group_by_chain: bool = False) -> dict[str, torch.Tensor]:
        """The consensus draws, ``{site: [C * S, ...]}`` or ``{site: [C, S, ...]}`` by chain."""
        if not group_by_chain:
            return dict(self.samples)
        return {k: v.reshape(self.num_chains, -1, *v.shape[1:]) for k, v in self.samples.items()}

    def to_inference_data(self, *, log_likelihood: bool = True, chunk_size: int | None = None):
        """The consensus draws as ArviZ data: ``posterior`` (the consensus draws), ``sub_posteriors`` (each
        client's draws, dims ``chain, draw, client, ...``), ``log_likelihood`` (pointwise, at the consensus
        draws, on all data: for ``az.loo``; the plate's dimension named after it) and ``observed_data``.

        :param bool log_likelihood: include the pointwise log-likelihood.
        :param int chunk_size: draws evaluated at once for the log-likelihood.
        :returns: :class:`arviz.InferenceData` (ArviZ 0.x) or :class:`xarray.DataTree` (ArviZ 1.x).
        """
        # ArviZ and xarray take seconds to import: not with pyro_fed
        import arviz as az
        import xarray as xr

        by_chain = self.get_samples(group_by_chain=True)
        groups = {"posterior": {k: v.detach().cpu().numpy() for k, v in by_chain.items()}}
        factors = [n for n in self.sites.likelihood_sites if _is_factor(self.sites, n)]
        if log_likelihood:
            pointwise = predictive.pointwise_log_likelihood(self.sites, self.samples, chunk_size)
            groups["log_likelihood"] = {
                k: v.reshape(self.num_chains, -1, *v.shape[1:]).cpu().numpy() for k, v in pointwise.items()
            }
        observed = predictive.observed_data(self.sites)
        groups["observed_data"] = {k: v.cpu().numpy() for k, v in observed.items() if k not in factors}
        dims = {}
        for name in self.sites.likelihood_sites:
            axis = self.sites.plate_axis(name)
            if axis is not None:
                dims[name] = [f"{name}_dim_{i}" for i in range(axis)] + [self.sites.plate]
        arviz_1 = int(az.__version__.split(".")[0]) >= 1
        if arviz_1:
            data = az.from_dict(groups, dims=dims)
        else:
            data = az.from_dict(**groups, dims=dims)
        sub = xr.Dataset(
            {
                name: (
                    ("chain", "draw", "client", *(f"{name}_dim_{i}" for i in range(value.dim() - 1))),
                    np.stack(
                        [
                            c[name].reshape(self.num_chains, -1, *value.shape[1:]).cpu().numpy()
                            for c in self.client_samples
                        ],
                        axis=2,
                    ),
                )
                for name, value in self.samples.items()
            }
        )
        if arviz_1:
            data["sub_posteriors"] = xr.DataTree(sub)
        else:
            data.add_groups({"sub_posteriors": sub}, warn_on_custom_groups=False)
        return data


def _is_factor(sites: ModelSites, name: str) -> bool:
    return isinstance(sites.initial_trace.nodes[name]["fn"], dist.Unit)


def _default_kernel(sub_model: ClientModel) -> MCMCKernel:
    # Pyro's init_to_uniform, and its guess of the plates' nesting, sample the prior first, which an improper
    # flat prior cannot do
    return NUTS(
        sub_model,
        init_strategy=sampling_free(init_to_uniform),
        max_plate_nesting=sub_model.max_plate_nesting,
    )


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def sample(
    model: Callable,
    clients,
    *model_args,
    num_samples: int = 1000,
    warmup_steps: int = 500,
    kernel: Callable[[ClientModel], MCMCKernel] | None = None,
    num_chains: int = 1,
    prior_weights: str | torch.Tensor = "proportional",
    plate: str | None = None,
    jitter: float = 0.0,
    progress: bool = False,
    **model_kwargs,
) -> ConsensusResult:
    r"""Consensus Monte Carlo (Scott et al. 2016): each client samples its sub-posterior
    :math:`\pi_i \propto p^{\varpi_i} L_i` with its own MCMC run, independently; the server merges the
    :math:`s`-th draws of all clients on the unconstrained scale,
    :math:`u_s = (\sum_i W_i)^{-1} \sum_i W_i u_{i,s}` with :math:`W_i` the inverse sample covariance of
    client ``i``'s draws (:func:`merge`), and maps them back to the sites' supports. See
    :mod:`pyro_fed.consensus` for the sub-posteriors' exact form, the cost and when the merge is biased.

    The clients run one after another in this process (a simulation of the federation: each sees only its
    own data, and uploads its draws once).

    :param model: a Pyro model whose likelihood is a plate over data, declared at full size, with its latent
        sites outside the plate: as written for NUTS (its data as arguments, read at full size: each client's
        sub-model runs on its rows of them), or reading its data through the plate's indices
        (``pyro.subsample(x, event_dim=...)`` or ``with pyro.plate(...) as idx``).
    :param clients: a number of clients ``b`` (an i.i.d. split of the data, seed 0), a LongTensor of length
        ``N`` with client ids ``0..b-1``, or a sequence of ``b`` index tensors (see
        :mod:`pyro_fed.data.partition`).
    :param model_args: the model's positional arguments.
    :param int num_samples: draws per chain :math:`S` of each client (and of the consensus).
    :param int warmup_steps: warm-up iterations of each client's sampler.
    :param kernel: ``kernel(sub_model) -> MCMCKernel``, the sampler of each client's sub-model
        (:class:`ClientModel`); default Pyro's ``NUTS(sub_model)`` (started uniformly in ``(-2, 2)`` on the
        unconstrained scale, with ``max_plate_nesting=sub_model.max_plate_nesting``: pass it to your own
        ``NUTS`` when the model has an improper prior). A pyro_fed kernel works too, e.g.
        ``lambda sub_model: FaldKernel(sub_model, clients=1)``.
    :param int num_chains: chains per client; the ``s``-th draws of chain ``c`` are merged together (Pyro's
        MCMC runs the chains of its own kernels in parallel processes, pyro_fed's kernels as one batch).
    :param prior_weights: :math:`\varpi_i`: ``"proportional"`` (``N_i/N``, default), ``"uniform"`` (``1/b``)
        or a tensor of ``b`` non-negative weights summing to one.
    :param str plate: the data plate's name, when the model has several plates with observed sites.
    :param float jitter: added to the diagonal of each client's sample covariance before inversion (default
        0: a singular covariance is refused).
    :param bool progress: show each client's progress bar.
    :param model_kwargs: the model's keyword arguments (any name but this function's own).
    :returns: a :class:`ConsensusResult`.
    """
    num_samples = _count("num_samples", num_samples, 1)
    warmup_steps = _count("warmup_steps", warmup_steps, 0)
    num_chains = _count("num_chains", num_chains, 1)
    if isinstance(kernel, MCMCKernel) or (kernel is not None and not callable(kernel)):
        raise TypeError(
            f"kernel must be a function of the client's sub-model returning an MCMC kernel, e.g. "
            f"`lambda sub_model: NUTS(sub_model)` (one kernel per client, each on its own sub-model); got "
            f"{type(kernel).__name__}."
        )
    sites = _read_model(model, model_args, model_kwargs, plate)
    space = UnconstrainedSpace(sites.initial_trace, sites.latent_names)
    if num_samples * num_chains < space.dim + 1:
        raise ValueError(
            f"num_samples={num_samples} x num_chains={num_chains} draws per client are too few for the "
            f"sample covariance of the {space.dim} unconstrained coordinates that weighs a client's draws: "
            f"it needs at least {space.dim + 1} (and many more to be precise). Raise num_samples."
        )
    sub_models = _client_models(model, sites, clients, prior_weights)
    make_kernel = kernel or _default_kernel
    runs, unconstrained, client_samples = [], [], []
    for i, sub_model in enumerate(sub_models):
        client_kernel = make_kernel(sub_model)
        if not isinstance(client_kernel, MCMCKernel):
            raise TypeError(
                "kernel(sub_model) must return a Pyro MCMC kernel (NUTS(sub_model), a pyro_fed kernel...); "
                f"got {type(client_kernel).__name__} for client {i}."
            )
        mcmc = MCMC(
            client_kernel,
            num_samples=num_samples,
            warmup_steps=warmup_steps,
            num_chains=num_chains,
            disable_progbar=not progress,
        )
        client_args, client_kwargs = sub_model.arguments(*model_args, **model_kwargs)
        mcmc.run(*client_args, **client_kwargs)
        draws = mcmc.get_samples(group_by_chain=True)
        missing = [name for name in sites.latent_names if name not in draws]
        if missing:
            raise ValueError(
                f"Client {i}'s sampler returned no draws of the latent sites {missing} (it gave "
                f"{sorted(draws)}): the kernel must sample every latent site of its sub-model."
            )
        values = {name: draws[name] for name in sites.latent_names}
        client_samples.append({k: v.reshape(-1, *v.shape[2:]) for k, v in values.items()})
        transformed = {s.name: s.transform.inv(values[s.name]) for s in space.latent_sites}
        unconstrained.append(space.flatten(transformed))  # [C, S, d]
        runs.append(mcmc)
    merged, weights = merge(unconstrained, jitter=jitter, names=space.coordinate_names)
    params = space.unconstrained_params(merged)
    constrained = {site.name: site.transform(params[site.name]) for site in space.latent_sites}
    samples = {k: v.reshape(-1, *v.shape[2:]) for k, v in constrained.items()}
    return ConsensusResult(
        samples=samples,
        client_samples=client_samples,
        client_runs=runs,
        weights=weights,
        prior_weights=torch.tensor([m.prior_weight for m in sub_models]),
        client_indices=[m.indices for m in sub_models],
        uploaded_bits=len(sub_models) * num_chains * num_samples * space.dim * BITS_PER_FLOAT,
        num_chains=num_chains,
        sites=sites,
        space=space,
    )
