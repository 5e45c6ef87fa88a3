"""FaldKernel: exact stationary law on a Gaussian target, SGLD limit, reproducibility, Pyro integration."""

import math
import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.autoguide.initialization import init_to_value

from pyro_fed import FaldKernel, VrFaldKernel
from pyro_fed.kernels.base import EXPLOSION_SCALES
from pyro_fed.network.base import BITS_PER_FLOAT
from pyro_fed.testing import batch_means_standard_error, fald_stationary_law, regression_clients

from ..models import (
    gaussian_regression,
    gaussian_regression_for_nuts,
    hierarchical_data,
    hierarchical_regression,
    logistic_model,
    regression_data,
    sorted_regression,
)

NOISE_SD = 0.5
Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
#: the conjugate regression written with pyro.subsample and as a NUTS user writes it: the same exact law
FORMS = [gaussian_regression, gaussian_regression_for_nuts]


def run(kernel, args, num_samples, warmup=200, **kwargs):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True, **kwargs)
    mcmc.run(*args)
    return mcmc


def check_against_gaussian_law(draws, law):
    """Sample mean and covariance against the exact stationary law of a Gaussian chain, with exact
    standard errors; returns the covariance tolerance."""
    k = draws.shape[0]
    mean_tol, cov_tol = Z * law.mean_standard_error(k), Z * law.covariance_standard_error(k)
    assert ((draws.mean(0) - law.mean).abs() <= mean_tol).all(), (draws.mean(0), law.mean, mean_tol)
    assert ((draws.T.cov() - law.cov).abs() <= cov_tol).all(), (draws.T.cov(), law.cov, cov_tol)
    return cov_tol


@pytest.mark.slow
@pytest.mark.parametrize("regression", FORMS, ids=["pyro.subsample", "written for NUTS"])
def test_fald_full_batch_matches_exact_discretised_law(regression):
    # comm_prob = 1, full local batches: every iteration ends at consensus, and the average follows
    # X' = X - h grad U(X) + sqrt(2h) xi with h = step_size / b (pyro_fed.algorithms.fald): a Gaussian AR(1).
    # Four chains run as one batch: each is a stationary chain of the exact law, independent of the others.
    x, y, clients, exact = sorted_regression(noise_sd=NOISE_SD)
    _, posterior_cov = exact.posterior()
    step = 4 * 0.5 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    hyper = {"step_size": step, "comm_prob": 1.0, "noise_corr": 0.3}
    kernel = FaldKernel(regression(NOISE_SD), clients, **hyper)
    chains = run(kernel, (x, y), num_samples=5000, num_chains=4).get_samples(group_by_chain=True)["w"]
    law = fald_stationary_law(exact, **hyper)
    # each chain has the exact law on its own...
    for chain in chains:
        assert ((chain.mean(0) - law.mean).abs() <= Z * law.mean_standard_error(5000)).all()
    # ...and the average of 4 independent chains' means and covariances has exact standard errors / sqrt(4)
    mean = chains.mean(1).mean(0)
    cov = torch.stack([c.T.cov() for c in chains]).mean(0)
    mean_tol, cov_tol = Z * law.mean_standard_error(5000) / 2, Z * law.covariance_standard_error(5000) / 2
    assert ((mean - law.mean).abs() <= mean_tol).all(), (mean, law.mean, mean_tol)
    assert ((cov - law.cov).abs() <= cov_tol).all(), (cov, law.cov, cov_tol)
    # the test has power: at this step the discretised law is measurably not the posterior
    assert ((law.cov - posterior_cov).abs() > cov_tol).any()


@pytest.mark.slow
def test_fald_small_step_matches_exact_posterior():
    x, y, clients, exact = sorted_regression(noise_sd=NOISE_SD)
    mean, posterior_cov = exact.posterior()
    step = 4 * 0.05 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    kernel = FaldKernel(gaussian_regression(NOISE_SD), clients, step_size=step, comm_prob=1.0)
    draws = run(kernel, (x, y), num_samples=30000, warmup=2000).get_samples()["w"]
    law = fald_stationary_law(exact, step, 1.0, 1.0)
    # tolerance: Monte Carlo error plus the known discretisation bias (here at most 2.6% of a variance)
    bias = (law.cov - posterior_cov).abs()
    assert ((draws.mean(0) - mean).abs() <= Z * law.mean_standard_error(len(draws))).all()
    assert (
        (draws.T.cov() - posterior_cov).abs() <= bias + Z * law.covariance_standard_error(len(draws))
    ).all()


