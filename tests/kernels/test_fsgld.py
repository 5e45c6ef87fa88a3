"""FsgldKernel: the conducive gradient and the round coins; the surrogates fitted and their bits; the exact
stationary laws on Gaussian clients with exact surrogates (ULA on U, any number of local steps) and with wrong
ones (a random linear recursion, one outcome per client); argument errors; two ranks."""

import warnings

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed.algorithms import adaptation, fsgld
from pyro_fed.engine.randomness import Randomness
from pyro_fed.kernels.fsgld import SURROGATE_WARNING, FsgldKernel
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.network.distributed import shard
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import (
    GaussianClients,
    Outcome,
    batch_means_standard_error,
    fald_stationary_law,
    random_recursion_law,
)

from ..algorithms.test_adaptation import check_chains_against_preconditioned_law, preconditioned
from ..models import logistic_data, logistic_model
from ..network.forked import run_forked

Z = 4.5  # tolerance in standard errors: a false alarm has probability ~1e-5 per checked number
PRIOR_SD = 10.0


def gaussian_clients(num_clients=3, dim=2, seed=0) -> GaussianClients:
    """Heterogeneous Gaussian clients of well-conditioned precisions (eigenvalues in [0.5, 2], random
    rotations) and means a few of their sds apart: the chains mix within tens of iterations at the steps
    below, so that the statistical tests are short."""
    g = torch.Generator().manual_seed(seed)
    rotations = torch.linalg.qr(torch.randn(num_clients, dim, dim, generator=g))[0]
    spectra = 0.5 + 1.5 * torch.rand(num_clients, dim, generator=g)
    precisions = rotations @ torch.diag_embed(spectra) @ rotations.transpose(-1, -2)
    return GaussianClients(precisions, 2.0 * torch.randn(num_clients, dim, generator=g))


def problem(num_clients=3, dim=2):
    """The Pyro model of the clients (client i is datum i) and its federated potential's clients: each with
    its share 1/b of the prior N(0, PRIOR_SD^2 I) (the default proportional split of one datum each)."""
    clients = gaussian_clients(num_clients, dim)
    model, args = clients.pyro_model(PRIOR_SD)
    exact = clients.with_prior(PRIOR_SD, torch.full((num_clients,), 1.0 / num_clients))
    return model, args, torch.arange(num_clients), exact


def wrong_surrogates(exact: GaussianClients):
    """Surrogates off on purpose: precisions scaled by 0.6, 1.5 and 0.8 and means moved by about one sd."""
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.6, 1.5, 0.8])[: exact.num_clients]
    return exact.means + torch.randn(exact.means.shape, generator=g), scales[:, None, None] * exact.precisions


def run(kernel, args, num_samples, warmup=0, num_chains=1, seed=0):
    mcmc = MCMC(
        kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=num_chains, disable_progbar=True
    )
    pyro.set_rng_seed(seed)
    mcmc.run(*args)
    return mcmc


def conducive_outcomes(exact, means, precisions, probs, step, local_steps=1):
    r"""The FSGLD recursion on Gaussian clients with full batches and surrogates (``means``, ``precisions``),
    one outcome per round's client :math:`s` (probability :math:`p_s`): the conducive gradient is linear,
    :math:`g_s(x) = G_s x - c_s` with :math:`G_s = (A_s - \Lambda_s)/p_s + \Lambda` and :math:`c_s = (A_s
    \mu_s - \eta_s)/p_s + \eta`, so a step is :math:`x' = (I - \gamma G_s) x + \gamma c_s + \sqrt{2\gamma}
    Z`. Over a round of ``local_steps`` :math:`K` steps with the same client the state at the rounds'
    boundaries follows :math:`F_s^K`, :math:`\sum_{t<K} F_s^t h_s` and :math:`\sum_{t<K} F_s^t Q F_s^{t\top}`:
    a time-homogeneous random linear recursion with one outcome per client."""
    d = exact.dim
    eye = torch.eye(d)
    shifts = (precisions @ means[..., None])[..., 0]
    outcomes = []
    for s in range(exact.num_clients):
        drift = (exact.precisions[s] - precisions[s]) / probs[s] + precisions.sum(0)
        offset = (exact.precisions[s] @ exact.means[s] - shifts[s]) / probs[s] + shifts.sum(0)
        transition, shift, noise = eye - step * drift, step * offset, 2 * step * eye
        whole, moved, spread = eye, torch.zeros(d), torch.zeros(d, d)
        for _ in range(local_steps):
            whole = transition @ whole
            moved = transition @ moved + shift
            spread = transition @ spread @ transition.T + noise
        outcomes.append(Outcome(float(probs[s]), whole, moved, spread))
    return outcomes


