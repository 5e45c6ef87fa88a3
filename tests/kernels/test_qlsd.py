"""QLSD family: the update rule, the memory, participation and bits; the exact law with exact gradients and
posterior moments with quantisation and partial participation; argument errors."""

import itertools
import math
import warnings

import numpy as np
import pyro
import pytest
import torch

import pyro_fed
from pyro_fed import FaldKernel, QlsdKernel
from pyro_fed.algorithms import adaptation, levels, qlsd
from pyro_fed.engine.randomness import Randomness
from pyro_fed.kernels.qlsd import PARTICIPATION_WARNING
from pyro_fed.network.compression import Compressor, StochasticQuantizer
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import (
    GaussianClients,
    Outcome,
    batch_means_standard_error,
    fald_stationary_law,
    heterogeneous_gaussian_clients,
    random_recursion_law,
)

from ..algorithms.test_adaptation import (
    NOISE_SD,
    anisotropic_problem,
    check_chains_against_preconditioned_law,
    matrix_root,
    preconditioned,
    run,
)
from ..models import gaussian_regression, gaussian_regression_for_nuts, sorted_regression

Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
#: the conjugate regression written with pyro.subsample and as a NUTS user writes it: the same exact law
FORMS = [gaussian_regression, gaussian_regression_for_nuts]


# ----------------------------------------------------------------------------------- the pure rule
def gaussian_state(num_chains=2, b=3, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    clients = GaussianClients(
        torch.eye(d).expand(b, d, d) * torch.rand(b, 1, 1, generator=g) + torch.eye(d),
        torch.randn(b, d, generator=g),
    )
    server = torch.randn(num_chains, d, generator=g)
    memory = torch.randn(num_chains, b, d, generator=g)
    state = qlsd.QlsdState(
        server, memory, torch.randn(num_chains, d, generator=g), torch.zeros(num_chains, b, d)
    )
    return clients, state


def uncompressed_step(state, clients, noise, active, step):
    """One LSD step (no compression, no control variate) with memory rate 0.5."""
    network = InProcessNetwork(clients.num_clients, clients.dim, state.server.shape[0])
    return qlsd.step(
        state,
        clients.gradients,
        noise,
        None,
        active,
        network,
        Compressor(),
        step_size=step,
        memory_rate=0.5,
        control_variate=None,
    )


def test_uncompressed_full_participation_is_langevin_on_the_sum_whatever_the_memory():
    # LSD: g = sum_i (H^i - eta^i) + sum_i eta^i = sum_i grad U^i(theta) exactly, so the memory never matters
    clients, state = gaussian_state()
    noise = torch.randn(2, 2)
    active = torch.ones(2, 3, dtype=torch.bool)
    step = torch.tensor(0.1)
    new = uncompressed_step(state, clients, noise, active, step)
    total = clients.gradients(state.server[:, None, :].expand(-1, 3, -1)).sum(-2)
    torch.testing.assert_close(new.server, state.server - step * total + (2 * step).sqrt() * noise)
    # the memory rule: eta <- eta + alpha (H - eta) for every (active) client
    grads = clients.gradients(state.server[:, None, :].expand(-1, 3, -1))
    torch.testing.assert_close(new.memory, state.memory + 0.5 * (grads - state.memory))


def test_partial_participation_scales_and_the_empty_set_steps_with_the_memories():
    clients, state = gaussian_state()
    active = torch.tensor([[True, False, True], [False, False, False]])
    step, noise = torch.tensor(0.1), torch.zeros(2, 2)
    new = uncompressed_step(state, clients, noise, active, step)
    uploads = clients.gradients(state.server[:, None, :].expand(-1, 3, -1)) - state.memory
    # chain 0: b / |A| = 3 / 2 times the active uploads, plus every memory
    g0 = 1.5 * (uploads[0, 0] + uploads[0, 2]) + state.memory[0].sum(0)
    torch.testing.assert_close(new.server[0], state.server[0] - step * g0)
    # chain 1: nobody active, g = the memories' sum; memories unchanged (the pure rule: the iterations' sets
    # are never empty, see test_participation_coins_follow_the_independent_coins_given_a_set_that_is_not_...)
    torch.testing.assert_close(new.server[1], state.server[1] - step * state.memory[1].sum(0))
    torch.testing.assert_close(new.memory[1], state.memory[1])
    torch.testing.assert_close(new.memory[0, 1], state.memory[0, 1])  # inactive client: unchanged
    torch.testing.assert_close(new.memory[0, 0], state.memory[0, 0] + 0.5 * uploads[0, 0])


def test_control_variates_estimates():
    clients, state = gaussian_state()
    network = InProcessNetwork(3, 2, 2)
    state = state._replace(reference_grads=torch.randn(2, 3, 2))
    at = lambda p: clients.gradients(p[:, None, :].expand(-1, 3, -1))  # noqa: E731
    expected = at(state.server) - at(state.reference) + state.reference_grads
    torch.testing.assert_close(qlsd.estimates(state, clients.gradients, "svrg", network), expected)
    torch.testing.assert_close(qlsd.estimates(state, clients.gradients, None, network), at(state.server))


# ----------------------------------------------------------------------------------- the kernel
@pytest.mark.slow
@pytest.mark.parametrize("levels", [None, 2**16])
def test_fixed_point_with_exact_gradients_has_the_exact_ula_law(levels):
    # LSD⋆ with full local batches: H^i = grad U^i(theta) - grad U^i(theta_star), summing to grad U(theta):
    # the server is ULA on U with step gamma m, a Gaussian AR(1) whose law is FALD's with one client holding
    # the whole potential. QLSD⋆ at s = 2^16 adds quantisation noise of relative variance omega ~ 3e-5: within
    # the Monte Carlo error of these 4 x 4000 draws.
    x, y, clients, exact = anisotropic_problem()
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD),
        clients,
        control_variate="fixed_point",
        quantization_levels=levels,
        gradient_mode="traced",
        thinning=1,  # consecutive iterations: the law of the chain itself
    )
    pyro.set_rng_seed(0)
    mcmc = run(kernel, (x, y), num_samples=4000, warmup=200, num_chains=4)
    chains = mcmc.get_samples(group_by_chain=True)["w"]
    chosen = kernel.adaptation
    whole = GaussianClients(exact.precisions.sum(0, keepdim=True), exact.posterior()[0][None])
    law_y = fald_stationary_law(preconditioned(whole, chosen.preconditioner), chosen.step_size, 1.0, 1.0)
    _, law_cov = check_chains_against_preconditioned_law(chains, law_y, chosen.preconditioner)
    # the automatic step keeps the law within the design's 10% of the posterior on every variance
    ratio = law_cov.diagonal() / exact.posterior()[1].diagonal()
    assert (ratio <= 1 + adaptation.VARIANCE_TARGET + 1e-9).all()