@pytest.mark.slow
def test_fald_with_local_steps_matches_exact_law_on_heterogeneous_regression():
    # comm_prob < 1: clients drift toward their local posteriors between rounds; with full local batches
    # the stacked client iterates follow a random linear recursion whose stationary law is exact
    x, y, clients, exact = sorted_regression(noise_sd=NOISE_SD)
    mean, _ = exact.posterior()
    step = 4 * 0.4 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    hyper = {"step_size": step, "comm_prob": 0.2, "noise_corr": 0.5}
    law = fald_stationary_law(exact, **hyper)
    assert (law.mean - mean).norm() > 10 * law.mean_standard_error(15000).max()  # drift is visible
    draws = run(FaldKernel(gaussian_regression(NOISE_SD), clients, **hyper), (x, y), num_samples=15000)
    draws = draws.get_samples()["w"]
    assert ((draws.mean(0) - law.mean).abs() <= Z * law.mean_standard_error(len(draws))).all()
    centred = draws - draws.mean(0)
    products = centred[:, :, None] * centred[:, None, :]
    # a Gaussian mixture over coin sequences: batch means give the covariance's standard error
    assert ((products.mean(0) - law.cov).abs() <= Z * batch_means_standard_error(products)).all()


@pytest.mark.parametrize("noise_corr", [0.0, 0.5, 1.0])
def test_single_client_fald_is_ula(noise_corr):
    # b = 1, comm_prob = 1: one transition from a fixed point is N(x - step * grad U(x), 2 step I);
    # 2000 chains started at the point, one iteration each, give 2000 independent transitions
    x, y = regression_data(30)
    single = regression_clients(x, y, torch.zeros(30, dtype=torch.long), NOISE_SD, torch.ones(1))
    mean, precision = single.means[0], single.precisions[0]
    step = 0.3 / torch.linalg.eigvalsh(precision).max().item()
    kernel = FaldKernel(
        gaussian_regression(NOISE_SD),
        torch.zeros(30, dtype=torch.long),
        step_size=step,
        noise_corr=noise_corr,
        gradient_mode="traced",
    )
    point, n = torch.tensor([0.4, -0.3, 0.2]), 2000
    pyro.set_rng_seed(0)
    mcmc = run(
        kernel, (x, y), num_samples=1, warmup=0, num_chains=n, initial_params={"w": point.expand(n, 3)}
    )
    moves = mcmc.get_samples()["w"]
    expected = point - step * precision @ (point - mean)
    sd = math.sqrt(2 * step)
    # independent draws: mean error sd / sqrt(n); variance error 2 sd^2 sqrt(2 / n)
    assert ((moves.mean(0) - expected).abs() <= Z * sd / math.sqrt(n)).all()
    torch.testing.assert_close(moves.T.cov(), sd**2 * torch.eye(3), atol=Z * sd**2 * math.sqrt(2 / n), rtol=0)


def test_reproducible_with_pyro_seed_and_multichain():
    x, y = regression_data(40)
    labels = (y > 0).double()

    def draws(num_chains):
        pyro.set_rng_seed(7)
        kernel = FaldKernel(
            logistic_model,
            torch.arange(40) % 4,
            step_size=0.02,
            comm_prob=0.3,
            batch_size=5,
            gradient_mode="traced",
        )
        return run(kernel, (x, labels), num_samples=50, warmup=10, num_chains=num_chains)

    first, second = draws(1), draws(1)
    assert torch.equal(first.get_samples()["w"], second.get_samples()["w"])
    multi = draws(2)
    chains = multi.get_samples(group_by_chain=True)["w"]
    assert chains.shape == (2, 50, 3)
    assert not torch.equal(chains[0], chains[1])
    diagnostics = multi.diagnostics()
    assert set(diagnostics["divergences"]) == {"chain 0", "chain 1"}