def ula_law(exact, step):
    """ULA with step ``step`` on U: FALD's law with one client holding the whole potential."""
    mean, _ = exact.posterior()
    whole = GaussianClients(exact.precisions.sum(0)[None], mean[None])
    return fald_stationary_law(whole, step, 1.0, 1.0)


# ----------------------------------------------------------------------------------- the pure rule
def test_the_conducive_gradient_is_unbiased_and_exact_with_exact_surrogates():
    _, _, _, exact = problem()
    b, d = exact.num_clients, exact.dim
    network = InProcessNetwork(b, d, 4)
    probs = torch.tensor([0.5, 0.3, 0.2])
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(2))
    total = exact.gradients(x[:, None, :].expand(-1, b, -1)).sum(-2)  # grad U, [C, d]

    def conducive(surrogates, s):
        client = torch.full((4,), s)

        def own(local):
            return fsgld.selected_gradient(exact.gradients, x, local, b)

        return fsgld.conducive_gradient(x, client, own, surrogates, 1 / probs, slice(0, b), network)

    means, precisions = wrong_surrogates(exact)
    wrong = fsgld.surrogates_from_moments(means, precisions, network)
    # E_s[g] = sum_s p_s g_s = grad U exactly, although no single g_s is
    expectation = sum(probs[s] * conducive(wrong, s) for s in range(b))
    torch.testing.assert_close(expectation, total, rtol=1e-12, atol=1e-12)
    assert all((conducive(wrong, s) - total).abs().max() > 0.1 for s in range(b))
    # with the clients' own Gaussians every g_s is grad U
    right = fsgld.surrogates_from_moments(exact.means, exact.precisions, network)
    for s in range(b):
        torch.testing.assert_close(conducive(right, s), total, rtol=1e-12, atol=1e-12)
    # diagonal precisions are the dense diagonal ones
    diagonal = fsgld.surrogates_from_moments(means, precisions.diagonal(dim1=-2, dim2=-1), network)
    dense = fsgld.surrogates_from_moments(
        means, torch.diag_embed(precisions.diagonal(dim1=-2, dim2=-1)), network
    )
    torch.testing.assert_close(conducive(diagonal, 1), conducive(dense, 1), rtol=1e-12, atol=1e-12)


def test_one_step_is_the_rule_and_a_round_keeps_its_client():
    _, _, _, exact = problem()
    b, d = exact.num_clients, exact.dim
    network = InProcessNetwork(b, d, 2)
    probs = torch.tensor([0.5, 0.3, 0.2])
    means, precisions = wrong_surrogates(exact)
    surrogates = fsgld.surrogates_from_moments(means, precisions, network)
    state = fsgld.FsgldState(torch.tensor([[0.3, -0.2], [1.0, 0.5]]), torch.tensor([[1], [2]]))
    noise, step = torch.tensor([[0.1, -0.4], [0.7, 0.2]]), torch.tensor(0.05)
    # chain 0 starts a round with client 0, chain 1 goes on with its client 2
    new = fsgld.step(
        state, exact.gradients, noise, torch.tensor([0, -1]), surrogates, 1 / probs, slice(0, b), network,
        step_size=step,
    )  # fmt: skip
    assert new.client.tolist() == [[0], [2]]
    for chain, s in ((0, 0), (1, 2)):
        x = state.server[chain]
        own = exact.precisions[s] @ (x - exact.means[s]) - precisions[s] @ (x - means[s])
        g = own / probs[s] + precisions.sum(0) @ x - (precisions @ means[..., None]).sum(0)[:, 0]
        expected = x - step * g + (2 * step).sqrt() * noise[chain]
        torch.testing.assert_close(new.server[chain], expected, rtol=1e-12, atol=1e-12)


