"""D-ULA and SGLD: the average is exact ULA on a complete graph, moments on a ring with decaying steps,
bits along the edges, the step-size condition, and SGLD as the one-agent case."""

import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import MCMC

import pyro_fed
from pyro_fed import DulaKernel, SgldKernel, testing
from pyro_fed.algorithms import adaptation, dula, dula_step
from pyro_fed.kernels import warmup
from pyro_fed.network.graphs import make_graph
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import batch_means_standard_error, regression_clients

from ..algorithms.test_adaptation import NOISE_SD, anisotropic_problem, run
from ..models import gaussian_regression, logistic_data, logistic_model, regression_data, scaled_regression

Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number


def drift_at(kernel: DulaKernel, step: float, **options) -> float:
    """The drift of the average that the agents' disagreement causes at ``step`` after a kernel's automatic
    run (:func:`~pyro_fed.algorithms.dula_step.disagreement_drift`, what the automatic step is cut for)."""
    graph, consensus = kernel.graph, kernel.algorithm.consensus_size
    return dula_step.disagreement_drift(
        graph, consensus, kernel.adaptation, step, kernel.current_run, **options
    )


def test_a_dense_step_decays_as_a_matrix_step_and_its_root():
    # alpha_k = a M / (k0 + k + 1)^delta: the drift matrix scales by the factor, its root by the factor's root
    factor_of = (3.0 + 1.0 + 1.0) ** -0.5  # k = 3, k0 = 1, delta = 0.5
    covariance = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    step = adaptation.preconditioned_step(0.2, covariance)
    alpha, _ = dula.step_sizes(
        torch.tensor(3.0, dtype=torch.float64),
        step,
        0.1,
        step_decay=0.5,
        consensus_decay=0.0,
        step_offset=1.0,
    )
    drift, root = alpha
    torch.testing.assert_close(drift, 0.2 * factor_of * covariance)
    torch.testing.assert_close(root @ root.T, 0.2 * factor_of * covariance)


@pytest.mark.parametrize("name", ["ring", "path", "star", "complete"])
def test_the_default_consensus_step_contracts_the_disagreement_fastest(name):
    # one exchange multiplies the disagreement along the Laplacian's eigenvector of eigenvalue lambda by
    # 1 - beta lambda: 2 / (lambda_2 + lambda_max) makes the slowest of them, over lambda_2..lambda_max, the
    # smallest; on a complete graph it is 1 / n, which averages in one exchange
    graph = make_graph(name, 10)
    beta = dula.Dula().consensus_for(graph)
    eigenvalues = torch.linalg.eigvalsh(graph.laplacian)[1:]

    def slowest(b):
        return float((1 - b * eigenvalues).abs().max())

    assert all(slowest(beta) <= slowest(beta * factor) + 1e-12 for factor in (0.5, 0.9, 1.1, 2.0))
    assert slowest(beta) < slowest(1 / graph.lambda_max) or name == "complete"
    if name == "complete":
        assert beta == pytest.approx(0.1)
        mixed = torch.eye(10, dtype=torch.float64) - beta * graph.laplacian
        torch.testing.assert_close(mixed, torch.full((10, 10), 0.1, dtype=torch.float64))
    assert dula.Dula(consensus_size=0.15).consensus_for(graph) == 0.15


def test_a_consensus_step_at_which_the_exchange_diverges_is_refused_before_the_run():
    # on a ring of 6 agents (lambda_max = 4), beta = 0.5 multiplies the alternating disagreement by -1 at
    # every exchange, 1.0 by -3: the agents' iterates ran off (draws of 1e4 to 1e5 on a unit-scale
    # posterior) and the warnings blamed the step_size; refused at set-up, naming the bound
    data = logistic_data(num_data=30)

    def sample(beta):
        kernel = DulaKernel(logistic_model, 6, consensus_size=beta, step_size=1e-3)
        MCMC(kernel, num_samples=5, warmup_steps=5, disable_progbar=True).run(*data)

    for beta in (0.5, 1.0):
        with pytest.raises(
            ValueError, match=r"consensus_size=.* makes the agents' exchange diverge .* below 2 "
        ):
            sample(beta)
    sample(0.49)