def test_communication_rounds_and_bits():
    x, y = regression_data(40)
    kernel = FaldKernel(
        logistic_model,
        torch.arange(40) % 4,
        step_size=0.02,
        comm_prob=0.25,
        batch_size=5,
        gradient_mode="traced",
    )
    mcmc = run(kernel, (x, (y > 0).double()), num_samples=400, warmup=0)
    stats = kernel.sample_stats()
    rounds = int(stats["communicated"].sum())
    assert kernel.network.rounds.tolist() == [rounds]
    # 400 coins of probability 1/4: mean 100, sd 8.7
    assert 100 - 5 * 8.7 < rounds < 100 + 5 * 8.7
    # each round: 4 clients upload d = 3 floats of 32 bits
    assert stats["uploaded_bits"][-1] == rounds * 4 * 3 * 32
    assert (stats["dispersion"][stats["communicated"].astype(bool)] < 1e-20).all()
    assert (stats["dispersion"][~stats["communicated"].astype(bool)] > 0).all()
    assert kernel.logging()["rounds"] == rounds
    assert mcmc.diagnostics()["communication rounds"] == {"chain 0": rounds}


def test_megabytes_per_effective_draw_are_the_bits_counted_over_the_smallest_bulk_ess():
    # two chains of a given step (no warm-up rounds): every bit each chain's clients uploaded, over the
    # smallest bulk ESS of the unconstrained coordinates (ArviZ's, on the draws after warm-up)
    x, y = regression_data(40)
    kernel = FaldKernel(
        logistic_model, 4, step_size=0.05, comm_prob=0.25, batch_size=5, gradient_mode="traced", thinning=5
    )
    mcmc = run(kernel, (x, (y > 0).double()), num_samples=200, warmup=50, num_chains=2)
    diagnostics = mcmc.diagnostics()
    bits = [int(kernel.sample_stats(chain)["uploaded_bits"][-1]) for chain in range(2)]
    assert diagnostics["uploaded MB"] == {f"chain {c}": bits[c] / 8e6 for c in range(2)}
    draws = mcmc.get_samples(group_by_chain=True)["w"].numpy()  # unconstrained: w is real
    smallest = min(float(az.ess(draws[..., j], method="bulk")) for j in range(draws.shape[-1]))
    expected = sum(bits) / 8e6 / smallest
    for value in diagnostics["MB per effective draw"].values():
        assert value == pytest.approx(expected, rel=1e-9)


def test_non_finite_steps_are_reverted_and_counted():
    x, y = regression_data(40)
    kernel = FaldKernel(
        gaussian_regression(NOISE_SD), torch.arange(40) % 4, step_size=50.0, gradient_mode="traced"
    )
    with pytest.warns(
        UserWarning, match=r"of the 300 draws of chain 0 diverged .* Pass a smaller step_size \(now 50\)"
    ):
        mcmc = run(kernel, (x, y), num_samples=300, warmup=0)
    draws = mcmc.get_samples()["w"]
    # a step that leaves the bound around the chain's start (1e6 without a preconditioner) has exploded: it
    # is reverted like a non-finite one, so the draws stay finite and bounded rather than growing to 1e40
    assert ((draws - kernel.initial_params["w"]).abs() <= EXPLOSION_SCALES).all()
    divergences = mcmc.diagnostics()["divergences"]["chain 0"]
    assert len(divergences) > 0 and divergences == sorted(divergences)
    # the progress bar's count (no warm-up here) and step size
    assert kernel.logging()["divergences"] == len(divergences)
    assert kernel.logging()["step"] == "50"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step_size": 0.0}, "step_size must be a finite positive number"),
        ({"step_size": -1e-3}, "step_size must be a finite positive number"),
        ({"step_size": float("inf")}, "step_size must be a finite positive number"),
        ({"step_size": float("nan")}, "step_size must be a finite positive number"),
        ({"step_size": torch.tensor([1e-3, 1e-3])}, "step_size must be a finite positive number"),
        ({"step_size": 1e-3, "comm_prob": 0.0}, r"comm_prob must be a number in \(0, 1\]"),
        ({"step_size": 1e-3, "comm_prob": 1.5}, r"comm_prob must be a number in \(0, 1\]"),
        ({"step_size": 1e-3, "noise_corr": -0.1}, r"noise_corr must be a number in \[0, 1\]"),
        ({"step_size": 1e-3, "noise_corr": 2}, r"noise_corr must be a number in \[0, 1\]"),
        ({"step_size": 1e-3, "batch_size": 0}, "batch_size must be a positive integer"),
        ({"step_size": 1e-3, "batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"step_size": 1e-3, "batch_size": 1.0}, r"a fraction in \(0, 1\) of each client's data"),
        ({"step_size": 1e-3, "gradient_mode": "jit"}, "gradient_mode='jit': use one of"),
    ],
)
def test_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaldKernel(logistic_model, torch.arange(10) % 2, **kwargs)


