"""Consensus Monte Carlo: the clients' sub-models are exactly their sub-posteriors (log-densities against hand
computations and the exact Gaussian sub-posteriors), the merge is exact on Gaussian draws, and the consensus
draws of NUTS runs on a conjugate Gaussian regression match the exact posterior within Monte Carlo error."""

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import NUTS
from pyro.infer.mcmc.util import initialize_model
from torch.distributions import constraints

import pyro_fed.consensus as consensus
from pyro_fed.kernels.fald import FaldKernel
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.testing import heterogeneous_gaussian_clients, regression_clients

from .models import gaussian_regression, regression_data, scaled_regression

NOISE_SD = 0.5
Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
#: warm-up iterations of the short NUTS runs: Pyro's step-size adaptation needs about 100 (with 20 it often
#: ends with a step so large that the chain sticks, and its draws' covariance is singular)
WARMUP = 100


@pytest.fixture(autouse=True)
def _reproducible():
    pyro.set_rng_seed(0)  # for reproducible runs only: every test holds for any seed


def log_density(model, values, *args):
    """The model's log-density at the constrained ``values`` of its latent sites (every site's log_prob,
    scaled as the model scales it)."""
    return poutine.trace(poutine.condition(model, data=values)).get_trace(*args).log_prob_sum()


def regression_log_likelihood(x, y, w):
    return dist.Normal(x @ w, NOISE_SD).log_prob(y).sum()