def check_the_posterior_within_the_step_budget(mcmc, mean, covariance):
    """Four chains of an unbiased estimate on a quadratic potential: their mean is the posterior's (within
    batch-means standard errors), every variance within the automatic step's budget (10%, for the
    discretisation and the gradient noise together) and a few percent of Monte Carlo error (the sample
    variance of some 20,000 correlated draws)."""
    chains = mcmc.get_samples(group_by_chain=True)["w"]
    se = torch.stack([batch_means_standard_error(c) for c in chains]).square().mean(0).sqrt() / 2
    draws_mean = chains.mean(1).mean(0)
    assert ((draws_mean - mean).abs() <= Z * se).all(), (draws_mean, mean, se)
    ratio = torch.stack([c.var(0) for c in chains]).mean(0) / covariance.diagonal()
    assert (ratio >= 0.85).all() and (ratio <= 1 + adaptation.VARIANCE_TARGET + 0.15).all(), ratio


@pytest.mark.slow
@pytest.mark.parametrize("regression", FORMS, ids=["pyro.subsample", "written for NUTS"])
def test_qlsd_plus_plus_with_partial_participation_matches_the_posterior(regression):
    # QLSD++ (s = 2^4, snapshots every 10 iterations, memory), minibatches of 5, each client present with
    # probability 0.5: g is an unbiased estimate of grad U and U is quadratic, so the stationary mean is the
    # posterior mean exactly (checked with batch-means standard errors); every variance is inflated by at most
    # the automatic step's budget, 10% for the discretisation and the gradient noise together
    x, y, clients, exact = anisotropic_problem()
    mean, covariance = exact.posterior()
    kernel = QlsdKernel(
        regression(NOISE_SD),
        clients,
        control_variate="svrg",
        snapshot_every=10,
        quantization_levels=2**4,
        participation=0.5,
        batch_size=5,
        gradient_mode="traced",
        thinning=1,  # consecutive iterations, as many as before the thinning was automatic
    )
    pyro.set_rng_seed(0)
    mcmc = run(kernel, (x, y), num_samples=6000, warmup=200, num_chains=4)
    check_the_posterior_within_the_step_budget(mcmc, mean, covariance)
    assert kernel.current_memory_rate() == pytest.approx(1 / (StochasticQuantizer(16).omega(3) + 1))