def test_a_batch_size_beyond_the_clients_data_is_refused_or_capped_with_a_warning():
    x, y = regression_data(40)
    labels = (y > 0).double()
    clients = torch.cat([torch.zeros(30), torch.ones(10)]).long()  # 30 and 10 points
    with pytest.raises(
        ValueError, match="batch_size=31 is larger than every client's data .the largest client holds 30"
    ):
        FaldKernel(logistic_model, clients, step_size=1e-3, batch_size=31).setup(0, x, labels)
    kernel = FaldKernel(logistic_model, clients, step_size=1e-3, batch_size=20, gradient_mode="traced")
    with pytest.warns(UserWarning, match="batch_size=20 is larger than the data of 1 of the 2 clients"):
        kernel.setup(0, x, labels)
    assert kernel.minibatches.batch_sizes == [20, 10]  # the small client uses all its data
    # an automatic step chooses the minibatch unless told "full"
    full = FaldKernel(logistic_model, clients, batch_size="full", gradient_mode="traced")
    full.setup(0, x, labels)
    assert full.current_batch_size is None and full.minibatches is None and full.adaptation.noise == 0.0


def test_bad_clients_reported_at_setup():
    x, y = regression_data(10)
    kernel = FaldKernel(logistic_model, torch.arange(9) % 2, step_size=1e-3, gradient_mode="traced")
    with pytest.raises(ValueError, match="clients has length 9 but the data plate has 10 points"):
        run(kernel, (x, (y > 0).double()), num_samples=5)


def test_user_initial_params_and_fresh_inits_per_run():
    x, y = regression_data(40)
    labels = (y > 0).double()
    start = torch.tensor([0.5, -1.0, 2.0])
    kernel = FaldKernel(logistic_model, torch.arange(40) % 4, step_size=1e-12, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=3, warmup_steps=0, initial_params={"w": start}, disable_progbar=True)
    mcmc.run(x, labels)
    # a step of 1e-12 moves the chain by ~1e-6 from where it started
    torch.testing.assert_close(mcmc.get_samples()["w"], start.expand(3, 3), atol=1e-5, rtol=0)
    # without initial values, each run draws its own from the init strategy (init_to_median)
    other = FaldKernel(logistic_model, torch.arange(40) % 4, step_size=1e-12, gradient_mode="traced")
    first = run(other, (x, labels), num_samples=1, warmup=0).get_samples()["w"]
    second = run(other, (x, labels), num_samples=1, warmup=0).get_samples()["w"]
    assert not torch.equal(first, second)


def test_step_size_as_a_tensor_and_clients_as_a_number():
    kernel = FaldKernel(logistic_model, 4, step_size=torch.tensor(1e-3), gradient_mode="traced")
    assert kernel.step_size == pytest.approx(1e-3)
    x, y = regression_data(42)
    run(kernel, (x, (y > 0).double()), num_samples=5, warmup=0)
    # 4 clients of an i.i.d. split (seed 0): sizes differ by at most one
    assert sorted(kernel.potential.client_sizes.tolist()) == [10, 10, 11, 11]


@pytest.mark.parametrize(
    "initial, match",
    [
        ({"v": torch.zeros(3)}, r"initial_params lacks the latent sites \['w'\]"),
        (
            {"w": torch.zeros(4)},
            r"initial_params\['w'\] has shape \(4,\); the site's unconstrained value has",
        ),
    ],
)
def test_bad_initial_params(initial, match):
    x, y = regression_data(40)
    kernel = FaldKernel(logistic_model, 4, step_size=1e-3, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=3, warmup_steps=0, initial_params=initial, disable_progbar=True)
    with pytest.raises(ValueError, match=match):
        mcmc.run(x, (y > 0).double())


def test_nan_in_the_data_is_refused_naming_the_site():
    x, y = regression_data(40)
    y[[3, 17]] = float("nan")
    kernel = FaldKernel(gaussian_regression(NOISE_SD), 4, step_size=1e-3, gradient_mode="traced")
    with pytest.raises(ValueError, match="Site 'y' has a non-finite log-density .* hold 2 NaN entries"):
        run(kernel, (x, y), num_samples=3, warmup=0)


