"""VrFaldKernel: exact law, control variate, SVRG-LD limit, bias below FALD's, statistics and errors."""

import math

import pyro
import pytest
import torch
from pyro.infer import MCMC

import pyro_fed
from pyro_fed import FaldKernel, VrFaldKernel, testing
from pyro_fed.algorithms import vr_fald
from pyro_fed.algorithms.drift import COMMUNICATION_TARGET
from pyro_fed.model.gradients import ClientBatches

from ..models import (
    gaussian_regression,
    gaussian_regression_for_nuts,
    logistic_model,
    preconditioned,
    regression_data,
    sorted_regression,
)

Z = 4.5  # standard errors: a false alarm has probability ~1e-5 per checked number
#: the conjugate regression written with pyro.subsample and as a NUTS user writes it: the same exact law
FORMS = [gaussian_regression, gaussian_regression_for_nuts]
PRIOR_SD = 10.0


def gaussian_problem(num_clients=4, mean_scale=3.0, seed=0):
    clients = testing.heterogeneous_gaussian_clients(num_clients, 2, mean_scale=mean_scale, seed=seed)
    model, args = clients.pyro_model(PRIOR_SD)
    # one datum per client: the proportional prior split is 1/b each
    exact = clients.with_prior(PRIOR_SD, torch.full((num_clients,), 1.0 / num_clients))
    return model, args, exact


def run(kernel, args, num_samples, warmup=500):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True)
    mcmc.run(*args)
    return mcmc


@pytest.mark.slow
def test_vr_fald_full_batch_matches_exact_stationary_law():
    model, args, exact = gaussian_problem()
    step = 4 * 0.5 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    hyper = {"step_size": step, "comm_prob": 0.3, "noise_corr": 0.5}
    law = testing.vr_fald_stationary_law(exact, **hyper, refresh_prob=0.2)
    kernel = VrFaldKernel(model, torch.arange(4), **hyper, refresh_prob=0.2)
    draws = run(kernel, args, num_samples=20000).get_samples()["x"]
    assert ((draws.mean(0) - law.mean).abs() <= Z * law.mean_standard_error(len(draws))).all()
    centred = draws - draws.mean(0)
    products = centred[:, :, None] * centred[:, None, :]
    # the chain is a Gaussian mixture, not Gaussian: batch means give the covariance's standard error
    assert ((products.mean(0) - law.cov).abs() <= Z * testing.batch_means_standard_error(products)).all()


def test_vr_fald_bias_below_fald_on_heterogeneous_clients():
    # exact stationary laws: strongly heterogeneous clients, p_c = 0.1, the same step for both
    _, _, exact = gaussian_problem(num_clients=10, mean_scale=10.0, seed=4)
    mean, cov = exact.posterior()
    sigma2 = cov.trace()  # sigma*^2 = E||x - x*||^2 under the posterior
    step = 10 * 0.2 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    fa = testing.fald_stationary_law(exact, step, 0.1, 1.0)
    vr = testing.vr_fald_stationary_law(exact, step, 0.1, 1.0, 0.1)

    def bias(law):  # stationary E||X - x*||^2 - sigma*^2
        return abs(((law.mean - mean).square().sum() + law.cov.trace() - sigma2).item())

    assert bias(vr) < bias(fa) / 10


@pytest.mark.slow
def test_vr_fald_kernel_mean_closer_than_fald_kernel():
    # the same comparison through the kernels: FALD's mean is many standard errors off, VR-FALD's is not
    model, args, exact = gaussian_problem(num_clients=6, mean_scale=10.0, seed=5)
    mean, _ = exact.posterior()
    step = 6 * 0.3 / torch.linalg.eigvalsh(exact.precisions.sum(0)).max().item()
    hyper = {"step_size": step, "comm_prob": 0.1, "noise_corr": 1.0}
    fa_law = testing.fald_stationary_law(exact, **hyper)
    vr_law = testing.vr_fald_stationary_law(exact, **hyper, refresh_prob=0.1)
    assert (fa_law.mean - mean).norm() > 20 * fa_law.mean_standard_error(
        10000
    ).max()  # the setting is telling
    fa = run(FaldKernel(model, torch.arange(6), **hyper), args, 10000).get_samples()["x"].mean(0)
    vr = run(VrFaldKernel(model, torch.arange(6), **hyper), args, 10000).get_samples()["x"].mean(0)
    assert ((vr - mean).abs() <= Z * vr_law.mean_standard_error(10000)).all()
    assert (fa - mean).norm() > (vr - mean).norm()


def kernel_gradients(kernel):
    """The kernel's gradient estimates on its first minibatch: points [..., C = 1, b, d] -> same shape."""
    pot = kernel.potential
    if kernel.minibatches is None:
        batches = pot.full_batches
    else:
        batches = ClientBatches(kernel.minibatches()[0], kernel.minibatches.datum_weights)
    return lambda points: pot.client_grads(points.reshape(-1, pot.num_clients, pot.dim), batches).reshape(
        points.shape
    )