def test_bits_participation_and_snapshots_are_counted():
    x, y, clients, _ = anisotropic_problem()
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD),
        clients,
        step_size=1e-5,
        control_variate="svrg",
        snapshot_every=4,
        quantization_levels=2**4,
        participation=0.5,
        gradient_mode="traced",
    )
    pyro.set_rng_seed(0)
    mcmc = run(kernel, (x, y), num_samples=20, warmup=0)
    stats = kernel.sample_stats()
    active = stats["active_clients"]
    assert ((0 <= active) & (active <= 3)).all() and 0 < active.sum() < 60
    message = StochasticQuantizer(2**4).bits(3)
    # each iteration's cost rounded to whole bits, then accumulated
    np.testing.assert_array_equal(stats["uploaded_bits"], np.cumsum(np.rint(active * message)))
    # theta to every active client, and to all 3 clients after iterations 3, 7, 11, ... (snapshots)
    snapshots = (np.arange(1, 21) % 4 == 0).astype(int)
    np.testing.assert_array_equal(stats["snapshot"], snapshots.astype(bool))
    downloaded = np.cumsum(active * 32 * 3 + snapshots * 32 * 3 * 3)
    np.testing.assert_array_equal(stats["downloaded_bits"], downloaded)
    assert mcmc.diagnostics()["uploaded bits"] == {"chain 0": int(stats["uploaded_bits"][-1])}
    assert kernel.logging()["Mbits down"] == f"{downloaded[-1] / 1e6:.3g}"


# ----------------------------------------------------------------------------------- partial participation
def participation_law(clients, step, participation, conditioned=True):
    """The exact stationary law of LSD (exact local gradients, no compression) with step ``step`` on Gaussian
    ``clients``: the active set A is random and independent of the past, and given A the step is linear,
    x' = (I - step (b/|A|) sum_A A_i) x + step (b/|A|) sum_A A_i mu_i + sqrt(2 step) Z, one outcome of a
    random linear recursion per set. ``conditioned``: A drawn from the independent coins' law given A not
    empty (the algorithm's); else with the empty set a noise-only step (the rule before, for the tests'
    power)."""
    b, d = clients.num_clients, clients.dim
    eye = torch.eye(d, dtype=clients.means.dtype)
    some = 1 - (1 - participation) ** b
    outcomes = []
    for k in range(0 if not conditioned else 1, b + 1):
        for subset in itertools.combinations(range(b), k):
            prob = participation**k * (1 - participation) ** (b - k) / (some if conditioned else 1.0)
            chosen = list(subset)
            precision = b / max(k, 1) * clients.precisions[chosen].sum(0)
            shift = b / max(k, 1) * (clients.precisions[chosen] @ clients.means[chosen, :, None]).sum(0)[:, 0]
            outcomes.append(Outcome(prob, eye - step * precision, step * shift, 2 * step * eye))
    return random_recursion_law(outcomes, eye)


