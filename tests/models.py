"""Small Pyro models shared by the tests."""

import pyro
import pyro.distributions as dist
import torch

from pyro_fed.testing import GaussianClients, regression_clients


def logistic_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


def logistic_model_for_nuts(x, y=None):
    """:func:`logistic_model` as a NUTS user writes it: the logits computed at full size before the plate,
    ``obs=y`` at full size inside it."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    logits = x @ w
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def scaled_regression(x, y=None):
    """Linear regression with a constrained (HalfNormal) noise scale: transforms and Jacobians count."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ w, sigma), obs=y[idx])


def gaussian_regression(noise_sd, validate_args=None):
    """Conjugate linear-Gaussian regression with prior N(0, I): the posterior is Gaussian. With
    ``validate_args=True`` its likelihood refuses a NaN location (raises), as validating distributions
    do."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample(
                "y",
                dist.Normal(pyro.subsample(x, event_dim=1) @ w, noise_sd, validate_args=validate_args),
                obs=pyro.subsample(y, event_dim=0),
            )

    return model


def gaussian_regression_for_nuts(noise_sd):
    """:func:`gaussian_regression` as a NUTS user writes it (the mean at full size, ``obs=y``)."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        mean = x @ w
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(mean, noise_sd), obs=y)

    return model


def regression_data(num_data=40, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, dim, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, dim) + 0.5 * torch.randn(num_data, generator=g)
    return x, y


def sorted_regression(num_data=40, num_clients=4, noise_sd=0.5):
    """:func:`regression_data` split as sites whose data differ: the points sorted by their first feature
    and cut into ``num_clients`` contiguous ranges, so that the clients' curvatures and posteriors differ.
    Returns the features, the responses, the client of each point and the exact client potentials of
    :func:`gaussian_regression` (``noise_sd``, prior N(0, I)) with the default proportional prior split."""
    x, y = regression_data(num_data)
    clients = torch.empty(num_data, dtype=torch.long)
    clients[x[:, 0].argsort()] = torch.arange(num_data) * num_clients // num_data
    exact = regression_clients(x, y, clients, noise_sd, prior_weights=torch.bincount(clients) / num_data)
    return x, y, clients, exact


def preconditioned(clients: GaussianClients, preconditioner: torch.Tensor):
    r"""``clients`` in the coordinates :math:`z = R^{-1} x` of a preconditioner :math:`M = R R^\top` (its
    diagonal ``[d]`` or the matrix ``[d, d]``; :math:`R` its symmetric root), where the exact laws (which
    know no preconditioner) are those of the preconditioned samplers; and :math:`R`, which maps a law's
    mean and covariance back (:math:`R m`, :math:`R \Sigma R^\top`)."""
    matrix = torch.diag(preconditioner) if preconditioner.dim() == 1 else preconditioner
    values, vectors = torch.linalg.eigh(matrix.to(clients.precisions.dtype))
    root = vectors @ torch.diag(values.sqrt()) @ vectors.T
    whitened = GaussianClients(root @ clients.precisions @ root, torch.linalg.solve(root, clients.means.T).T)
    return whitened, root


def hierarchical_regression(group, x, y=None, num_groups=4):
    """Group intercepts drawn around a common mean with a scale ``tau`` (centred), and a common slope: a
    hierarchical model whose clients, one per group, differ in their data and in where their potential in
    ``tau`` is curved."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(2.0))
    slope = pyro.sample("slope", dist.Normal(0.0, 5.0))
    with pyro.plate("groups", num_groups):
        intercept = pyro.sample("intercept", dist.Normal(mu, tau))
    with pyro.plate("data", group.shape[0]):
        mean = intercept[pyro.subsample(group, event_dim=0)] + slope * pyro.subsample(x, event_dim=0)
        pyro.sample("y", dist.Normal(mean, 1.0), obs=pyro.subsample(y, event_dim=0))


def hierarchical_data(points_per_group=20, num_groups=4, seed=0):
    """Data of :func:`hierarchical_regression` whose groups differ: group ``g``'s intercept is ``2g - 3``
    and its feature is centred at ``g`` (so the slope is learnt from different ranges). Returns the group of
    each point, the features and the responses."""
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(points_per_group * num_groups) // points_per_group
    x = group + torch.randn(len(group), generator=g)
    y = 2.0 * group - 3.0 + 0.5 * x + torch.randn(len(group), generator=g)
    return group, x, y


def logistic_data(num_data=40, dim=3, seed=0):
    """:func:`regression_data`'s features with its responses' signs as 0/1 labels (a Bernoulli's support)."""
    x, y = regression_data(num_data, dim, seed)
    return x, (y > 0).to(x.dtype)


def lkj_normal(y):
    """A multivariate normal with an LKJCholesky correlation prior: TorchInductor cannot compile its
    potential (the correlation's transform has a data-dependent shape), so every compiled function falls
    back."""
    dim = y.shape[1]
    mean = pyro.sample("mean", dist.Normal(0.0, 5.0).expand([dim]).to_event(1))
    scales = pyro.sample("scales", dist.HalfNormal(2.0).expand([dim]).to_event(1))
    cholesky = pyro.sample("cholesky", dist.LKJCholesky(dim, 2.0))
    with pyro.plate("data", y.shape[0]) as idx:
        pyro.sample("y", dist.MultivariateNormal(mean, scale_tril=scales[:, None] * cholesky), obs=y[idx])
