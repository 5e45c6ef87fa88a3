"""The algorithm contract runs an algorithm by itself, without Pyro or a kernel."""

import numpy as np
import pytest
import torch

from pyro_fed import FaldKernel, QlsdKernel, VrFaldKernel
from pyro_fed.algorithms import dglmc, dula, fald, fsgld, psgld, qlsd, vr_fald
from pyro_fed.algorithms.base import Algorithm
from pyro_fed.engine.randomness import Randomness
from pyro_fed.network.base import BITS_PER_FLOAT
from pyro_fed.network.in_process import InProcessNetwork
from pyro_fed.testing import fald_stationary_law, heterogeneous_gaussian_clients
from tests.models import logistic_data, logistic_model


def run_by_contract(algorithm: Algorithm, start: torch.Tensor, gradients, step_size, iterations, seed=0):
    """What a kernel does with an algorithm, by hand: coins and inputs per chunk, the steps, the draws."""
    rng, state, draws, traffic = Randomness(seed), algorithm.init(start), [], []
    for first in range(0, iterations, 100):
        coins = algorithm.coins(rng, first, 100)
        inputs = algorithm.inputs(rng, coins)
        for k in range(100):
            state = algorithm.step(state, gradients, tuple(t[k] for t in inputs), step_size)
            summary = {name: value[None] for name, value in algorithm.summary(state).items()}
            draws.append(algorithm.report(summary)["position"][0])
        traffic.append(algorithm.traffic(coins))
    return torch.stack(draws), traffic


def test_fald_run_by_its_contract_has_its_exact_stationary_law():
    # Gaussian clients, full local batches: FALD's draw is a random linear recursion whose stationary law
    # is known exactly (pyro_fed.testing), standard error of the sample mean included
    clients = heterogeneous_gaussian_clients(4, 2, mean_scale=1.0, seed=3)
    step, comm_prob, chains, iterations, burn_in = 0.05, 0.5, 8, 20000, 500
    network = InProcessNetwork().attach(clients.num_clients, clients.dim, chains)
    sizes = {"num_chains": chains, "dim": clients.dim}
    where = {"dtype": torch.float64, "device": torch.device("cpu")}
    algorithm = fald.Fald(network=network, comm_prob=comm_prob, noise_corr=1.0, **sizes, **where)
    start = clients.posterior()[0].expand(chains, -1)
    draws, traffic = run_by_contract(algorithm, start, clients.gradients, torch.tensor(step), iterations)
    law = fald_stationary_law(clients, step, comm_prob, 1.0)
    kept = draws[burn_in:]
    # the chains are independent, each stationary after the burn-in (the recursion forgets its start at
    # rate (1 - step * curvature) per iteration: far below float64 rounding after 500)
    error = kept.mean((0, 1)) - law.mean
    standard_error = law.mean_standard_error(len(kept)) / chains**0.5
    # 4.5 standard errors: a false failure once in about 10^5 per coordinate
    assert (error.abs() <= 4.5 * standard_error).all(), (error, standard_error)
    # every averaging round uploads d floats per client, counted from the coins alone
    uploaded, downloaded, rounds = (np.concatenate(t) for t in zip(*traffic, strict=True))
    assert (uploaded == rounds * BITS_PER_FLOAT * clients.dim * clients.num_clients).all()
    assert (downloaded == uploaded).all()
    assert rounds.mean() == pytest.approx(comm_prob, abs=0.01)  # 160000 coins: sd 0.0013


@pytest.mark.parametrize(
    "kernel, expected",
    [
        (FaldKernel(logistic_model, 4, step_size=0.01), fald.Fald),
        (VrFaldKernel(logistic_model, 4, step_size=0.01), vr_fald.VrFald),
        (QlsdKernel(logistic_model, 4, control_variate="svrg", step_size=0.01), qlsd.Qlsd),
    ],
)
def test_every_kernel_runs_an_algorithm_of_its_module(kernel, expected):
    from pyro.infer import MCMC

    MCMC(kernel, num_samples=3, warmup_steps=1, disable_progbar=True).run(*logistic_data(num_data=20))
    assert type(kernel.algorithm) is expected and isinstance(kernel.algorithm, Algorithm)
    assert kernel.algorithm.network is kernel.network


def test_the_algorithms_keep_one_contract():
    members = ("init", "coins", "inputs", "step", "summary", "traffic")
    every = (fald.Fald, vr_fald.VrFald, qlsd.Qlsd, dula.Dula, psgld.Psgld, fsgld.Fsgld, dglmc.Dglmc)
    for algorithm in every:
        assert issubclass(algorithm, Algorithm)
        for name in members:  # each implements them, or inherits FALD's
            assert getattr(algorithm, name) is not getattr(Algorithm, name), (algorithm, name)