def test_non_finite_gradient_at_the_initial_point_is_refused():
    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]) as idx:
            # sqrt(|w|) is finite at 0, its derivative is not
            pyro.sample("y", dist.Normal(w.abs().sqrt() * x[idx, 0], 1.0), obs=y[idx])

    x, y = regression_data(40)
    start = init_to_value(values={"w": torch.tensor(0.0)})
    kernel = FaldKernel(model, 4, step_size=1e-3, init_strategy=start, gradient_mode="traced")
    with pytest.raises(ValueError, match=r"gradient is not finite at the initial point .*sites \['w'\]"):
        run(kernel, (x, y), num_samples=3, warmup=0)


def test_fald_warns_before_the_run_when_client_drift_moves_the_mean():
    # 4 clients split by the quadrant of their two features, one averaging round per million iterations:
    # each client samples near its own posterior, 0.7 posterior sds from the whole one's mean (measured)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=g)
    y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(200, generator=g)
    quadrants = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
    with pytest.warns(
        UserWarning, match=r"comm_prob=1e-06, .* the draws of w\[\d\] are 0\.\d+ posterior sds off in mean"
    ):
        run(FaldKernel(gaussian_regression(0.5), quadrants, comm_prob=1e-6), (x, y), num_samples=2, warmup=0)
    # averaging at every iteration: no drift, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(FaldKernel(gaussian_regression(0.5), quadrants), (x, y), num_samples=2, warmup=0)
    assert not [w for w in caught if "drift" in str(w.message)]