def test_mixing_is_simultaneous():
    graph = make_graph("path", 3)
    w = torch.tensor([[0.0], [3.0], [6.0]], dtype=torch.float64)
    # w_i - beta sum_j a_ij (w_i - w_j) with every agent's old value
    network = InProcessNetwork()
    mixed = dula.mix(w, dula.laplacian_rows(network, graph), graph, network, torch.tensor(0.25))
    torch.testing.assert_close(mixed, torch.tensor([[0.75], [3.0], [5.25]], dtype=torch.float64))
    # the average is kept
    assert mixed.mean() == pytest.approx(w.mean())


def test_several_exchanges_per_step_mix_by_the_power_of_one():
    # K rounds: the agents' iterates are multiplied by (I - beta L)^K before the Langevin step, whose
    # gradients are taken at the agents' own (unmixed) points
    graph, n = make_graph("ring", 5), 5
    g = torch.Generator().manual_seed(1)
    w, noise = torch.randn(2, n, 3, generator=g), torch.randn(2, n, 3, generator=g)
    network = InProcessNetwork(n, 3, 2)
    rows, alpha, beta = dula.laplacian_rows(network, graph), torch.tensor(1e-3), torch.tensor(0.3)

    def gradients(points):
        return points.square()

    new = dula.step(dula.DulaState(w), gradients, noise, graph, rows, alpha, beta, network, 3).clients
    power = torch.linalg.matrix_power(torch.eye(n) - 0.3 * graph.laplacian.to(w), 3)
    expected = power @ w - alpha * n * gradients(w) + (2 * alpha * n).sqrt() * noise
    torch.testing.assert_close(new, expected)


def test_the_average_takes_an_exact_ula_step_with_the_same_noise():
    # 1^T L = 0: for any graph and beta, w_bar' = w_bar - alpha sum_i grad U_i(w_i) + sqrt(2 alpha) v_bar,
    # v_bar = mean_i sqrt(n) Z_i ~ N(0, I): at consensus (w_i = w_bar) this is centralized ULA, same noise
    _, _, _, exact = anisotropic_problem(num_clients=4)
    n = 4
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, n, 3, generator=g)
    alpha = torch.tensor(1e-3)
    for graph, start in (
        (make_graph("ring", n), torch.randn(2, n, 3, generator=g)),
        (make_graph("complete", n), torch.randn(2, 1, 3, generator=g).expand(2, n, 3)),
    ):
        network = InProcessNetwork(n, 3, 2)
        rows = dula.laplacian_rows(network, graph)
        new = dula.step(
            dula.DulaState(start), exact.gradients, noise, graph, rows, alpha, torch.tensor(0.3), network
        )
        grads = exact.gradients(start).sum(1)
        expected = start.mean(1) - alpha * grads + (2 * alpha).sqrt() * (n**0.5 * noise).mean(1)
        torch.testing.assert_close(dula.position(new, network), expected)
    # at consensus the agents' gradients sum to the full one at the average: the ULA step on U exactly
    full = exact.gradients(start.mean(1)[:, None, :].expand(-1, n, -1)).sum(1)
    torch.testing.assert_close(grads, full)
    # the decaying steps
    alpha_k, beta_k = dula.step_sizes(
        torch.tensor(3.0), 0.2, 0.5, step_decay=0.55, consensus_decay=0.05, step_offset=230
    )
    assert float(alpha_k) == pytest.approx(0.2 / 234**0.55) and float(beta_k) == pytest.approx(0.5 / 4**0.05)