@pytest.mark.parametrize("batch_size", [3, None])
def test_control_variate_at_reference_point_is_the_full_gradient(batch_size):
    # minibatches: two evaluations on one minibatch; full batches: the stored grad U^i(Y)
    x, y = regression_data(40)
    kernel = VrFaldKernel(
        gaussian_regression(0.5),
        torch.arange(40) % 4,
        step_size=1e-3,
        batch_size=batch_size,
        gradient_mode="traced",
    )
    kernel.setup(0, x, y)
    pot = kernel.potential
    reference = torch.randn(3)
    full = pot.full_client_grads(reference)
    state = vr_fald.VrFaldState(reference.expand(1, 4, 3), reference[None], full[None], full.mean(0)[None])
    grads = vr_fald.control_variate(
        state, kernel_gradients(kernel), exact_gradients=kernel.full_local_batches
    )
    # every client gets C = (1/b) sum_i grad U^i(Y): together, the full gradient at Y
    torch.testing.assert_close(grads[0], full.mean(0).expand(4, 3))
    torch.testing.assert_close(grads[0].sum(0), full.sum(0))
    # and the initial reference gradients and shift are the full local gradients at the initial point
    start = vr_fald.VrFaldState(*kernel.runner.state)
    torch.testing.assert_close(start.reference_grads[0], pot.full_client_grads(start.reference[0]))
    torch.testing.assert_close(start.shift, start.reference_grads.mean(1))


def test_full_batch_control_variate_equals_the_two_evaluation_form():
    x, y = regression_data(40)
    kernel = VrFaldKernel(
        gaussian_regression(0.5), torch.arange(40) % 4, step_size=1e-3, gradient_mode="traced"
    )
    kernel.setup(0, x, y)
    pot = kernel.potential
    reference = torch.randn(3)
    full = pot.full_client_grads(reference)
    state = vr_fald.VrFaldState(torch.randn(1, 4, 3), reference[None], full[None], full.mean(0)[None])
    gradients = kernel_gradients(kernel)
    torch.testing.assert_close(
        vr_fald.control_variate(state, gradients, exact_gradients=True),
        vr_fald.control_variate(state, gradients, exact_gradients=False),
    )


def test_single_client_vr_fald_is_svrg_langevin():
    # b = 1, p_c = 1: X' = X - step (g(X; S) - g(Y; S) + grad U(Y)) + sqrt(2 step) Z, on one fixed
    # minibatch S; 3000 independent chains from the same (X, Y) give 3000 independent transitions
    x, y = regression_data(30)
    kernel = VrFaldKernel(
        gaussian_regression(0.5),
        torch.zeros(30, dtype=torch.long),
        step_size=2e-3,
        batch_size=4,
        gradient_mode="traced",
    )
    pyro.set_rng_seed(0)
    kernel.setup(0, x, y)
    pot, n = kernel.potential, 3000
    batch = ClientBatches(kernel.minibatches()[0], kernel.minibatches.datum_weights)  # one fixed S
    point, reference = torch.tensor([0.3, -0.2, 0.1]), torch.tensor([-0.5, 0.4, 0.0])
    full = pot.full_client_grads(reference)
    start = vr_fald.VrFaldState(
        point.expand(n, 1, 3), reference.expand(n, 3), full.expand(n, 1, 3), full[0].expand(n, 3)
    )
    gradients = lambda p: pot.client_grads(p.reshape(-1, 1, 3), batch).reshape(p.shape)  # noqa: E731
    step = torch.tensor(2e-3)
    moves = vr_fald.step(
        start,
        gradients,
        torch.randn(n, 1, 3),
        torch.ones(n, dtype=torch.bool),
        kernel.network,
        step_size=step,
    ).clients[:, 0]
    g = lambda p: pot.client_grads(p[None], batch)[0]  # noqa: E731
    expected = point - 2e-3 * (g(point) - g(reference) + full[0])
    sd = math.sqrt(2 * 2e-3)
    assert ((moves.mean(0) - expected).abs() <= Z * sd / math.sqrt(n)).all()
    torch.testing.assert_close(moves.T.cov(), sd**2 * torch.eye(3), atol=Z * sd**2 * math.sqrt(2 / n), rtol=0)


def test_sample_stats_record_refreshes_and_their_bits():
    x, y = regression_data(40)
    pyro.set_rng_seed(3)
    kernel = VrFaldKernel(
        logistic_model,
        torch.arange(40) % 4,
        step_size=0.02,
        comm_prob=0.3,
        refresh_prob=0.2,
        batch_size=5,
        gradient_mode="traced",
    )
    mcmc = run(kernel, (x, (y > 0).double()), num_samples=300, warmup=0)
    idata = pyro_fed.to_inference_data(mcmc, log_likelihood=False)
    stats = idata.sample_stats
    assert stats["refreshed"].dtype == bool and 0 < int(stats["refreshed"].sum()) < 300
    bits = stats["uploaded_bits"].values[0]
    per_upload = 4 * 3 * 32  # 4 clients upload d = 3 floats
    steps = stats["communicated"].values[0].astype(int) + 2 * stats["refreshed"].values[0].astype(int)
    # initial shift: 2 uploads before the first draw; then 1 per averaging and 2 per refresh
    assert bits[0] == per_upload * (2 + steps[0])
    torch.testing.assert_close(torch.as_tensor(bits[1:] - bits[:-1]), torch.as_tensor(per_upload * steps[1:]))


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, "often"])
def test_bad_refresh_prob(value):
    with pytest.raises(ValueError, match=r"refresh_prob must be a number in \(0, 1\]"):
        VrFaldKernel(logistic_model, torch.arange(10) % 2, step_size=1e-3, refresh_prob=value)