def test_round_coins_follow_p_and_do_not_depend_on_the_chunks():
    probs = np.array([0.5, 0.3, 0.2])
    whole = fsgld.round_clients(Randomness(0), probs, 0, 30, 2, 3)
    rng = Randomness(0)
    parts = np.concatenate(
        [fsgld.round_clients(rng, probs, k, min(7, 30 - k), 2, 3) for k in range(0, 30, 7)]
    )
    np.testing.assert_array_equal(parts, whole)
    starts = np.arange(30) % 3 == 0
    assert (whole[starts] >= 0).all() and (whole[~starts] == -1).all()
    # 100 000 rounds of 2 chains: each client's frequency within Z binomial standard errors of p
    many = fsgld.round_clients(Randomness(1), probs, 0, 100_000, 2, 1)
    frequencies = np.bincount(many.ravel(), minlength=3) / many.size
    assert (np.abs(frequencies - probs) <= Z * np.sqrt(probs * (1 - probs) / many.size)).all(), frequencies
    # one client: always it, and no randomness drawn
    rng = Randomness(0)
    state = rng.host.bit_generator.state
    assert (fsgld.round_clients(rng, np.ones(1), 0, 5, 2, 1) == 0).all()
    assert rng.host.bit_generator.state == state


# ----------------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("form", ["dense", "diagonal"])
def test_the_surrogates_fitted_at_the_mode_are_the_gaussian_clients_own(form):
    # a Gaussian's Taylor expansion at any point is itself: Lambda_i = A_i, eta_i = A_i mu_i (the clients'
    # potentials with their prior shares); the diagonal form keeps the Hessians' diagonals
    model, args, clients, exact = problem()
    kernel = FsgldKernel(model, clients, step_size=0.05, surrogate_form=form, gradient_mode="traced")
    run(kernel, args, num_samples=3)
    fitted = kernel.algorithm.surrogates
    precisions = exact.precisions if form == "dense" else exact.precisions.diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(fitted.precisions, precisions, rtol=1e-9, atol=1e-9)
    if form == "dense":
        shifts = (exact.precisions @ exact.means[..., None])[..., 0]
        torch.testing.assert_close(fitted.shifts, shifts, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(fitted.total_precision, exact.precisions.sum(0), rtol=1e-9, atol=1e-9)
    assert fitted.dense == (form == "dense")


@pytest.mark.parametrize("diagonal", [False, True])
def test_bits_of_the_surrogates_and_of_the_rounds(diagonal):
    # given surrogates: every client uploads d^2 + d floats (2d diagonal) and downloads their sums, once;
    # then each round of K = 2 iterations sends x down at its first iteration and up at its last. 11
    # iterations: 6 rounds started, 5 finished
    model, args, clients, exact = problem()
    b, d = exact.num_clients, exact.dim
    precisions = exact.precisions.diagonal(dim1=-2, dim2=-1) if diagonal else exact.precisions
    kernel = FsgldKernel(
        model, clients, step_size=0.05, local_steps=2, surrogates=(exact.means, precisions), chunk_size=4,
        gradient_mode="traced",
    )  # fmt: skip
    run(kernel, args, num_samples=11)
    stats = kernel.sample_stats()
    floats = 2 * d if diagonal else d * d + d
    setup = 32 * floats * b
    starts, ends = np.arange(11) % 2 == 0, np.arange(11) % 2 == 1
    np.testing.assert_array_equal(stats["new_round"], starts)
    np.testing.assert_array_equal(stats["uploaded_bits"], setup + np.cumsum(ends * 32 * d))
    np.testing.assert_array_equal(stats["downloaded_bits"], setup + np.cumsum(starts * 32 * d))
    assert kernel.network.rounds.tolist() == [6]
    # each draw's client: the round's, the same for both of its iterations
    client = stats["client"]
    assert ((client >= 0) & (client < b)).all() and (client[1::2] == client[:-1:2]).all()


def test_rounds_that_straddle_chunks_keep_their_client():
    # K = 3 iterations a round, chunks of 4 iterations: the round's client is kept in the state across
    # chunks, so each client works three consecutive iterations from a multiple of 3; and the coins are drawn
    # one round at a time from the host stream, so the clients are the same with chunks of 64
    model, args, clients, exact = problem()
    sequences = []
    for chunk in (4, 64):
        kernel = FsgldKernel(
            model, clients, step_size=0.05, local_steps=3, surrogates=wrong_surrogates(exact),
            chunk_size=chunk, gradient_mode="traced",
        )  # fmt: skip
        run(kernel, args, num_samples=30)
        stats = kernel.sample_stats()
        np.testing.assert_array_equal(stats["new_round"], np.arange(30) % 3 == 0)
        rounds = stats["client"].reshape(10, 3)
        assert (rounds == rounds[:, :1]).all(), rounds
        sequences.append(stats["client"])
    np.testing.assert_array_equal(sequences[0], sequences[1])
    assert len(set(sequences[0].tolist())) == 3


@pytest.mark.parametrize("batch_size", [None, 2])
def test_the_oracle_evaluates_the_rounds_client_alone_to_the_same_draws(batch_size, monkeypatch):
    # K = 3 and chunks of 4: rounds go on across chunks, whose working client comes from the state
    x, y = logistic_data(60)

    def draws():
        kernel = FsgldKernel(
            logistic_model, 6, step_size=0.02, local_steps=3, chunk_size=4, batch_size=batch_size,
            gradient_mode="traced",
        )  # fmt: skip
        mcmc = MCMC(kernel, num_samples=40, warmup_steps=0, num_chains=2, disable_progbar=True)
        pyro.set_rng_seed(0)
        mcmc.run(x, y)
        return kernel.runner.buffer.all_draws(0)

    evaluated = []
    working_gradients = FederatedPotential.working_gradients

    def counted(self, points, rows, *args):
        evaluated.append(len(rows))
        return working_gradients(self, points, rows, *args)

    monkeypatch.setattr(FederatedPotential, "working_gradients", counted)
    selected = draws()
    assert evaluated and max(evaluated) == 2  # one client of each of the two chains, of 6 x 2 pairs
    monkeypatch.setattr(fsgld.Fsgld, "selects_clients", False)  # every client's gradient, as before
    np.testing.assert_array_equal(selected, draws())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"local_steps": 0}, "local_steps must be a positive integer"),
        ({"local_steps": 1.5}, "local_steps must be a positive integer"),
        ({"client_probs": [0.5, 0.0, 0.5]}, "client_probs must be None .* positive finite numbers"),
        ({"client_probs": [[0.5, 0.5]]}, "client_probs must be None .* 1-D sequence"),
        ({"client_probs": "uniform"}, "client_probs must be None"),
        ({"surrogates": torch.zeros(3, 2)}, r"surrogates must be None .* a pair \(means, precisions\)"),
        (
            {"surrogates": (torch.zeros(3, 2), torch.tensor([[[1.0, 2.0], [0.0, 1.0]]]).expand(3, 2, 2))},
            "a dense precision is a Hessian, symmetric",
        ),
        ({"surrogates": (torch.full((3, 2), float("nan")), torch.ones(3, 2))}, "must be finite"),
        ({"surrogate_form": "full"}, "surrogate_form must be one of"),
        (
            {"surrogates": (torch.zeros(3, 2), torch.ones(3, 2)), "surrogate_form": "dense"},
            "leave surrogate_form out",
        ),
        ({"prior_weights": "server"}, "prior_weights='server': FSGLD's clients fit their surrogates"),
    ],
)
def test_bad_arguments(kwargs, match):
    model, _, clients, _ = problem()
    with pytest.raises(ValueError, match=match):
        FsgldKernel(model, clients, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"client_probs": [0.5, 0.5]}, "client_probs has 2 entries; the run has 3 clients"),
        (
            {"surrogates": (torch.zeros(2, 2), torch.ones(2, 2))},
            r"surrogates: means of shape \(2, 2\) .* the run has 3 clients and 2 unconstrained",
        ),
    ],
)
def test_arguments_that_do_not_fit_the_run_are_refused_at_setup(kwargs, match):
    model, args, clients, _ = problem()
    with pytest.raises(ValueError, match=match):
        run(
            FsgldKernel(model, clients, step_size=0.05, gradient_mode="traced", **kwargs), args, num_samples=2
        )