def uneven_clients(num_data):
    """Three clients of 1/6, 1/3 and 1/2 of the data, interleaved (the plate's scaling N / N_i differs)."""
    ids = torch.tensor([0, 1, 1, 2, 2, 2]).repeat(num_data // 6)
    return ids, [(ids == i).nonzero().flatten() for i in range(3)]


# ------------------------------------------------------------------ the sub-models
def test_sub_models_are_the_gaussian_clients_sub_posteriors():
    # pyro_fed.testing's GaussianClients model: prior N(0, s^2 I), datum i observed by client i alone. Client
    # i's sub-model has log-density (1/b) log N(x; 0, s^2 I) + log N(mu_i; x, Sigma_i): checked against that
    # hand computation, and its differences against the exact Gaussian sub-posterior (precision A_i).
    prior_sd, b = 3.0, 4
    clients = heterogeneous_gaussian_clients(b, 2, mean_scale=2.0)
    model, args = clients.pyro_model(prior_sd)
    sub_models = consensus.client_models(model, [torch.tensor([i]) for i in range(b)], *args)
    exact = clients.with_prior(prior_sd, torch.full((b,), 1.0 / b))
    g = torch.Generator().manual_seed(1)
    points = torch.randn(2, 2, generator=g)
    for i, sub_model in enumerate(sub_models):
        assert sub_model.prior_weight == pytest.approx(1.0 / b)
        for x in points:
            prior = dist.Normal(0.0, prior_sd).log_prob(x).sum()
            likelihood = dist.MultivariateNormal(x, precision_matrix=clients.precisions[i]).log_prob(
                clients.means[i]
            )
            torch.testing.assert_close(log_density(sub_model, {"x": x}, *args), prior / b + likelihood)
        difference = log_density(sub_model, {"x": points[0]}, *args) - log_density(
            sub_model, {"x": points[1]}, *args
        )

        def potential(x, i=i):
            return 0.5 * (x - exact.means[i]) @ exact.precisions[i] @ (x - exact.means[i])

        torch.testing.assert_close(difference, potential(points[1]) - potential(points[0]))


@pytest.mark.parametrize("full_plate", [False, True], ids=["plate", "plate_with_subsample_size_N"])
def test_sub_model_counts_each_datum_of_its_client_once(full_plate):
    # clients of 10, 20 and 30 data out of N = 60: Pyro's plate would scale the client's likelihood by
    # N / N_i; the sub-model counts each datum once, and its prior by N_i / N. A plate declared with
    # subsample_size = N (a full plate) reads the client's indices too.
    x, y = regression_data(60, 2)
    ids, indices = uneven_clients(60)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", 60, subsample_size=60 if full_plate else None):
            mean = pyro.subsample(x, event_dim=1) @ w
            pyro.sample("y", dist.Normal(mean, NOISE_SD), obs=pyro.subsample(y, event_dim=0))

    w = torch.tensor([0.3, -0.7])
    for sub_model, index in zip(consensus.client_models(model, ids, x, y), indices, strict=True):
        expected = len(index) / 60 * dist.Normal(0.0, 1.0).log_prob(w).sum()
        expected = expected + regression_log_likelihood(x[index], y[index], w)
        torch.testing.assert_close(log_density(sub_model, {"w": w}, x, y), expected)


def test_a_pyro_fed_potential_of_a_sub_model_is_its_sub_posterior():
    # a pyro_fed kernel samples the sub-model through FederatedPotential, which injects its own indices into
    # the client's plate (0..N_i - 1, here split over two sub-clients, evaluated at once with vmap): its
    # potential is the exact Gaussian sub-posterior's, up to a constant
    x, y = regression_data(60, 2)
    ids, _ = uneven_clients(60)
    exact = regression_clients(x, y, ids, NOISE_SD, torch.bincount(ids) / 60.0)
    sub_models = consensus.client_models(gaussian_regression(NOISE_SD), ids, x, y)
    g = torch.Generator().manual_seed(2)
    points = torch.randn(3, 2, generator=g)
    for i, sub_model in enumerate(sub_models):
        potential = FederatedPotential(sub_model, (x, y), clients=2, gradient_mode="eager")
        assert potential.num_data == sub_model.num_data
        values = torch.stack([potential.potential(p) for p in points])
        quadratic = torch.stack(
            [0.5 * (p - exact.means[i]) @ exact.precisions[i] @ (p - exact.means[i]) for p in points]
        )
        torch.testing.assert_close(values - values[0], quadratic - quadratic[0])
        gradients = torch.stack([potential.total_gradient(p[None])[0] for p in points])
        torch.testing.assert_close(gradients, (points - exact.means[i]) @ exact.precisions[i])


def test_constrained_sites_share_the_jacobian_and_the_sub_posteriors_multiply_to_the_posterior():
    # scaled_regression: w ~ N(0, I), sigma ~ HalfNormal(1), u = log sigma. Each sub-model's potential on the
    # unconstrained scale, as NUTS sees it, is -[varpi_i (log p(w) + log p(sigma) + log sigma) + log L_i];
    # the clients' potentials sum to the posterior's potential exactly (the consensus identity on u).
    x, y = regression_data(60, 2)
    ids, indices = uneven_clients(60)
    sub_models = consensus.client_models(scaled_regression, ids, x, y)
    full = initialize_model(scaled_regression, (x, y))[1]
    potentials = [initialize_model(sub_model, (x, y))[1] for sub_model in sub_models]
    for w, log_sigma in [
        (torch.tensor([0.3, -0.7]), torch.tensor(-0.4)),
        (torch.zeros(2), torch.tensor(0.8)),
    ]:
        params = {"w": w, "sigma": log_sigma}
        sigma = log_sigma.exp()
        total = 0.0
        for index, potential in zip(indices, potentials, strict=True):
            weight = len(index) / 60
            prior = dist.Normal(0.0, 1.0).log_prob(w).sum() + dist.HalfNormal(1.0).log_prob(sigma)
            likelihood = dist.Normal(x[index] @ w, sigma).log_prob(y[index]).sum()
            expected = -(weight * (prior + log_sigma) + likelihood)
            torch.testing.assert_close(potential(params), expected)
            total = total + potential(params)
        torch.testing.assert_close(total, full(params))


def test_flat_prior_stays_flat_in_every_sub_posterior():
    # w ~ ImproperUniform (log-density 0): a client's sub-posterior is its likelihood alone, whatever its
    # prior weight; NUTS starts it from the unconstrained box (an improper prior cannot be sampled)
    x, y = regression_data(30, 2)

    def model(x, y):
        w = pyro.sample("w", dist.ImproperUniform(constraints.real, (), (2,)))
        with pyro.plate("data", x.shape[0]):
            mean = pyro.subsample(x, event_dim=1) @ w
            pyro.sample("y", dist.Normal(mean, NOISE_SD), obs=pyro.subsample(y, event_dim=0))

    ids = torch.arange(30) % 2
    w = torch.tensor([0.2, 0.5])
    for i, sub_model in enumerate(consensus.client_models(model, ids, x, y)):
        index = (ids == i).nonzero().flatten()
        torch.testing.assert_close(
            log_density(sub_model, {"w": w}, x, y), regression_log_likelihood(x[index], y[index], w)
        )
    result = consensus.sample(model, ids, x, y, num_samples=20, warmup_steps=WARMUP)
    assert result.samples["w"].shape == (20, 2) and bool(result.samples["w"].isfinite().all())


# ------------------------------------------------------------------ the merge
def gaussian_sub_posteriors(num_clients=3, dim=3, seed=0):
    """Heterogeneous Gaussian sub-posteriors N(mu_i, Sigma_i): means ``[b, d]``, covariances ``[b, d, d]``."""
    clients = heterogeneous_gaussian_clients(num_clients, dim + dim % 2, mean_scale=1.0, seed=seed)
    covariances = torch.linalg.inv(clients.precisions)[:, :dim, :dim]
    return clients.means[:, :dim], covariances


def product(means, covariances):
    """Mean and covariance of the normalised product of the Gaussians N(mu_i, Sigma_i)."""
    precisions = torch.linalg.inv(covariances)
    covariance = torch.linalg.inv(precisions.sum(0))
    return covariance @ (precisions @ means[..., None]).sum(0)[:, 0], covariance


def test_merge_is_exact_on_draws_with_exact_moments():
    # draws whose sample means are mu_i and sample covariances Sigma_i exactly, and whose cross-client
    # sample covariances are 0 (jointly whitened normals): the consensus draws then have the sample mean and
    # covariance of the product of the Gaussians exactly, whatever their number
    means, covariances = gaussian_sub_posteriors()
    b, d, s = means.shape[0], means.shape[1], 50
    g = torch.Generator().manual_seed(3)
    normals = torch.randn(s, b * d, generator=g)
    normals = normals - normals.mean(0)
    whitening = torch.linalg.cholesky(normals.T @ normals / (s - 1))
    normals = torch.linalg.solve_triangular(whitening, normals.T, upper=False).T  # sample covariance I
    draws = means[:, None, :] + torch.einsum(
        "bij,sbj->bsi", torch.linalg.cholesky(covariances), normals.reshape(s, b, d)
    )
    merged, weights = consensus.merge(draws)
    mean, covariance = product(means, covariances)
    torch.testing.assert_close(weights, torch.linalg.inv(covariances))
    torch.testing.assert_close(merged.mean(0), mean)
    torch.testing.assert_close(merged.T.cov(), covariance)
    # a list of the clients' draws, with a leading chain dimension, merges the same
    chains, _ = consensus.merge([c.reshape(2, s // 2, d) for c in draws])
    torch.testing.assert_close(chains.reshape(s, d), merged)


def mean_standard_error(means, covariances, n):
    """Standard error of the consensus mean of ``n`` effective draws per client, the weights estimated from
    the same draws. Linearised: the error is A^-1 sum_i W_i (m_i - mu_i) (the clients' means) plus
    A^-1 sum_i dW_i (mu_i - mu) (the weights'), dW_i = -W_i dSigma_i W_i; with Isserlis' theorem
    (Cov(dSigma_ab, dSigma_cd) = (S_ac S_bd + S_ad S_bc) / n) and the sample mean and covariance of
    Gaussian draws uncorrelated, its covariance is A^-1 [A + sum_i (q_i W_i + v_i v_i^T)] A^-1 / n, with
    v_i = W_i (mu_i - mu) and q_i = (mu_i - mu)^T v_i."""
    weights = torch.linalg.inv(covariances)
    mean, covariance = product(means, covariances)
    v = (weights @ (means - mean)[..., None])[..., 0]
    q = ((means - mean) * v).sum(-1)
    middle = weights.sum(0) + (q[:, None, None] * weights + v[:, :, None] * v[:, None, :]).sum(0)
    return ((covariance @ middle @ covariance).diagonal() / n).sqrt()


def covariance_standard_error(covariance, n):
    """Standard error of each entry of the consensus draws' sample covariance: linearised, its error is the
    sample covariance of n effective draws of N(mu, A^-1) (the merged draws with exact weights) less A^-1,
    whose entries have variance (C_aa C_bb + C_ab^2) / n for Gaussian draws (Isserlis' theorem)."""
    diagonal = covariance.diagonal()
    return ((diagonal[:, None] * diagonal[None, :] + covariance**2) / n).sqrt()


def test_merge_of_independent_gaussian_draws_matches_the_product_within_monte_carlo_error():
    means, covariances = gaussian_sub_posteriors()
    s = 4000
    g = torch.Generator().manual_seed(4)
    draws = means[:, None, :] + torch.einsum(
        "bij,bsj->bsi", torch.linalg.cholesky(covariances), torch.randn(3, s, 3, generator=g)
    )
    merged, _ = consensus.merge(draws)
    mean, covariance = product(means, covariances)
    # independent draws: n = S effective draws; Z standard errors (see mean_standard_error)
    assert ((merged.mean(0) - mean).abs() <= Z * mean_standard_error(means, covariances, s)).all()
    assert ((merged.T.cov() - covariance).abs() <= Z * covariance_standard_error(covariance, s)).all()


def test_merge_refuses_too_few_draws_and_a_singular_covariance():
    draws = torch.randn(2, 3, 3)  # 3 draws of 3 coordinates: a sample covariance of rank 2 at most
    with pytest.raises(ValueError, match=r"3 draws of 3 unconstrained coordinates.*at least d \+ 1 = 4"):
        consensus.merge(draws)
    draws = torch.randn(2, 50, 3)
    draws[1, :, 2] = 0.7  # client 1's third coordinate does not move
    with pytest.raises(ValueError, match=r"client 1's draws is singular.*\['b'\].*jitter"):
        consensus.merge(draws, names=["a", "c", "b"])
    merged, weights = consensus.merge(draws, jitter=1e-6)  # the documented regularisation
    assert merged.shape == (50, 3) and bool(weights.isfinite().all())
    with pytest.raises(ValueError, match="one shape"):
        consensus.merge([torch.randn(10, 2), torch.randn(12, 2)])
    with pytest.raises(ValueError, match="jitter must be a number >= 0"):
        consensus.merge(draws, jitter=-1.0)


# ------------------------------------------------------------------ runs
def test_sample_with_nuts_several_constrained_sites_and_arviz():
    x, y = regression_data(60, 2)
    result = consensus.sample(scaled_regression, 2, x, y, num_samples=20, warmup_steps=WARMUP)
    assert result.samples["w"].shape == (20, 2) and result.samples["sigma"].shape == (20,)
    assert bool((result.samples["sigma"] > 0).all())  # merged on log sigma, returned on sigma's support
    assert len(result.client_samples) == 2 and result.client_samples[0]["sigma"].shape == (20,)
    assert result.weights.shape == (2, 3, 3)
    torch.testing.assert_close(result.prior_weights, torch.tensor([0.5, 0.5]))
    # one upload per client: its 20 draws of d = 3 unconstrained coordinates, 32 bits each
    assert result.uploaded_bits == 2 * 20 * 3 * 32
    # the consensus draws are the merge of the clients' draws, on the unconstrained scale
    unconstrained = torch.stack(
        [torch.cat([c["w"], c["sigma"].log()[:, None]], -1) for c in result.client_samples]
    )
    merged, _ = consensus.merge(unconstrained)
    torch.testing.assert_close(result.samples["w"], merged[:, :2])
    torch.testing.assert_close(result.samples["sigma"], merged[:, 2].exp())
    data = result.to_inference_data()
    assert isinstance(data, az.InferenceData)
    assert data.posterior["w"].shape == (1, 20, 2)
    assert data.sub_posteriors["sigma"].dims == ("chain", "draw", "client")
    np.testing.assert_allclose(
        data.sub_posteriors["sigma"].values[0, :, 1], result.client_samples[1]["sigma"]
    )
    assert data.log_likelihood["y"].dims == ("chain", "draw", "data")
    expected = dist.Normal(x @ result.samples["w"].T, result.samples["sigma"]).log_prob(y[:, None]).T
    np.testing.assert_allclose(data.log_likelihood["y"].values[0], expected.numpy())
    np.testing.assert_allclose(data.observed_data["y"].values, y.numpy())


@pytest.mark.filterwarnings(
    "ignore:pyro_fed's end-of-run checks"
)  # a 20-draw run: its R-hat is no concern here
def test_a_pyro_fed_kernel_samples_each_client():
    # FaldKernel on each client's sub-model (its data split over two sub-clients), two chains as one batch:
    # the kernel's potential is the exact Gaussian sub-posterior's, and the draws are merged chain by chain
    x, y = regression_data(60, 2)
    ids = torch.arange(60) % 3
    exact = regression_clients(x, y, ids, NOISE_SD, torch.full((3,), 1.0 / 3))

    def kernel(sub_model):
        return FaldKernel(sub_model, clients=2, step_size=0.002, thinning=2, gradient_mode="eager")

    result = consensus.sample(
        gaussian_regression(NOISE_SD), ids, x, y, num_samples=20, warmup_steps=10, num_chains=2, kernel=kernel
    )
    assert result.samples["w"].shape == (40, 2)
    assert result.get_samples(group_by_chain=True)["w"].shape == (2, 20, 2)
    assert result.uploaded_bits == 3 * 2 * 20 * 2 * 32
    g = torch.Generator().manual_seed(5)
    points = torch.randn(3, 2, generator=g)
    for i, run in enumerate(result.client_runs):
        potential = run.kernel.potential
        values = torch.stack([potential.potential(p) for p in points])
        quadratic = torch.stack(
            [0.5 * (p - exact.means[i]) @ exact.precisions[i] @ (p - exact.means[i]) for p in points]
        )
        torch.testing.assert_close(values - values[0], quadratic - quadratic[0])
    by_chain = torch.stack([c["w"].reshape(2, 20, 2) for c in result.client_samples])
    merged, _ = consensus.merge(by_chain)
    torch.testing.assert_close(result.get_samples(group_by_chain=True)["w"], merged)


def test_sample_refuses_bad_arguments():
    x, y = regression_data(12, 3)
    model = gaussian_regression(NOISE_SD)
    with pytest.raises(ValueError, match=r"num_samples=2 x num_chains=1 .* at least 4"):
        consensus.sample(model, 2, x, y, num_samples=2)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        consensus.sample(model, 2, x, y, num_samples=0)
    with pytest.raises(TypeError, match="kernel must be a function of the client's sub-model"):
        consensus.sample(model, 2, x, y, kernel=NUTS(model))
    with pytest.raises(TypeError, match="must return a Pyro MCMC kernel"):
        consensus.sample(model, 2, x, y, kernel=lambda sub_model: sub_model)
    with pytest.raises(ValueError, match="prior_weights='server'"):
        consensus.sample(model, 2, x, y, prior_weights="server")
    with pytest.raises(ValueError, match="prior_weights must be a tensor of 2"):
        consensus.sample(model, 2, x, y, prior_weights=torch.tensor([0.5, 0.2]))
    with pytest.raises(ValueError, match="clients=13"):
        consensus.sample(model, 13, x, y)
    with pytest.raises(TypeError, match="model must be a Pyro model"):
        consensus.sample("model", 2, x, y)


# ------------------------------------------------------------------ the exact posterior, with NUTS
def effective_draws(draws):
    """The fewest effective draws among the client's coordinates, their squared deviations and their
    cross products (ArviZ's bulk ESS; ``draws`` is ``[C, S, d]``): the ESS of the statistics whose errors make
    the consensus mean's and covariance's (see mean_standard_error)."""
    centred = draws - draws.mean((0, 1))
    d = draws.shape[-1]
    statistics = [draws[..., a] for a in range(d)]
    statistics += [centred[..., a] * centred[..., c] for a in range(d) for c in range(a, d)]
    return min(float(az.ess(s.numpy())) for s in statistics)


@pytest.mark.slow
def test_consensus_of_nuts_matches_the_exact_gaussian_posterior():
    # a conjugate Gaussian regression split over 3 clients: every sub-posterior is Gaussian, so the consensus
    # of exact sub-posterior draws is an exact draw of the posterior, and only Monte Carlo error remains. The
    # clients' NUTS draws are correlated: the standard errors take the fewest effective draws over the
    # clients and over the statistics that make the errors (conservative: every client counts as that one).
    x, y = regression_data(90, 2)
    ids = torch.arange(90) % 3
    result = consensus.sample(gaussian_regression(NOISE_SD), ids, x, y, num_samples=800, warmup_steps=300)
    exact = regression_clients(x, y, ids, NOISE_SD, result.prior_weights)
    mean, covariance = exact.posterior()
    n = min(effective_draws(c["w"][None]) for c in result.client_samples)
    assert n > 100, n  # enough effective draws for the linearised standard errors
    sub_covariances = torch.linalg.inv(exact.precisions)
    draws = result.samples["w"]
    assert ((draws.mean(0) - mean).abs() <= Z * mean_standard_error(exact.means, sub_covariances, n)).all()
    assert ((draws.T.cov() - covariance).abs() <= Z * covariance_standard_error(covariance, n)).all()
