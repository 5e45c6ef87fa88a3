"""SvrgLdKernel: VR-FALD⋆ with one client and an average every iteration; the exact stationary law of SVRG-LD
with minibatches on a Gaussian regression; its automatic snapshot probability; argument errors."""

import itertools
import math

import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed.kernels.svrg_ld import SvrgLdKernel
from pyro_fed.kernels.vr_fald import VrFaldKernel
from pyro_fed.testing import Outcome, batch_means_standard_error, random_recursion_law

from ..models import gaussian_regression, regression_data

Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
NOISE_SD = 0.5


def run(kernel, args, num_samples, warmup=0, num_chains=1):
    mcmc = MCMC(
        kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=num_chains, disable_progbar=True
    )
    mcmc.run(*args)
    return mcmc


def svrg_ld_law(x, y, batch, step, refresh_prob):
    r"""The exact stationary law of SVRG-LD's draw on the regression ``y ~ N(x w, NOISE_SD^2)``,
    ``w ~ N(0, I)`` (``gaussian_regression``, one client holding all the data), with minibatches of ``batch``
    points, each a uniform subset drawn independently of the past (as the kernel's are when ``batch > N / 2``:
    one minibatch per permutation of the data).

    With :math:`A_S = I + \frac Nn \sum_{j \in S} x_j x_j^\top / \sigma^2` (the minibatch's Hessian, prior
    included), :math:`A` the full one and :math:`c = \sum_j x_j y_j / \sigma^2`, the control variate is
    :math:`A_S (X - Y) + A Y - c`, so the state :math:`(X, Y)` follows a random linear recursion with one
    outcome per minibatch and refresh coin: :math:`X' = (I - \gamma A_S) X + \gamma (A_S - A) Y + \gamma c +
    \sqrt{2\gamma} Z`, and :math:`Y' = X` (the iterate before the step) with probability :math:`q`, else
    :math:`Y`."""
    n, d = x.shape
    eye, zero = torch.eye(d), torch.zeros(d, d)
    per_datum = x[:, :, None] * x[:, None, :] / NOISE_SD**2  # [N, d, d]
    full = eye + per_datum.sum(0)
    shift = (x * y[:, None]).sum(0) / NOISE_SD**2
    subsets = list(itertools.combinations(range(n), batch))
    outcomes = []
    for subset in subsets:
        hessian = eye + n / batch * per_datum[list(subset)].sum(0)
        top = torch.cat([eye - step * hessian, step * (hessian - full)], 1)
        for refreshed, prob in ((True, refresh_prob), (False, 1 - refresh_prob)):
            bottom = torch.cat([eye, zero] if refreshed else [zero, eye], 1)
            outcomes.append(
                Outcome(
                    prob / len(subsets),
                    torch.cat([top, bottom]),
                    torch.cat([step * shift, torch.zeros(d)]),
                    torch.block_diag(2 * step * eye, zero),
                )
            )
    return random_recursion_law(outcomes, torch.cat([eye, zero], 1))


@pytest.mark.slow
def test_minibatch_svrg_ld_has_its_exact_stationary_law():
    # 7 data, minibatches of 4 (every iteration a fresh uniform 4-subset: 35 outcomes), a snapshot with
    # probability 0.1 per iteration, a step at which the minibatches' noise is large (gamma lambda_max = 0.8).
    # The law's mean is the posterior's (an unbiased estimate on a quadratic U); its covariance is not, and
    # is checked entry by entry with batch-means standard errors (the chain, with random transitions, is not
    # Gaussian); the mean with the law's exact standard errors.
    x, y = regression_data(7, dim=2, seed=1)
    hessian = torch.eye(2) + x.T @ x / NOISE_SD**2
    step = 0.8 / torch.linalg.eigvalsh(hessian).max().item()
    law = svrg_ld_law(x, y, 4, step, 0.1)
    kernel = SvrgLdKernel(
        gaussian_regression(NOISE_SD),
        step_size=step,
        batch_size=4,
        refresh_prob=0.1,
        thinning=1,
        gradient_mode="traced",
    )
    pyro.set_rng_seed(0)
    num_chains, num_draws = 4, 10_000
    chains = run(kernel, (x, y), num_draws, warmup=500, num_chains=num_chains).get_samples(
        group_by_chain=True
    )
    draws = chains["w"]
    mean_se = law.mean_standard_error(num_draws) / math.sqrt(num_chains)
    assert ((draws.mean((0, 1)) - law.mean).abs() <= Z * mean_se).all(), (draws.mean((0, 1)), law.mean)
    centred = draws - draws.mean((0, 1))
    products = centred[..., :, None] * centred[..., None, :]  # [C, K, d, d]
    cov_se = torch.stack([batch_means_standard_error(p) for p in products]).square().mean(0).sqrt()
    cov_se = cov_se / math.sqrt(num_chains)
    assert ((products.mean((0, 1)) - law.cov).abs() <= Z * cov_se).all(), (products.mean((0, 1)), law.cov)
    # the setting is telling: without the minibatches' noise (full batches: ULA) the covariance is many
    # standard errors away
    ula = svrg_ld_law(x, y, 7, step, 0.1)
    assert ((ula.cov - law.cov).abs() > 10 * cov_se).any()


def test_svrg_ld_is_vr_fald_with_one_client_averaged_every_iteration():
    x, y = regression_data(40)
    options = dict(step_size=2e-3, batch_size=5, refresh_prob=0.2, gradient_mode="traced")
    draws, stats = [], []
    for kernel in (
        SvrgLdKernel(gaussian_regression(NOISE_SD), **options),
        VrFaldKernel(gaussian_regression(NOISE_SD), 1, comm_prob=1.0, noise_corr=1.0, **options),
    ):
        pyro.set_rng_seed(0)
        draws.append(run(kernel, (x, y), num_samples=50).get_samples()["w"])
        stats.append(kernel.sample_stats()["refreshed"])
    assert torch.equal(draws[0], draws[1])
    assert (stats[0] == stats[1]).all() and 0 < stats[0].sum() < 50


def test_automatic_snapshot_probability_takes_a_tenth_of_the_data_evaluations():
    # a minibatch of 5 evaluated at the iterate and at the snapshot: q = 0.1 * 2 * 5 / 40
    x, y = regression_data(40)
    kernel = SvrgLdKernel(gaussian_regression(NOISE_SD), step_size=2e-3, batch_size=5, gradient_mode="traced")
    kernel.setup(0, x, y)
    assert kernel.current_refresh_prob == pytest.approx(0.1 * 2 * 5 / 40)
    assert kernel.potential.num_clients == 1


@pytest.mark.parametrize(
    "options", [{"clients": 4}, {"comm_prob": 0.5}, {"noise_corr": 0.0}, {"clients": 2, "comm_prob": 1.0}]
)
def test_fixed_arguments_are_refused(options):
    with pytest.raises(ValueError, match="SvrgLdKernel is centralized.* it takes no " + ", ".join(options)):
        SvrgLdKernel(gaussian_regression(NOISE_SD), **options)