def test_participation_coins_follow_the_independent_coins_given_a_set_that_is_not_empty():
    # 3 clients at p = 0.2: the empty set (probability 0.512) is drawn again, so each of the 7 other sets has
    # its independent-coins probability over 1 - 0.8^3; 200 000 sets, each frequency within Z binomial
    # standard errors. With p = 1 every client, and no randomness drawn.
    rng = Randomness(0)
    coins = qlsd.participation_coins(rng, 0.2, 100_000, 2, 3)
    assert coins.any(-1).all()
    codes = (coins * np.array([1, 2, 4])).sum(-1).ravel()
    frequencies = np.bincount(codes, minlength=8) / codes.size
    sizes = np.array([bin(c).count("1") for c in range(8)])
    expected = 0.2**sizes * 0.8 ** (3 - sizes) / (1 - 0.8**3)
    expected[0] = 0.0
    se = np.sqrt(expected * (1 - expected) / codes.size)
    assert (np.abs(frequencies - expected) <= Z * se + 1e-12).all(), (frequencies, expected)
    # the sets found not empty are the independent coins' own draws
    first = Randomness(0).coins(0.2, 100_000, 2, 3)
    kept = first.any(-1)
    np.testing.assert_array_equal(coins[kept], first[kept])
    state = Randomness(0).host.bit_generator.state
    assert qlsd.participation_coins(rng := Randomness(0), 1.0, 5, 2, 3).all()
    assert rng.host.bit_generator.state == state
    # the first active client of a redrawn set: P(J <= j) = (1 - 0.8^(j+1)) / (1 - 0.8^3) at the quantiles
    quantiles = (1 - 0.8 ** np.arange(1, 4)) / (1 - 0.8**3)
    np.testing.assert_array_equal(qlsd.first_active(quantiles - 1e-9, 0.2, 3), [0, 1, 2])
    np.testing.assert_array_equal(qlsd.first_active(quantiles[:2] + 1e-9, 0.2, 3), [1, 2])


@pytest.mark.slow
@pytest.mark.parametrize(
    "participation, step_size, num_samples",
    [(0.2, None, 6000), (0.01, 0.2, 5000)],
    ids=["p=0.2 automatic", "p=0.01 given step"],
)
def test_partial_participation_with_few_clients_has_the_exact_law(participation, step_size, num_samples):
    # LSD on 3 Gaussian clients, each active with probability p: given the set A the step is linear, so the
    # chain is a random linear recursion whose stationary mean and covariance are exact (participation_law,
    # one outcome per set, A conditioned on being non-empty). The iterations whose set was empty used to step
    # with no gradient: sds 1 / sqrt(1 - (1 - p)^3) times too wide, 1.46x and 5.9x here, far outside the
    # tolerances below. The automatic step (the reproducer) and a given step with the Laplace
    # preconditioner, whose chain mixes within ~6 iterations. Means against the law's exact standard error;
    # covariances (about the law's mean) against batch-means standard errors, the chain being a Gaussian
    # mixture, pooled over the 4 chains.
    x, y, clients, exact = anisotropic_problem()
    options = {"thinning": 1}  # consecutive iterations: the law of the chain itself
    if step_size is not None:
        options.update(step_size=step_size, preconditioner=1 / exact.precisions.sum(0).diagonal())
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD), clients, participation=participation, gradient_mode="traced", **options
    )
    pyro.set_rng_seed(0)
    mcmc = run(kernel, (x, y), num_samples=num_samples, warmup=500, num_chains=4)
    chains = mcmc.get_samples(group_by_chain=True)["w"]
    step = kernel.current_step_size
    inverse_mass = kernel.adaptation.preconditioner if step_size is None else options["preconditioner"]
    law_y = participation_law(preconditioned(exact, inverse_mass), step, participation)
    root = matrix_root(inverse_mass)
    mean, cov = root @ law_y.mean, root @ law_y.cov @ root
    num_chains = chains.shape[0]
    law = law_y._replace(mean=mean, cov=cov, read=root @ law_y.read)
    mean_se = law.mean_standard_error(num_samples) / num_chains**0.5
    assert ((chains.mean(1).mean(0) - mean).abs() <= Z * mean_se).all(), (
        chains.mean(1).mean(0),
        mean,
        mean_se,
    )
    centred = chains - mean
    products = centred[..., :, None] * centred[..., None, :]  # [C, K, d, d]
    draws_cov = products.mean(1).mean(0)
    cov_se = torch.stack([batch_means_standard_error(p) for p in products]).square().mean(0).sqrt()
    cov_se = cov_se / num_chains**0.5
    assert ((draws_cov - cov).abs() <= Z * cov_se).all(), (draws_cov, cov, cov_se)
    # the rule before (noise-only steps when no client is active) is far outside these tolerances
    before = participation_law(preconditioned(exact, inverse_mass), step, participation, conditioned=False)
    before_cov = root @ before.cov @ root
    assert ((before_cov - cov).diagonal() > Z * cov_se.diagonal()).all()
    assert ((before_cov.diagonal() / cov.diagonal()).sqrt() >= 1.4).all()
    assert (kernel.sample_stats()["active_clients"] >= 1).all()


