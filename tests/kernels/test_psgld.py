"""PsgldKernel: the update rule by hand, the exact law of its fixed-preconditioner limit (decay 1), the
automatic step's preconditioner, the defaults against the exact posterior, the bits, the warning, errors."""

import math
import re
import warnings

import numpy as np
import pyro
import pytest
import torch

from pyro_fed.algorithms import adaptation, psgld
from pyro_fed.kernels.psgld import MEMORY_WARNING, PsgldKernel
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import (
    GaussianClients,
    Outcome,
    batch_means_standard_error,
    random_recursion_law,
    regression_clients,
)

from ..algorithms.test_adaptation import (
    NOISE_SD,
    anisotropic_problem,
    check_chains_against_preconditioned_law,
    run,
)
from ..models import gaussian_regression, logistic_model, regression_data
from . import test_checkpoint as checkpoints

Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number


def gaussian_clients(b=3, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(b, d, d, generator=g)
    return GaussianClients(factors @ factors.transpose(-1, -2) + torch.eye(d), torch.randn(b, d, generator=g))


def ula_law(precision, mean, step, scales):
    """The exact stationary law of x' = x - step G A (x - mu) + sqrt(2 step G) Z, G = diag(scales): pSGLD
    whose second moment no longer moves, a linear Gaussian recursion with one outcome."""
    eye = torch.eye(len(mean), dtype=mean.dtype)
    drift = step * torch.diag(scales) @ precision
    outcome = Outcome(1.0, eye - drift, drift @ mean, torch.diag(2 * step * scales))
    return random_recursion_law([outcome], eye)


# ----------------------------------------------------------------------------------- the pure rule
@pytest.mark.parametrize("step", [torch.tensor(0.05), torch.tensor([0.05, 0.02])])
def test_one_step_by_hand(step):
    # g = sum over the clients of their gradients at the server's x; V first, then x with the new G
    clients = gaussian_clients()
    g = torch.Generator().manual_seed(1)
    x, noise = torch.randn(2, 2, generator=g), torch.randn(2, 2, generator=g)
    second_moment = torch.rand(2, 2, generator=g) + 0.5
    state = psgld.PsgldState(x, second_moment)
    new = psgld.step(
        state, clients.gradients, noise, InProcessNetwork(3, 2, 2), step_size=step, decay=0.9, damping=0.1
    )
    grad = sum(clients.precisions[i] @ (x - clients.means[i]).T for i in range(3)).T  # [C, d]
    v = 0.9 * second_moment + 0.1 * grad**2
    precondition = 1 / (v.sqrt() + 0.1)
    torch.testing.assert_close(new.second_moment, v)
    torch.testing.assert_close(
        new.server, x - step * precondition * grad + (2 * step * precondition).sqrt() * noise
    )
    # the initial state: V = 1
    torch.testing.assert_close(psgld.init(x).second_moment, torch.ones(2, 2))


def test_decay_one_keeps_the_second_moment_and_has_the_exact_law_of_preconditioned_ula():
    # rho = 1: V stays at its start, G = 1 / (sqrt(V) + eps) is a fixed diagonal, and pSGLD is the linear
    # Gaussian recursion x' = (I - gamma G A) x + gamma G A mu + sqrt(2 gamma G) Z. 5000 independent chains,
    # 150 iterations from 0 (the mean's transient is below 0.86^150 ~ 1e-10 of its start): their final points
    # are independent draws of the exact law, within Z standard errors of a sample of 5000.
    clients = gaussian_clients(b=1)
    precision, mean = clients.precisions[0], clients.means[0]
    num_chains, step, damping = 5000, 0.3, 1e-5
    second_moment = torch.tensor([1.0, 16.0]).expand(num_chains, 2)
    scales = 1 / (second_moment[0].sqrt() + damping)  # G: 1 and 1/4, a diagonal that matters
    law = ula_law(precision, mean, step, scales)
    assert torch.linalg.eigvals(law.mean_transition).abs().max() < 0.86
    network = InProcessNetwork(1, 2, num_chains)
    state = psgld.PsgldState(torch.zeros(num_chains, 2), second_moment)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        state = psgld.step(
            state,
            clients.gradients,
            torch.randn(num_chains, 2, generator=g),
            network,
            step_size=torch.tensor(step),
            decay=1.0,
            damping=damping,
        )
    assert torch.equal(state.second_moment, second_moment)
    draws = state.server
    mean_se = (law.cov.diagonal() / num_chains).sqrt()
    assert ((draws.mean(0) - law.mean).abs() <= Z * mean_se).all(), (draws.mean(0), law.mean)
    # a Gaussian's sample covariance: Var(S_ab) = (S_aa S_bb + S_ab^2) / n
    cov_se = ((law.cov.diagonal()[:, None] * law.cov.diagonal() + law.cov**2) / num_chains).sqrt()
    assert ((draws.T.cov() - law.cov).abs() <= Z * cov_se).all(), (draws.T.cov(), law.cov)
    # the setting is telling: the step's bias is many standard errors, and without G (plain ULA) this step is
    # not even stable
    assert ((law.cov - torch.linalg.inv(precision)).abs() > 10 * cov_se).any()
    with pytest.raises(ValueError, match="not mean-square stable"):
        ula_law(precision, mean, step, torch.ones(2))


# ----------------------------------------------------------------------------------- the kernel
@pytest.mark.slow
def test_kernel_with_decay_one_has_the_exact_law_of_preconditioned_ula():
    # through MCMC, 3 clients with full local batches: the server's g is the full gradient, and with decay 1
    # and damping 1 the step is ULA with the fixed G = 1 / (1 + 1) = 1/2. Exact law of the chain itself
    # (thinning 1), with its exact standard errors over 4 chains of 4000 draws.
    x, y = regression_data(60)
    clients = torch.arange(60) % 3
    exact = regression_clients(x, y, clients, NOISE_SD, torch.full((3,), 1 / 3))
    precision, mean = exact.precisions.sum(0), exact.posterior()[0]
    step = 0.8 / torch.linalg.eigvalsh(precision).max().item()  # gamma G lambda_max = 0.4
    kernel = PsgldKernel(
        gaussian_regression(NOISE_SD),
        clients,
        step_size=step,
        decay=1.0,
        damping=1.0,
        gradient_mode="traced",
    )
    pyro.set_rng_seed(0)
    chains = run(kernel, (x, y), num_samples=4000, warmup=300, num_chains=4).get_samples(group_by_chain=True)
    law = ula_law(precision, mean, step, torch.full((3,), 0.5))
    check_chains_against_preconditioned_law(chains["w"], law, torch.ones(3))


def test_one_client_is_psgld_on_the_pooled_data_and_clients_sum_to_it():
    # full local batches: 4 clients' gradients sum to the pooled data's (their prior shares to the prior), and
    # the server's noise is the same draw whatever the clients: the same chain, to rounding
    x, y = regression_data(40)
    draws = []
    for clients in (1, torch.arange(40) % 4):
        pyro.set_rng_seed(0)
        kernel = PsgldKernel(gaussian_regression(0.5), clients, step_size=2e-3, gradient_mode="traced")
        draws.append(run(kernel, (x, y), num_samples=100, warmup=0).get_samples()["w"])
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=1e-10)