def test_fald_warns_before_the_run_on_a_hierarchical_model_with_heterogeneous_groups():
    # one client per group: between the rounds (one per 10 iterations, the paper's setting) each client
    # pulls the group intercepts and the common slope toward its own group's posterior; the quadratic model
    # at the mode predicts the intercepts' draws 1.3-1.4 times too wide (measured on two seeds)
    group, x, y = hierarchical_data()
    with pytest.warns(
        UserWarning, match=r"comm_prob=0\.1, .* the draws of intercept\[\d\] are .* times as wide"
    ):
        run(FaldKernel(hierarchical_regression, group, comm_prob=0.1), (group, x, y), num_samples=2, warmup=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(FaldKernel(hierarchical_regression, group), (group, x, y), num_samples=2, warmup=0)
    assert not [w for w in caught if "quadratic model" in str(w.message)]


@pytest.mark.slow
def test_the_warned_hierarchical_setting_is_off():
    # the draws at the warned setting against those averaging at every iteration: the intercepts' sd is
    # predicted 1.27-1.42 times wider (measured: 1.33 for intercept[0]); with 470-890 effective draws of each
    # an sd ratio's standard error is about sqrt(1 / (2 ESS) + 1 / (2 ESS')) = 0.04, so that the bound 1.1
    # is 5 standard errors below the ratio predicted and 2.5 above an accurate setting's 1
    group, x, y = hierarchical_data()
    sds = {}
    for comm_prob in (1.0, 0.1):
        pyro.set_rng_seed(0)
        kernel = FaldKernel(hierarchical_regression, group, comm_prob=comm_prob)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcmc = run(kernel, (group, x, y), num_samples=1000, warmup=300, num_chains=2)
        sds[comm_prob] = mcmc.get_samples()["intercept"].std(0)
    assert float((sds[0.1] / sds[1.0]).max()) > 1.1, sds


@pytest.mark.parametrize("split", ["sorted", "iid"])
@pytest.mark.parametrize("kernel_class", [FaldKernel, VrFaldKernel])
def test_the_automatic_communication_uploads_no_more_than_averaging_every_iteration(kernel_class, split):
    # the same draws at comm_prob=None and at comm_prob=1 (today's default): the automatic setting uploads
    # no more, but for its one-off cost, the clients' gradients and Hessians at the mode (d + 1 averages of
    # d floats) from which the quadratic model of the clients is built
    x, y, clients, _ = sorted_regression(60, 6)
    clients = clients if split == "sorted" else torch.arange(60) % 6
    bits = {}
    for comm_prob in (1.0, None):
        pyro.set_rng_seed(0)
        kernel = kernel_class(gaussian_regression(NOISE_SD), clients, comm_prob=comm_prob)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 200 draws: the end-of-run checks ask for more
            mcmc = run(kernel, (x, y), num_samples=200)
        bits[comm_prob] = mcmc.diagnostics()["uploaded bits"]["chain 0"]
    d = x.shape[1]
    assert bits[None] <= bits[1.0] + 6 * (d + 1) * d * BITS_PER_FLOAT, bits


def test_diagnostics_print_as_nuts_s_do():
    # a 2-chain run of a 10-coordinate model: per site r_hat and n_eff, per chain a few numbers; the per-draw
    # statistics and the preconditioner are elsewhere (ArviZ's sample_stats, the kernel's adaptation)
    x, y = regression_data(200, dim=10)
    pyro.set_rng_seed(0)
    kernel = FaldKernel(logistic_model, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 100 draws: the end-of-run checks ask for more
        mcmc = run(kernel, (x, (y > 0).double()), num_samples=100, warmup=50, num_chains=2)
    diagnostics = mcmc.diagnostics()
    assert set(diagnostics) == {
        "w", "divergences", "step size", "communication rounds", "uploaded bits", "downloaded bits",
        "uploaded MB", "MB per effective draw", "sent bytes", "end-of-run checks", "warm-up",
    }  # fmt: skip
    line = kernel.warmup.summary()
    assert diagnostics["warm-up"] == {"chain 0": line, "chain 1": line}
    assert len(str(diagnostics)) < 3000
    verdict = kernel.end_of_run_checks["problems"] or "passed"
    assert diagnostics["end-of-run checks"] == {"chain 0": verdict, "chain 1": verdict}
    assert len(kernel.sample_stats(1)["uploaded_bits"]) == 100


@pytest.mark.slow
def test_fald_samples_the_exact_law_with_the_estimated_hessian_diagonal():
    # d = 320 coordinates, above ESTIMATED_DIAGONAL_ABOVE: a regression's Hessian is diagonal-dominant, so
    # the warm-up keeps Bekas's estimate (its groups' rounds are counted, and it differs from the exact
    # diagonal). At comm_prob = 1 with full local batches FALD's average is preconditioned ULA with
    # h = step / b: on a Gaussian its stationary law is exact, the mode as mean and, in the coordinates
    # whitened by the preconditioner R (A = R H R), the covariance (A - h A^2 / 2)^-1
    from pyro_fed.algorithms import adaptation

    d, n, b = adaptation.ESTIMATED_DIAGONAL_ABOVE + 64, 4000, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(
        0.8, 1.25, d, dtype=torch.float64
    )
    y = x @ (0.1 * torch.randn(d, generator=g, dtype=torch.float64)) + NOISE_SD * torch.randn(
        n, generator=g, dtype=torch.float64
    )
    clients = torch.arange(n) % b
    exact = regression_clients(x, y, clients, NOISE_SD, prior_weights=torch.full((b,), 1.0 / b))
    pyro.set_rng_seed(0)
    kernel = FaldKernel(gaussian_regression(NOISE_SD), clients, prior_weights="uniform")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the end-of-run checks' verdict is this test's
        mcmc = run(kernel, (x, y), num_samples=500, warmup=200, num_chains=2)
    chosen = kernel.adaptation
    hessian = exact.precisions.sum(0)
    assert chosen.preconditioner.dim() == 1
    assert not torch.allclose(chosen.curvature, hessian.diagonal(), rtol=1e-6)  # estimated...
    # ...within 5 of the standard errors it accepts (DIAGONAL_TOLERANCE, relative) of the exact diagonal
    relative = (chosen.curvature - hessian.diagonal()) / hessian.diagonal()
    assert relative.abs().max() < 5 * adaptation.DIAGONAL_TOLERANCE
    mean, _ = exact.posterior()
    precision = hessian
    root = chosen.preconditioner.sqrt()
    whitened = root[:, None] * precision * root[None, :]
    h = chosen.step_size / b
    covariance = root[:, None] * torch.linalg.inv(whitened - h * whitened @ whitened / 2) * root[None, :]
    draws = mcmc.get_samples(group_by_chain=True)["w"].numpy()
    ess = torch.as_tensor(
        [float(az.ess(draws[..., j], method="bulk")) for j in range(d)], dtype=torch.float64
    )
    flat = torch.as_tensor(draws.reshape(-1, d))
    sd = covariance.diagonal().sqrt()
    # 5 standard errors per coordinate (a false alarm has probability about 2e-4 over the 320 means); the
    # variance's standard error for nearly Gaussian draws is var * sqrt(2 / ESS)
    assert ((flat.mean(0) - mean).abs() <= 5 * sd / ess.sqrt()).all()
    assert ((flat.var(0) - sd.square()).abs() <= 5 * sd.square() * (2 / ess).sqrt()).all()