@pytest.mark.slow
def test_the_automatic_step_pays_for_the_conducive_noise_of_wrong_surrogates():
    # exact surrogates: the conducive gradient is grad U, no noise, and the step is the exact-gradient rule's;
    # wrong ones add the random client's error, which the warm-up measures and the step pays for, the more so
    # with K = 4 persistent local steps (K times the variance, see fsgld.estimate_noise)
    model, args, clients, exact = problem()
    chosen = {}
    for name, options in {
        "exact": {},
        "wrong": {"surrogates": wrong_surrogates(exact)},
        "wrong K=4": {"surrogates": wrong_surrogates(exact), "local_steps": 4},
    }.items():
        kernel = FsgldKernel(model, clients, gradient_mode="traced", thinning=1, **options)
        run(kernel, args, num_samples=2)
        chosen[name] = kernel.adaptation
    assert chosen["exact"].noise < 1e-20 * chosen["exact"].stiffness
    assert chosen["exact"].step_size * chosen["exact"].stiffness == pytest.approx(adaptation.STEP_TARGET)
    assert chosen["wrong"].noise > chosen["exact"].stiffness
    # the same client draws, their deviations scaled by sqrt(4)
    assert chosen["wrong K=4"].noise == pytest.approx(4 * chosen["wrong"].noise, rel=1e-9)
    assert chosen["exact"].step_size > chosen["wrong"].step_size > chosen["wrong K=4"].step_size