def test_participation_whose_noise_shrinks_the_automatic_step_is_named_before_the_run():
    # 3 Gaussian clients whose means differ by ~3 posterior sds: one or two of them stand for all three most
    # iterations at p = 0.2, and the random set's noise alone makes the automatic step ~20 times smaller than
    # with every client (Qlsd.participation_noise, exact on Gaussian clients: b^2 E[1/k - 1/b] S^2). On the
    # anisotropic split (~4 times) nothing is said.
    hetero = heterogeneous_gaussian_clients(3, 2, mean_scale=3.0)
    model, args = hetero.pyro_model(10.0)
    kernel = QlsdKernel(model, participation=0.2, gradient_mode="traced", thinning=1)
    pyro.set_rng_seed(0)
    with pytest.warns(
        UserWarning, match=r"participation=0.2 and 3 clients .* 1.23 clients per iteration"
    ) as w:
        run(kernel, args, num_samples=2, warmup=0)
    chosen = kernel.adaptation
    noise = kernel.settings.participation_noise(chosen, kernel.current_run)
    shrink = 1 + noise / ((1 + adaptation.VARIANCE_TARGET) * chosen.stiffness)
    (message,) = [str(c.message) for c in w if "participation=" in str(c.message)]
    assert shrink > PARTICIPATION_WARNING and f"the automatic step {shrink:.3g} times smaller" in message
    # with exact gradients and no compression the set is the estimate's only noise: the warm-up measured it
    # from 64 draws at each of 4 points, a relative standard error of sqrt((kurtosis - 1) / 256), at most
    # 0.125 for a kurtosis up to 5
    assert abs(chosen.noise / noise - 1) <= Z * 0.125, (chosen.noise, noise)
    x, y, clients, _ = anisotropic_problem()
    quiet = QlsdKernel(gaussian_regression(NOISE_SD), clients, participation=0.2, gradient_mode="traced")
    pyro.set_rng_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(quiet, (x, y), num_samples=2, warmup=0)
    assert not [c for c in caught if "participation=" in str(c.message)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"quantization_levels": 0}, "quantization_levels must be a positive integer"),
        ({"participation": 0.0}, r"participation must be a number in \(0, 1\]"),
        ({"participation": 1.5}, r"participation must be a number in \(0, 1\]"),
        ({"snapshot_every": 5}, "snapshot_every is the period of control_variate=.svrg.'s snapshots"),
        ({"control_variate": "saga"}, "control_variate must be one of"),
        ({"memory_rate": 2.0}, r"memory_rate must be in \[0, 1\]"),
        ({"quantization_levels": "fewest"}, "or 'auto' \\(chosen by the warm-up\\)"),
        ({"quantization_levels": "auto", "step_size": 0.01}, "quantization_levels='auto' is chosen from"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QlsdKernel(gaussian_regression(NOISE_SD), **kwargs)


def test_fixed_point_of_the_wrong_shape_is_refused_and_a_given_one_is_used():
    x, y, clients, exact = anisotropic_problem()
    bad = QlsdKernel(
        gaussian_regression(NOISE_SD), clients, control_variate="fixed_point", fixed_point=torch.zeros(2)
    )
    with pytest.raises(ValueError, match=r"fixed_point has shape \(2,\); the model has 3 unconstrained"):
        run(bad, (x, y), num_samples=2, warmup=0)
    point = exact.posterior()[0]
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD),
        clients,
        step_size=1e-4,
        control_variate="fixed_point",
        fixed_point=point,
        gradient_mode="traced",
    )
    run(kernel, (x, y), num_samples=2, warmup=0)
    torch.testing.assert_close(kernel.runner.state[2], point.expand(1, 3))
    assert math.isclose(kernel.current_step_size, 1e-4)