def test_every_client_uploads_its_gradient_and_downloads_x_every_iteration():
    x, y = regression_data(40)
    pyro.set_rng_seed(0)
    kernel = PsgldKernel(
        gaussian_regression(0.5), torch.arange(40) % 4, step_size=2e-3, gradient_mode="traced"
    )
    mcmc = run(kernel, (x, y), num_samples=30, warmup=0)
    stats = kernel.sample_stats()
    per_iteration = 4 * 32 * 3  # 4 clients, d = 3 floats each way
    expected = per_iteration * np.arange(1, 31)
    np.testing.assert_array_equal(stats["uploaded_bits"], expected)
    np.testing.assert_array_equal(stats["downloaded_bits"], expected)
    assert set(stats) == {"diverging", "uploaded_bits", "downloaded_bits"}
    assert mcmc.diagnostics()["communication rounds"] == {"chain 0": 30}


def test_automatic_step_is_chosen_for_the_stationary_preconditioner():
    # on a Gaussian posterior E[g g^T] = H, so G settles near G* = 1 / (sqrt(diag H) + eps): the warm-up
    # chooses the step for that fixed inverse mass (the stiffness of G*^1/2 H G*^1/2, the same everywhere on
    # a Gaussian), and the run's own inverse mass is the identity (G is pSGLD's only preconditioner)
    x, y = regression_data(40)
    clients = torch.arange(40) % 4
    kernel = PsgldKernel(gaussian_regression(0.5), clients, batch_size="full", gradient_mode="traced")
    pyro.set_rng_seed(0)
    kernel.setup(100, x, y)
    exact = regression_clients(x, y, clients, 0.5, torch.full((4,), 0.25))
    hessian = exact.precisions.sum(0)
    expected = 1 / (hessian.diagonal().sqrt() + 1e-5)
    torch.testing.assert_close(kernel.stationary_preconditioner, expected, rtol=1e-8, atol=0)
    chosen = kernel.adaptation
    stiffness = torch.linalg.eigvalsh(expected.sqrt()[:, None] * hessian * expected.sqrt()).max().item()
    # Lanczos stops when its estimate moves by less than 1e-3 (relative); exact gradients: no noise
    assert chosen.stiffness == pytest.approx(stiffness, rel=1e-3) and chosen.noise == 0
    assert chosen.step_size == pytest.approx(adaptation.STEP_TARGET / stiffness, rel=1e-3)
    torch.testing.assert_close(chosen.preconditioner, torch.ones(3))
    torch.testing.assert_close(kernel.runner.constants[0], torch.full((3,), chosen.step_size))