def test_surrogates_whose_noise_shrinks_the_automatic_step_are_named_before_the_run():
    # surrogates that know nothing of the clients (precisions 1e-3 I, means 0): the conducive gradient is the
    # round's client's gradient over p_s, whose spread across the 3 heterogeneous clients (means ~2 sds
    # apart) makes the automatic step tens of times smaller than exact gradients: said before the run, with
    # the factor step_shrink computes and, with 2 local steps, the mean's bias. Fitted (exact) surrogates:
    # no noise, nothing said.
    model, args, clients, exact = problem()
    blind = (torch.zeros(3, 2), 1e-3 * torch.eye(2).expand(3, 2, 2))
    kernel = FsgldKernel(model, clients, surrogates=blind, local_steps=2, gradient_mode="traced", thinning=1)
    with pytest.warns(UserWarning, match=r"FsgldKernel: the conducive gradient's noise") as caught:
        run(kernel, args, num_samples=2)
    chosen = kernel.adaptation
    shrink = adaptation.step_shrink(chosen.noise, chosen.stiffness)
    (message,) = [str(w.message) for w in caught if "conducive gradient's noise" in str(w.message)]
    assert shrink > SURROGATE_WARNING and f"the automatic step {shrink:.3g} times smaller" in message
    assert "local_steps=2" in message and "stationary mean" in message
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        run(FsgldKernel(model, clients, gradient_mode="traced", thinning=1), args, num_samples=2)
    assert not [w for w in quiet if "conducive gradient's noise" in str(w.message)]