@pytest.mark.slow
def test_ring_with_decaying_steps_matches_the_posterior():
    # 3 agents on a ring, full local batches, automatic a, the paper's decays with k_0 = 2000: over the run
    # the step shrinks 2.2-fold from a stable first step (a shrinking step mixes ever more slowly: the offset
    # keeps the run's ESS useful). Mean within batch-means standard errors; variances within the first step's
    # 10% budget plus ~15% of Monte Carlo error
    x, y, clients, exact = anisotropic_problem()
    mean, covariance = exact.posterior()
    kernel = DulaKernel(
        gaussian_regression(NOISE_SD),
        clients,
        schedule="decaying",
        step_offset=2000,
        gradient_mode="traced",
        thinning=1,  # consecutive iterations: the decay's schedule as the test was sized for
    )
    pyro.set_rng_seed(0)
    chains = run(kernel, (x, y), num_samples=6000, warmup=500, num_chains=4).get_samples(group_by_chain=True)[
        "w"
    ]
    se = torch.stack([batch_means_standard_error(c) for c in chains]).square().mean(0).sqrt() / 2
    assert ((chains.mean(1).mean(0) - mean).abs() <= Z * se).all()
    ratio = torch.stack([c.var(0) for c in chains]).mean(0) / covariance.diagonal()
    assert (ratio >= 0.85).all() and (ratio <= 1.11 + 0.15).all(), ratio
    stats = kernel.sample_stats()
    assert (stats["consensus_error"] >= 0).all()


@pytest.mark.parametrize("rounds", [1, 2])
def test_bits_along_the_edges_and_consensus_statistics(rounds):
    x, y, clients, _ = anisotropic_problem()
    kernel = DulaKernel(
        gaussian_regression(NOISE_SD), clients, graph="path", gradient_mode="traced", consensus_rounds=rounds
    )
    mcmc = run(kernel, (x, y), num_samples=10, warmup=0)
    stats = kernel.sample_stats()
    # a path of 3 agents has 4 directed edges; d = 3 floats each, every exchange of every iteration
    # (thinning of them a draw)
    per_draw = 32 * 3 * 4 * rounds * kernel.current_thinning
    uploaded = stats["uploaded_bits"]
    np.testing.assert_array_equal(uploaded - uploaded[0], per_draw * np.arange(10))
    np.testing.assert_array_equal(stats["downloaded_bits"], stats["uploaded_bits"])
    assert stats["consensus_error"].shape == (10,)
    assert kernel.graph.lambda_max == pytest.approx(3.0)
    assert mcmc.diagnostics()["divergences"] == {"chain 0": []}


def test_recorded_agents_are_the_iterates_whose_average_is_the_draw():
    x, y = regression_data(30)
    pyro.set_rng_seed(0)
    kernel = DulaKernel(scaled_regression, 4, graph="ring", record_agents=True, gradient_mode="traced")
    mcmc = run(kernel, (x, y), num_samples=12, warmup=5, num_chains=2)
    data = pyro_fed.to_inference_data(mcmc, log_likelihood=False)
    agents, posterior = data.agents, data.posterior
    assert agents["w"].dims == ("chain", "draw", "agent", "w_dim_0") and agents["w"].shape == (2, 12, 4, 3)
    assert agents["sigma"].shape == (2, 12, 4) and (agents["sigma"].values > 0).all()
    assert "agents" not in data.sample_stats  # moved to its own group
    # the draw is the agents' average in the unconstrained space (sigma's is log sigma)
    np.testing.assert_allclose(agents["w"].values.mean(2), posterior["w"].values, rtol=1e-5, atol=1e-6)
    log_sigma = np.log(agents["sigma"].values)
    np.testing.assert_allclose(log_sigma.mean(2), np.log(posterior["sigma"].values), rtol=1e-5, atol=1e-6)
    # the consensus error is the agents' mean squared distance to that average
    unconstrained = np.concatenate([agents["w"].values, log_sigma[..., None]], -1)
    spread = np.square(unconstrained - unconstrained.mean(2, keepdims=True)).sum(-1).mean(-1)
    np.testing.assert_allclose(spread, data.sample_stats["consensus_error"].values, rtol=1e-4, atol=1e-9)