@pytest.mark.slow
def test_defaults_sample_the_regression_posterior():
    # MCMC(PsgldKernel(model)) alone (10 i.i.d. clients, everything chosen) on a conjugate regression with
    # standardised features. The posterior is Gaussian, so the chain's law is symmetric about its mean: the
    # draws' mean is the posterior's within batch-means standard errors. Each variance may exceed the
    # posterior's by the automatic step's budget (VARIANCE_TARGET, 10%, for ULA with G* on the stiffest
    # direction) plus pSGLD's own bias from the dropped Gamma term, at most 13% where the kernel does not warn
    # ((1 - decay) * relaxation time <= MEMORY_WARNING; about 5% at this posterior's 0.18, measured), plus Z
    # standard errors of the sample variances.
    x, y = regression_data(60)
    exact = regression_clients(x, y, torch.zeros(60, dtype=torch.long), 0.5, torch.ones(1))
    mean, covariance = exact.posterior()
    kernel = PsgldKernel(gaussian_regression(0.5), gradient_mode="traced")
    pyro.set_rng_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chains = run(kernel, (x, y), num_samples=1000, warmup=200, num_chains=4).get_samples(
            group_by_chain=True
        )["w"]
    # no warning: neither the memory's nor the end-of-run checks'
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    chosen = kernel.adaptation
    relaxation = (2 - chosen.step_size * chosen.slowest) / (chosen.step_size * chosen.slowest)
    assert (1 - kernel.decay) * relaxation <= MEMORY_WARNING
    pooled_se = torch.stack([batch_means_standard_error(c) for c in chains]).square().mean(0).sqrt() / 2
    assert ((chains.mean((0, 1)) - mean).abs() <= Z * pooled_se).all(), (chains.mean((0, 1)), mean)
    centred = chains - chains.mean(1, keepdim=True)
    squares = centred.square()
    variances = squares.mean((0, 1))
    variance_se = torch.stack([batch_means_standard_error(s) for s in squares]).square().mean(0).sqrt() / 2
    ratio, ratio_se = variances / covariance.diagonal(), variance_se / covariance.diagonal()
    assert (ratio >= 1 - Z * ratio_se).all(), (ratio, ratio_se)
    assert (ratio <= 1 + adaptation.VARIANCE_TARGET + 0.13 + Z * ratio_se).all(), (ratio, ratio_se)


def test_warns_when_the_slowest_direction_outlasts_the_second_moments_memory():
    # posterior sds 100x apart: G* = 1/sqrt(diag H) leaves curvatures 100x apart, the slowest direction
    # relaxes over thousands of iterations against V's 100
    x, y, clients, _ = anisotropic_problem()

    def setup(**options):
        kernel = PsgldKernel(
            gaussian_regression(NOISE_SD), clients, batch_size="full", gradient_mode="traced", **options
        )
        pyro.set_rng_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel.setup(20, x, y)
        return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]

    (message,) = setup()
    assert "the dropped Gamma term widens it" in message
    suggested = float(re.search(r"decay=([0-9.]+) keeps it within 2.5%", message).group(1))
    assert 0.99 < suggested < 1
    # the same warm-up (the same seed) with the decay it names: no warning
    assert setup(decay=suggested) == []


@pytest.mark.filterwarnings("ignore:pyro_fed's end-of-run checks")  # short runs
def test_an_interrupted_automatic_run_resumes_to_the_same_draws(tmp_path):
    # the state (x and V) and the warm-up's choice (the identity as the run's inverse mass) are checkpointed:
    # the resumed run computes only the chunks that were not, to the uninterrupted run's draws, bit for bit
    path = tmp_path / "psgld.pt"

    def kernel(**kw):
        return PsgldKernel(logistic_model, 4, gradient_mode="traced", chunk_size=8, **kw)

    first, _ = checkpoints.run(kernel(), num_samples=10)
    expected = checkpoints.results(first)
    checkpoints.interrupt(kernel(checkpoint=path, checkpoint_every=1), call=3, num_samples=10)
    mcmc, calls = checkpoints.run(kernel(checkpoint=path, checkpoint_every=1), num_samples=10)
    assert calls and calls[0] == 2 * first.kernel.runner.chunk
    checkpoints.assert_bitwise_equal(checkpoints.results(mcmc), expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"preconditioner": torch.ones(3)}, "preconditioner is its own G"),
        ({"prior_weights": "server"}, "QlsdKernel's option"),
        ({"decay": 1.5}, r"decay must be a number in \[0, 1\]"),
        ({"decay": -0.1}, r"decay must be a number in \[0, 1\]"),
        ({"decay": "fast"}, r"decay must be a number in \[0, 1\]"),
        ({"damping": 0.0}, "damping must be a finite positive number"),
        ({"damping": math.inf}, "damping must be a finite positive number"),
    ],
)
def test_bad_arguments(options, message):
    with pytest.raises(ValueError, match=message):
        PsgldKernel(gaussian_regression(0.5), 2, **options)