# ----------------------------------------------------------------------------------- exact laws
@pytest.mark.slow
@pytest.mark.parametrize("local_steps", [1, 3])
def test_exact_surrogates_give_ula_on_the_whole_potential(local_steps):
    # Gaussian clients, full batches, surrogates fitted at the mode (the clients' own Gaussians): g = grad U
    # whatever the round's client, so FSGLD is ULA with step gamma on U for any K and p, a Gaussian AR(1)
    # whose stationary law is exact. Four chains, each stationary; their means' and covariances' exact
    # standard errors divided by 2.
    model, args, clients, exact = problem()
    step = 0.5 / float(torch.linalg.eigvalsh(exact.precisions.sum(0)).max())
    kernel = FsgldKernel(
        model, clients, step_size=step, local_steps=local_steps, client_probs=[0.2, 0.3, 0.5],
        gradient_mode="traced",
    )  # fmt: skip
    chains = run(kernel, args, num_samples=5000, warmup=300, num_chains=4).get_samples(group_by_chain=True)[
        "x"
    ]
    law = ula_law(exact, step)
    mean = chains.mean(1).mean(0)
    cov = torch.stack([c.T.cov() for c in chains]).mean(0)
    mean_tol, cov_tol = Z * law.mean_standard_error(5000) / 2, Z * law.covariance_standard_error(5000) / 2
    assert ((mean - law.mean).abs() <= mean_tol).all(), (mean, law.mean, mean_tol)
    assert ((cov - law.cov).abs() <= cov_tol).all(), (cov, law.cov, cov_tol)
    # the test has power: at this step the discretised law is measurably not the posterior
    _, posterior_cov = exact.posterior()
    assert ((law.cov - posterior_cov).abs() > cov_tol).any()


@pytest.mark.slow
def test_automatic_settings_with_exact_surrogates_have_the_exact_law_of_the_chosen_step():
    # MCMC(FsgldKernel(model)) alone: the warm-up's step (the server's, on U) and preconditioner, thinning=1
    # for the chain's own law: preconditioned ULA on U, the plain one in y = R^-1 x (see test_adaptation)
    model, args, clients, exact = problem()
    _, covariance = exact.posterior()
    kernel = FsgldKernel(model, clients, gradient_mode="traced", thinning=1)
    chains = run(kernel, args, num_samples=4000, warmup=300, num_chains=4).get_samples(group_by_chain=True)[
        "x"
    ]
    chosen = kernel.adaptation
    law_y = ula_law(preconditioned(exact, chosen.preconditioner), chosen.step_size)
    _, law_cov = check_chains_against_preconditioned_law(chains, law_y, chosen.preconditioner)
    # exact gradients: every variance within the design's 10% of the posterior's
    ratio = law_cov.diagonal() / covariance.diagonal()
    assert (ratio >= 1).all() and (ratio <= 1 + adaptation.VARIANCE_TARGET + 1e-9).all(), ratio


def check_mixture(chains, law):
    """Chains ``[C, K, d]`` of a random linear recursion against its exact law: the mean with the law's exact
    standard error (exact for any outcomes, see StationaryLaw), the covariance about the law's mean with
    batch-means standard errors (the chain is a Gaussian mixture over client sequences), pooled over the
    chains; returns the covariance's standard errors."""
    num_chains, num_draws = chains.shape[:2]
    mean_se = law.mean_standard_error(num_draws) / num_chains**0.5
    mean = chains.mean(1).mean(0)
    assert ((mean - law.mean).abs() <= Z * mean_se).all(), (mean, law.mean, mean_se)
    centred = chains - law.mean
    products = centred[..., :, None] * centred[..., None, :]  # [C, K, d, d]
    cov_se = torch.stack([batch_means_standard_error(p) for p in products]).square().mean(0).sqrt()
    cov_se = cov_se / num_chains**0.5
    cov = products.mean(1).mean(0)
    assert ((cov - law.cov).abs() <= Z * cov_se).all(), (cov, law.cov, cov_se)
    return cov_se