def test_step_size_condition_warns_and_bad_arguments():
    with pytest.warns(UserWarning, match="needs 1/2 \\+ consensus_decay < step_decay < 1"):
        DulaKernel(gaussian_regression(NOISE_SD), schedule="decaying", step_decay=0.5, consensus_decay=0.05)
    with pytest.raises(
        ValueError, match='step_decay, step_offset: a parameter of the decaying schedule.*schedule="decaying"'
    ):
        DulaKernel(gaussian_regression(NOISE_SD), step_decay=0.5, step_offset=10)
    with pytest.raises(ValueError, match="schedule='slow': use one of"):
        DulaKernel(gaussian_regression(NOISE_SD), schedule="slow")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DulaKernel(gaussian_regression(NOISE_SD))
    with pytest.raises(ValueError, match=r"step_decay must be a number in \[0, 1\)"):
        DulaKernel(gaussian_regression(NOISE_SD), schedule="decaying", step_decay=1.2)
    with pytest.raises(ValueError, match="SgldKernel is centralized"):
        SgldKernel(gaussian_regression(NOISE_SD), graph="ring")
    for rounds in (0, 1.5, True):
        with pytest.raises(ValueError, match="consensus_rounds must be a positive integer"):
            DulaKernel(gaussian_regression(NOISE_SD), consensus_rounds=rounds)
    with pytest.raises(ValueError, match="SgldKernel has one agent"):
        SgldKernel(gaussian_regression(NOISE_SD), consensus_rounds=2)


def test_sgld_is_one_agent_ula():
    x, y, _, exact = anisotropic_problem()
    kernel = SgldKernel(gaussian_regression(NOISE_SD), gradient_mode="traced")
    mcmc = run(kernel, (x, y), num_samples=20, warmup=10)
    assert kernel.potential.num_clients == 1 and kernel.graph.directed_edges == 0
    # the automatic step: a = 2 eps / (1 + eps) / stiffness of the whole potential (one agent, exact
    # gradients)
    assert kernel.current_step_size == pytest.approx(adaptation.STEP_TARGET / kernel.adaptation.stiffness)
    assert mcmc.get_samples()["w"].shape == (20, 3)
    # one agent has no neighbour: no bits and no rounds while sampling, only the warm-up's uploads
    diagnostics = kernel.diagnostics()
    assert diagnostics["communication rounds"] == 0
    assert (kernel.sample_stats()["uploaded_bits"] == diagnostics["uploaded bits"]).all()