@pytest.mark.parametrize(
    "options",
    [{}, {"control_variate": "fixed_point"}, {"control_variate": "svrg", "snapshot_every": 7}],
    ids=["LSD", "LSD-star", "LSD++"],
)
def test_prior_on_the_server_gives_the_same_chain(options):
    # sum_i varpi^i grad U^0 = grad U^0: keeping the prior on the server (clients with varpi^i = 0, the
    # server adding grad U^0 itself) changes nothing in LSD's estimate, its mode or its curvature, so the
    # same seed gives the same draws, to rounding. Around a fixed point the server's term takes the control
    # variate too: the clients' likelihood gradients do not sum to 0 at the mode, the posterior's do.
    x, y, clients, _ = anisotropic_problem()
    draws = []
    for on_server in (False, True):
        kernel = QlsdKernel(
            gaussian_regression(NOISE_SD),
            clients,
            prior_on_server=on_server,
            gradient_mode="traced",
            **options,
        )
        pyro.set_rng_seed(0)
        draws.append(run(kernel, (x, y), num_samples=50, warmup=10).get_samples()["w"])
        assert kernel.potential.prior_on_server == on_server
    torch.testing.assert_close(draws[1], draws[0], rtol=0, atol=1e-8)
    assert not torch.equal(draws[0][0], draws[0][1])


def test_prior_on_the_server_needs_a_server():
    with pytest.raises(ValueError, match="FaldKernel has no server step to add the prior to"):
        FaldKernel(gaussian_regression(NOISE_SD), prior_weights="server")
    with pytest.raises(ValueError, match="leave prior_weights out"):
        QlsdKernel(gaussian_regression(NOISE_SD), prior_on_server=True, prior_weights="uniform")


def test_svrg_with_full_local_batches_is_the_exact_gradient_without_snapshots():
    # H^i = grad U^i(theta) - grad U^i(zeta) + grad U^i(zeta) = grad U^i(theta): QLSD++ with full local
    # batches evaluates theta alone and takes no snapshot, and its chain is QLSD's with the same memory rate
    x, y, clients, _ = anisotropic_problem()
    options = dict(quantization_levels=2**4, step_size=1e-3, batch_size="full", gradient_mode="traced")
    rate = 1 / (StochasticQuantizer(16).omega(3) + 1)

    def draws(**control):
        pyro.set_rng_seed(5)
        kernel = QlsdKernel(gaussian_regression(NOISE_SD), clients, **options, **control)
        return run(kernel, (x, y), num_samples=50, warmup=0).get_samples()["w"], kernel

    svrg, kernel = draws(control_variate="svrg")
    assert kernel.algorithm.snapshot_every is None and "snapshot" not in kernel.sample_stats()
    assert kernel.algorithm.gradient_evaluations(minibatches=False) == 1
    plain, _ = draws(memory_rate=rate)
    torch.testing.assert_close(svrg, plain, rtol=0, atol=1e-12)


def test_memory_rate_snapshot_and_server_gradient_rules():
    # Algorithm 2: alpha = 1 / (omega + 1) for QLSD++, no memory otherwise
    assert qlsd.memory_rate("svrg", 3.0) == 0.25
    assert qlsd.memory_rate("fixed_point", 3.0) == qlsd.memory_rate(None, 3.0) == 0.0
    server, reference = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    state = qlsd.QlsdState(server, torch.zeros(1, 3, 2), reference, torch.zeros(1, 3, 2))
    # the prior's gradient at theta, minus at the fixed point under QLSD*'s control variate
    torch.testing.assert_close(qlsd.server_gradient(lambda p: 2 * p, state, None), 2 * server)
    torch.testing.assert_close(
        qlsd.server_gradient(lambda p: 2 * p, state, "fixed_point"), 2 * (server - reference)
    )
    # a snapshot moves the reference to theta, with the clients' full gradients there
    snapped = qlsd.snapshot(state, lambda p: p[:, None, :].expand(-1, 3, -1) * 3)
    torch.testing.assert_close(snapped.reference, server)
    torch.testing.assert_close(snapped.reference_grads, 3 * server[:, None, :].expand(-1, 3, -1))