@pytest.mark.slow
@pytest.mark.parametrize("local_steps", [1, 3])
def test_wrong_surrogates_give_the_exact_law_of_the_random_client(local_steps):
    # surrogates off on purpose (precisions scaled, means moved), full batches, p = (0.5, 0.3, 0.2): each
    # step is linear given the round's client, so the chain is a random linear recursion with one outcome
    # per client (conducive_outcomes). With K = 3 local steps a round the state at the rounds' boundaries is
    # time-homogeneous (the round's client drawn afresh): thinning = K reports exactly those states. With
    # K = 1 the mean is the posterior's (the estimate is unbiased and linear); the covariance is wider than
    # ULA's by the random client's error, and the test sees it (the power check below).
    model, args, clients, exact = problem()
    means, precisions = wrong_surrogates(exact)
    probs = torch.tensor([0.5, 0.3, 0.2])
    outcomes = conducive_outcomes(exact, means, precisions, probs, 1.0, 1)
    largest = max(float(torch.linalg.eigvals(torch.eye(2) - o.transition).abs().max()) for o in outcomes)
    step = 0.4 / largest  # 0.4 / the stiffest client's largest drift eigenvalue
    kernel = FsgldKernel(
        model, clients, step_size=step, local_steps=local_steps, client_probs=probs.tolist(),
        surrogates=(means, precisions), thinning=local_steps, gradient_mode="traced",
    )  # fmt: skip
    # 4000 steps of K = 1, 6000 of K = 3 (its bias check needs the narrower standard errors)
    num_samples = 4000 if local_steps == 1 else 2000
    mcmc = run(kernel, args, num_samples=num_samples, warmup=300 // local_steps, num_chains=4)
    chains = mcmc.get_samples(group_by_chain=True)["x"]
    law = random_recursion_law(
        conducive_outcomes(exact, means, precisions, probs, step, local_steps), torch.eye(2)
    )
    cov_se = check_mixture(chains, law)
    posterior_mean = exact.posterior()[0]
    if local_steps == 1:  # the estimate is unbiased and linear in x: the posterior's mean, exactly
        torch.testing.assert_close(law.mean, posterior_mean, rtol=1e-9, atol=1e-9)
    else:
        # K steps with one client average F_s^K, not (sum_s p_s F_s)^K: the rounds' mean is off the
        # posterior's (by 0.12 here, tens of standard errors), and the draws show it
        mean_se = law.mean_standard_error(num_samples) / 2
        assert ((law.mean - posterior_mean).abs() > Z * mean_se).any(), (law.mean, posterior_mean)
    # power: ULA's law at this step (what exact surrogates give) is measurably narrower
    ula = ula_law(exact, step)
    assert ((law.cov - ula.cov).diagonal() > Z * cov_se.diagonal()).all(), (law.cov, ula.cov, cov_se)


# ----------------------------------------------------------------------------------- two ranks
NUM_DATA, NUM_CLIENTS = 60, 6
RANK_KERNELS = {
    # fitted surrogates (the mode found by L-BFGS across the ranks), minibatches, rounds of 2 steps
    "given step": lambda c, **kw: FsgldKernel(
        logistic_model, c, step_size=0.01, local_steps=2, batch_size=4,
        client_probs=[0.1, 0.2, 0.1, 0.3, 0.2, 0.1], **kw,
    ),
    # the warm-up's noise measure of the conducive estimate, a client drawn per minibatch
    "automatic": lambda c, **kw: FsgldKernel(logistic_model, c, **kw),
}  # fmt: skip


def rank_draws(name, clients, data, network=None):
    kernel = RANK_KERNELS[name](clients, network=network, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
    pyro.set_rng_seed(0)
    mcmc.run(*data)
    diagnostics = kernel.diagnostics()
    bits = (diagnostics["uploaded bits"], diagnostics["downloaded bits"], diagnostics["communication rounds"])
    return mcmc.get_samples(group_by_chain=True)["w"], bits


@pytest.mark.slow
def test_two_ranks_give_the_one_process_draws():
    # the working client's term is computed where it is held and meets the others in a sum of zeros but one:
    # the draws are the one-process run's up to the reassociation of the surrogates' sums (float64 rounding)
    def on_ranks(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        return {name: rank_draws(name, clients, (x[rows], y[rows]), network) for name in RANK_KERNELS}

    results = run_forked(on_ranks, 2, timeout_seconds=300)
    for name in RANK_KERNELS:
        expected, expected_bits = rank_draws(name, NUM_CLIENTS, logistic_data(num_data=NUM_DATA, dim=3))
        first, second = (result[name] for result in results)
        assert torch.equal(first[0], second[0]) and first[1] == second[1]
        torch.testing.assert_close(first[0], expected, rtol=1e-9, atol=1e-9)
        assert first[1] == expected_bits
