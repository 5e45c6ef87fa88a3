"""Small Pyro models shared by the tests."""

import pyro
import pyro.distributions as dist
import torch


def logistic_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


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


def regression_data(num_data=40, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, dim, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, dim) + 0.5 * torch.randn(num_data, generator=g)
    return x, y


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