def upload_rate_per_langevin_time(kernel, mcmc) -> float:
    """The bits uploaded per iteration of the draws (warm-up's excluded) over the step: per unit of the
    Langevin time the chains travel."""
    bits = pyro_fed.to_inference_data(mcmc, log_likelihood=False).sample_stats["uploaded_bits"].values[0]
    per_iteration = (bits[-1] - bits[0]) / ((len(bits) - 1) * kernel.current_thinning)
    return per_iteration / kernel.current_step_size


@pytest.mark.parametrize("split", ["sorted", "iid"])
@pytest.mark.parametrize("control_variate", [None, "svrg"], ids=["QLSD", "QLSD++"])
def test_automatic_levels_upload_fewer_bits_per_langevin_time(control_variate, split):
    # a conjugate regression over 6 clients: the quantiser's noise is small next to the posterior's
    # curvature, so the warm-up compresses, shortens its step by little, and the chains cover their Langevin
    # time for fewer bits than uncompressed
    x, y, clients, _ = sorted_regression(60, 6)
    clients = clients if split == "sorted" else torch.arange(60) % 6
    runs = {}
    for setting in (None, "auto"):
        pyro.set_rng_seed(0)
        kernel = QlsdKernel(
            gaussian_regression(NOISE_SD),
            clients,
            quantization_levels=setting,
            control_variate=control_variate,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # short runs: the end-of-run checks ask for more draws
            runs[setting] = kernel, run(kernel, (x, y), num_samples=50, warmup=50)
    (plain, plain_run), (auto, auto_run) = runs[None], runs["auto"]
    assert auto.current_quantization_levels in levels.LEVELS[:-1]
    assert auto.adaptation.quantization_levels == auto.current_quantization_levels
    assert 0.9 * plain.current_step_size <= auto.current_step_size <= plain.current_step_size
    assert upload_rate_per_langevin_time(auto, auto_run) < upload_rate_per_langevin_time(plain, plain_run)


@pytest.mark.slow
def test_automatic_levels_keep_the_warm_ups_accuracy():
    # QLSD++ with the levels, minibatch, step and thinning the warm-up chose: g is unbiased and U quadratic,
    # so the draws' mean is the posterior's (batch-means standard errors), and the step keeps every
    # variance within the budget the noise of the chosen levels shares, 10%, as at fixed levels (above)
    x, y, clients, exact = anisotropic_problem()
    mean, covariance = exact.posterior()
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD), clients, control_variate="svrg", quantization_levels="auto"
    )
    pyro.set_rng_seed(0)
    mcmc = run(kernel, (x, y), num_samples=5000, warmup=200, num_chains=4)
    assert kernel.current_quantization_levels is not None  # it compresses
    check_the_posterior_within_the_step_budget(mcmc, mean, covariance)
    omega = StochasticQuantizer(kernel.current_quantization_levels).omega(3)
    assert kernel.current_memory_rate() == pytest.approx(1 / (omega + 1))  # the chosen levels' memories


def test_automatic_levels_stay_and_shorten_the_step_measured_again_from_the_draws(monkeypatch):
    # every window of the warm-up replaces the preconditioner here (no spread is within chance): the step
    # it measures again, uncompressed, is shortened for the noise of the levels chosen before, which stay
    # (the iteration is prepared for them), the thinning kept; the adaptation records them (a checkpoint
    # restores them from it)
    monkeypatch.setattr(adaptation, "DENSE_CONDITION", 0.0)
    kept = []
    original = levels.keep_levels

    def recorded(settings, chosen_levels, chosen, run):
        kept.append((chosen_levels, chosen, original(settings, chosen_levels, chosen, run)))
        return kept[-1][2]

    monkeypatch.setattr(levels, "keep_levels", recorded)
    x, y, clients, _ = sorted_regression(60, 6)
    kernel = QlsdKernel(
        gaussian_regression(NOISE_SD), clients, quantization_levels="auto", control_variate="svrg"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(kernel, (x, y), num_samples=20, warmup=120)
    assert len(kept) == 2
    for chosen_levels, measured, renewed in kept:
        assert chosen_levels == kernel.current_quantization_levels is not None
        assert renewed.quantization_levels == chosen_levels
        assert renewed.step_size <= measured.step_size and renewed.thinning == measured.thinning
    assert kernel.adaptation is kept[-1][2]