def heterogeneous_ring(num_agents=6, num_data=120):
    """Agents holding ranges of the first feature of the 100x-scaled regression (their curvatures and their
    local posteriors differ), on a ring; the exact agents' potentials with D-ULA's uniform prior shares."""
    x, y, clients, _ = anisotropic_problem(num_data=num_data, num_clients=num_agents)
    exact = regression_clients(
        x, y, clients, NOISE_SD, prior_weights=torch.full((num_agents,), 1 / num_agents)
    )
    return x, y, clients, exact


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [1, 3])
def test_the_defaults_sample_a_heterogeneous_ring_within_the_targets(rounds):
    # the automatic constant step, shrunk for the ring's mixing: the exact stationary law of the chosen steps
    # (a linear recursion on Gaussian agents) meets the defaults' targets against the exact posterior, means
    # within 0.2 posterior sds and sds within 15% (the step is chosen for 0.1 and 10% in a diagonal model of
    # the agents, which this one is not), and the draws follow that law (thinned by 10 rather than the
    # automatic ~60: a shorter run, the same law); with three exchanges per step too, whose law is that of
    # (I - beta L)^3
    x, y, clients, exact = heterogeneous_ring()
    mean, covariance = exact.posterior()
    pyro.set_rng_seed(0)
    kernel = DulaKernel(
        gaussian_regression(NOISE_SD), clients, gradient_mode="traced", thinning=10, consensus_rounds=rounds
    )
    mcmc = run(kernel, (x, y), num_samples=1000, warmup=100, num_chains=4)
    chosen = kernel.adaptation
    law = testing.dula_stationary_law(
        exact,
        kernel.current_step_size,
        kernel.algorithm.consensus_size,
        kernel.graph.laplacian,
        chosen.preconditioner,
        consensus_rounds=rounds,
    )
    sd = covariance.diagonal().sqrt()
    assert ((law.mean - mean).abs() / sd).max() <= 0.2
    assert ((law.cov.diagonal().sqrt() / sd - 1).abs()).max() <= 0.15
    # with the preconditioned ULA step alone (what FALD averaging every iteration takes), this graph's
    # disagreement costs more: the consensus step is smaller
    assert (
        kernel.current_step_size
        < chosen.stiffness**-1 * adaptation.STEP_TARGET / kernel.potential.num_clients
    )
    # the draws, thinned by t, follow the law of the t-step recursion: means within Z exact standard errors
    draws = mcmc.get_samples()["w"]
    thinned = law._replace(
        mean_transition=torch.linalg.matrix_power(law.mean_transition, kernel.current_thinning)
    )
    se = thinned.mean_standard_error(len(draws) // 4) / 2  # 4 independent chains
    assert ((draws.mean(0) - law.mean).abs() <= Z * se).all()


def test_decaying_steps_that_freeze_the_chains_say_so():
    # the paper's decay from the automatic first step: the 2000 iterations after warm-up cover a few
    # relaxation times of the slowest direction (the step about 100 times smaller by the end), not the 200
    # that 100 independent draws need
    x, y, clients, _ = anisotropic_problem()
    pyro.set_rng_seed(0)
    kernel = DulaKernel(
        gaussian_regression(NOISE_SD), clients, schedule="decaying", thinning=20, gradient_mode="traced"
    )
    with pytest.warns(UserWarning, match="D-ULA's decaying steps, down to .* The chains barely move"):
        run(kernel, (x, y), num_samples=100, warmup=100)
    problems = kernel.end_of_run_checks["problems"]
    assert any(p.startswith("D-ULA's decaying steps") for p in problems)
    assert kernel.diagnostics()["end-of-run checks"] == problems


def test_the_agents_disagreement_on_a_curved_posterior_shrinks_the_step():
    # a logistic regression over 20 agents on a ring: each agent sits sqrt(2 alpha n) posterior sds from the
    # average, where the gradients of a curved potential no longer sum to the gradient at the average. The
    # quadratic model sees nothing (i.i.d. agents); the drift measured with the real gradients makes the step
    # smaller, to where it is within its target, and no smaller than needed (twice the step misses it)
    x, y = regression_data(2000, dim=2, seed=3)
    pyro.set_rng_seed(0)
    kernel = DulaKernel(logistic_model, 20, gradient_mode="traced")
    run(kernel, (x, (y > 0).double()), num_samples=10, warmup=0)
    chosen = kernel.adaptation
    ula = adaptation.STEP_TARGET / chosen.stiffness / 20  # the average's step with exact gradients
    assert kernel.current_step_size < ula / 4
    assert drift_at(kernel, kernel.current_step_size) <= dula_step.CONSENSUS_MEAN_TARGET
    assert drift_at(kernel, 3 * kernel.current_step_size) > dula_step.CONSENSUS_MEAN_TARGET
    # on a Gaussian target the noise's antithetic draws cancel exactly: without the data's pulls there is no
    # drift at any step, and with them the drift is linear in the step
    x, y, clients, _ = heterogeneous_ring()
    gaussian = DulaKernel(gaussian_regression(NOISE_SD), clients, gradient_mode="traced")
    run(gaussian, (x, y), num_samples=10, warmup=0)
    step = gaussian.current_step_size
    pulls = torch.zeros(2 * warmup.TYPICAL_POINTS, 6, 3, dtype=torch.float64)
    assert drift_at(gaussian, 10 * step, pulls=pulls) < 1e-6
    assert drift_at(gaussian, 10 * step) == pytest.approx(10 * drift_at(gaussian, step), rel=1e-6)


@pytest.mark.parametrize("rounds", [1, 3])
def test_the_drift_is_the_exact_stationary_mean_error_on_gaussian_agents(rounds):
    # agents holding different ranges of a regression's feature, on a ring: each is pulled toward its own
    # posterior, and their curvatures differ, so the average's stationary mean is off the posterior's in
    # proportion to the step. The drift that the automatic step is cut for (its data's pulls measured at the
    # typical points and their reflections) is that error: within 10% of the exact stationary law's largest
    # mean error in posterior sds at the chosen step and twice it, where the four typical points alone
    # measured 1.8 times it. The pulls leave out each agent's own pull back, alpha n times its curvature
    # (~8% of the consensus step's spectral gap at the chosen step), which grows with the step: at four times
    # it the drift is 19% above the error, on the cautious side. With three exchanges per step, the same
    # against the law of (I - beta L)^3
    x, y, clients, exact = heterogeneous_ring()
    mean, covariance = exact.posterior()
    pyro.set_rng_seed(0)
    kernel = DulaKernel(
        gaussian_regression(NOISE_SD), clients, gradient_mode="traced", consensus_rounds=rounds
    )
    run(kernel, (x, y), num_samples=10, warmup=100, num_chains=4)
    sd = covariance.diagonal().sqrt()
    for factor in (1, 2, 4):
        step = factor * kernel.current_step_size
        law = testing.dula_stationary_law(
            exact,
            step,
            kernel.algorithm.consensus_size,
            kernel.graph.laplacian,
            kernel.adaptation.preconditioner,
            consensus_rounds=rounds,
        )
        error = float(((law.mean - mean).abs() / sd).max())
        drift = drift_at(kernel, step, exchanges=rounds)
        if factor < 4:
            assert drift == pytest.approx(error, rel=0.1)
        else:
            assert error < drift < 1.25 * error


def skewed_regression():
    """The issue's small regression: N = 100, d = 3, split over 10 clients by a Dirichlet(0.5) skew of the
    response's quartiles (clients of 3 to 19 points, each mostly one quartile); a conjugate Gaussian model,
    whose agents' potentials (D-ULA's uniform prior shares) are exact."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100, 3, generator=generator)
    y = x @ torch.tensor([1.0, -0.5, 2.0]) + 0.5 * torch.randn(100, generator=generator)
    quartiles = torch.bucketize(y, torch.quantile(y, torch.tensor([0.25, 0.5, 0.75])))
    clients = pyro_fed.partition.dirichlet(quartiles, 10, alpha=0.5, seed=0)
    exact = regression_clients(x, y, clients, 0.5, prior_weights=torch.full((10,), 0.1))
    return x, y, clients, exact


def stopping_short(monkeypatch, offset: float):
    """The warm-up's mode search made to stop ``offset`` posterior sds off the mode in the first coordinate
    (a Newton decrement between ``MODE_TOLERANCE`` and ``MODE_WARNING``, which the warm-up accepts without a
    word, as it does where rounding stalls a float32 search)."""
    found = warmup.find_mode

    def find_mode(pot, start, **options):
        search = found(pot, start, **options)
        sds = torch.linalg.inv(torch.func.jacfwd(pot.gradient)(search.point)).diagonal().sqrt()
        point = search.point + offset * sds * torch.tensor([1.0, 0.0, 0.0])
        return search._replace(point=point, gradient=pot.gradient(point))

    monkeypatch.setattr(warmup, "find_mode", find_mode)


@pytest.mark.slow
def test_on_a_skewed_split_the_automatic_step_samples_where_the_mode_search_stops_short(monkeypatch):
    # the case: measured from where the search stopped (0.3 sds off), the consensus analysis found no
    # step and returned 9e-8, where 4 chains did not move (R-hat 3 to 4) and no message said why. From the
    # model's own mode, the step is the one the exact mode gives
    x, y, clients, exact = skewed_regression()
    model = gaussian_regression(0.5)
    pyro.set_rng_seed(0)
    at_mode = DulaKernel(model, clients, gradient_mode="traced")
    run(at_mode, (x, y), num_samples=1, warmup=100)
    stopping_short(monkeypatch, 0.3)
    pyro.set_rng_seed(0)
    kernel = DulaKernel(model, clients, gradient_mode="traced")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="pyro_fed: D-ULA's automatic step")  # no step problem
        mcmc = run(kernel, (x, y), num_samples=200, warmup=100, num_chains=4)
    assert 0.1 < kernel.adaptation.mode_decrement < 1  # accepted by the warm-up without a warning
    # a Gaussian potential: the same curvatures, stiffness and pilot wherever they are measured
    assert kernel.current_step_size == pytest.approx(at_mode.current_step_size, rel=1e-6)
    # the exact stationary law of the chosen step meets the defaults' targets against the exact posterior
    mean, covariance = exact.posterior()
    law = testing.dula_stationary_law(
        exact,
        kernel.current_step_size,
        kernel.algorithm.consensus_size,
        kernel.graph.laplacian,
        kernel.adaptation.preconditioner,
    )
    sd = covariance.diagonal().sqrt()
    assert ((law.mean - mean).abs() / sd).max() <= 0.2
    assert ((law.cov.diagonal().sqrt() / sd - 1).abs()).max() <= 0.15
    # and the chains sample it: R-hat within the 1.05 of the benchmark's targets (draws spaced by about
    # half the slowest autocorrelation time, 800 of them: R-hat's own spread is about 0.01; frozen chains
    # gave 3 to 4), their means within Z exact standard errors of the law's
    draws = mcmc.get_samples(group_by_chain=True)["w"]
    rhat = pyro.ops.stats.split_gelman_rubin(draws, chain_dim=0, sample_dim=1)
    assert (rhat <= 1.05).all(), rhat
    thinned = law._replace(
        mean_transition=torch.linalg.matrix_power(law.mean_transition, kernel.current_thinning)
    )
    se = thinned.mean_standard_error(draws.shape[1]) / 2  # 4 independent chains
    assert ((draws.mean((0, 1)) - law.mean).abs() <= Z * se).all()


def test_a_step_that_no_search_can_make_usable_is_named_before_the_run(monkeypatch):
    # the heterogeneous ring's consensus analysis held to a mean within 1e-4 posterior sds, in 3 steps tried:
    # none meets it, and the run says before it starts which step it took and why, and the end-of-run checks
    # say it again
    monkeypatch.setattr(dula_step, "CONSENSUS_SHRINKS", 3)
    monkeypatch.setattr(dula_step, "CONSENSUS_MEAN_TARGET", 1e-4)
    x, y, clients, _ = heterogeneous_ring()
    pyro.set_rng_seed(0)
    kernel = DulaKernel(gaussian_regression(NOISE_SD), clients, gradient_mode="traced")
    with pytest.warns(UserWarning, match="D-ULA's automatic step is ") as caught:
        run(kernel, (x, y), num_samples=10, warmup=0)
    message = next(str(w.message) for w in caught if "D-ULA's automatic step" in str(w.message))
    step = kernel.current_step_size
    assert f"D-ULA's automatic step is {step:.3g}" in message
    assert "on this ring of 6 agents" in message and "at no step" in message
    assert "the graph and the split leave no usable step" in message
    problems = kernel.end_of_run_checks["problems"]
    assert any(p.startswith("D-ULA's automatic step is") for p in problems)
