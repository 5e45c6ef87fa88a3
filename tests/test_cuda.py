"""The chunked engine on a CUDA device (skipped without one): CUDA-graph replay of full chunks gives the
draws of the eager reference, with chains, minibatches and VR-FALD⋆'s refreshes."""

import pyro
import pytest
import torch
from pyro.infer import MCMC

import pyro_fed
from pyro_fed import FaldKernel, QlsdKernel, VrFaldKernel

from .models import logistic_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_default():
    torch.set_default_device("cuda")
    yield
    torch.set_default_device("cpu")


def draws(kernel_class, mode, **options):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(200, 5, generator=generator, device="cuda")
    y = torch.bernoulli(torch.sigmoid(x @ torch.linspace(-1, 1, 5, device="cuda")), generator=generator)
    pyro.set_rng_seed(0)
    kernel = kernel_class(
        logistic_model, torch.arange(200) % 10, step_size=0.01, comm_prob=0.3, gradient_mode=mode, **options
    )
    mcmc = MCMC(kernel, num_samples=128, warmup_steps=64, num_chains=3, disable_progbar=True)
    mcmc.run(x, y)
    samples = mcmc.get_samples(group_by_chain=True)["w"]
    assert samples.is_cuda and torch.isfinite(samples).all()
    return samples, kernel


@pytest.mark.parametrize(
    "kernel_class, options",
    [
        (FaldKernel, {"batch_size": 8}),
        (FaldKernel, {}),
        (VrFaldKernel, {"batch_size": 8, "refresh_prob": 0.05}),
    ],
)
def test_cuda_graph_chunks_give_the_eager_draws(cuda_default, kernel_class, options):
    eager, _ = draws(kernel_class, "eager", **options)
    compiled, kernel = draws(kernel_class, "compiled", **options)
    # FALD runs whole chunks of 64 iterations: they must have been captured and replayed as CUDA graphs
    if kernel_class is FaldKernel:
        assert kernel.engine()._graphs
    # float64; compiled kernels may reassociate sums: rounding differences only
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-9)
    assert not torch.equal(compiled[0], compiled[1])


@pytest.mark.parametrize("kernel_class", [FaldKernel, VrFaldKernel])
def test_defaults_and_the_readme_setting_under_the_cuda_default_device(cuda_default, kernel_class):
    # torch.set_default_device("cuda") is how a Pyro user moves a model to the GPU: the data sets, the
    # partitions (host generators), the warm-up adaptation, coins and minibatches must all follow it
    x, y = pyro_fed.datasets.titanic()
    clients = pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5, seed=0)
    pyro.set_rng_seed(0)
    for kernel in (
        kernel_class(logistic_model),
        kernel_class(logistic_model, clients, comm_prob=0.2, batch_size=32),
    ):
        mcmc = MCMC(kernel, num_samples=64, warmup_steps=32, num_chains=2, disable_progbar=True)
        mcmc.run(x, y)
        samples = mcmc.get_samples()["w"]
        assert samples.is_cuda and torch.isfinite(samples).all()
        assert kernel.adaptation.preconditioner.is_cuda
        idata = pyro_fed.to_inference_data(mcmc, posterior_predictive=True)
        assert idata.posterior["w"].shape == (2, 64, 4)


def test_qlsd_plus_plus_under_the_cuda_default_device(cuda_default):
    x, y = pyro_fed.datasets.titanic()
    clients = pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5, seed=0)
    pyro.set_rng_seed(0)
    kernel = QlsdKernel(
        logistic_model,
        clients,
        quantization_levels=2**4,
        control_variate="svrg",
        snapshot_every=20,
        participation=0.5,
        batch_size=0.1,
        prior_on_server=True,
    )
    mcmc = MCMC(kernel, num_samples=64, warmup_steps=32, num_chains=2, disable_progbar=True)
    mcmc.run(x, y)
    samples = mcmc.get_samples()["w"]
    assert samples.is_cuda and torch.isfinite(samples).all()
    assert kernel.diagnostics()["uploaded bits"] > 0