@pytest.mark.parametrize("batch_size, evaluated", [(None, 40), (3, 2 * 2 * 3)])
def test_automatic_refreshes_take_a_tenth_of_the_data_evaluations(batch_size, evaluated):
    # q_c = 0.1 * (data evaluated per iteration) / N: full local batches evaluate each of the 40 points once,
    # minibatches of 3 twice (at the iterate and at the reference point), for each of the 2 clients
    x, y = regression_data(40)
    kernel = VrFaldKernel(
        logistic_model, torch.arange(40) % 2, step_size=1e-3, comm_prob=0.3, batch_size=batch_size
    )
    assert kernel.refresh_prob is None
    kernel.setup(0, x, (y > 0).double())
    assert kernel.current_refresh_prob == pytest.approx(0.1 * evaluated / 40)


def test_no_automatic_refreshes_where_the_shifts_cancel_in_every_average():
    # full local batches and an average every iteration: the clients' mean of G^i is grad U(X) / b whatever
    # the pair, so the automatic refresh probability is 0 and the chain is FALD's (to rounding: the shift
    # is subtracted and added back)
    x, y = regression_data(40)
    args, clients, draws = (x, (y > 0).double()), torch.arange(40) % 4, {}
    for kernel_class in (FaldKernel, VrFaldKernel):
        pyro.set_rng_seed(5)
        kernel = kernel_class(logistic_model, clients, step_size=0.05, gradient_mode="traced")
        draws[kernel_class] = run(kernel, args, num_samples=50, warmup=0).get_samples()["w"]
    assert kernel.current_refresh_prob == 0.0
    torch.testing.assert_close(draws[VrFaldKernel], draws[FaldKernel], rtol=0, atol=1e-10)
    kernel = VrFaldKernel(logistic_model, clients, step_size=0.05, comm_prob=0.5)
    kernel.setup(0, *args)
    assert kernel.current_refresh_prob > 0  # local steps: the shift corrects the drift, refreshes pay


@pytest.mark.slow
@pytest.mark.parametrize("regression", FORMS, ids=["pyro.subsample", "written for NUTS"])
def test_vr_fald_at_the_papers_rare_rounds_matches_its_exact_law_on_a_sorted_split(regression):
    # sites that hold contiguous ranges of the first feature, one averaging round per 10 iterations (the
    # paper's setting), full local batches; the step, refresh probability and preconditioner the warm-up's.
    # The draws follow the exact stationary law of the chain at those settings, and that law is the
    # posterior's to within the warm-up's target: the refresh it chose keeps the drift error (mean offset
    # and sd excess over the law of an average at every iteration, in its sds) within 0.05, which the
    # quadratic model (exact here, to its first order in the drift: up to 1.5 times, tests/algorithms/
    # test_drift.py) predicts.
    x, y, clients, exact = sorted_regression(60, 6)
    kernel = VrFaldKernel(regression(0.5), clients, comm_prob=0.1, batch_size=None)
    draws = run(kernel, (x, y), num_samples=20000, warmup=300).get_samples()["w"]
    chosen = kernel.adaptation
    whitened, root = preconditioned(exact, chosen.preconditioner)
    hyper = {"step_size": chosen.step_size, "noise_corr": kernel.noise_corr}
    law = testing.vr_fald_stationary_law(
        whitened, comm_prob=0.1, refresh_prob=kernel.current_refresh_prob, **hyper
    )
    mean, cov = root @ law.mean, root @ law.cov @ root
    # the chain is a Gaussian mixture over its coins, thinned: batch means give the standard errors
    assert ((draws.mean(0) - mean).abs() <= Z * testing.batch_means_standard_error(draws)).all()
    centred = draws - draws.mean(0)
    products = centred[:, :, None] * centred[:, None, :]
    assert ((products.mean(0) - cov).abs() <= Z * testing.batch_means_standard_error(products)).all()
    base = testing.fald_stationary_law(whitened, comm_prob=1.0, **hyper)
    base_mean, base_cov = root @ base.mean, root @ base.cov @ root
    offsets = (mean - base_mean) / base_cov.diagonal().sqrt()
    excess = (cov.diagonal() / base_cov.diagonal()).sqrt() - 1
    assert float((offsets.square() + excess.square()).sqrt().max()) <= 1.5 * COMMUNICATION_TARGET
