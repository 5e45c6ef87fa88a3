"""The kernels on a device other than the default one: on a CUDA device (skipped without one), CUDA-graph
replay of full chunks gives the draws of the eager reference, with chains, minibatches and VR-FALD⋆'s
refreshes; and every kernel at its defaults runs with the data on the device, as a Pyro user puts them there
(the default device set to it, or the data alone moved). The default-device tests also run on the CPU under a
``torch.device("cpu")`` context, which routes every tensor operation through the device mode that
``torch.set_default_device("cuda")`` installs: code that behaves otherwise under that mode fails there without
a GPU (host and device tensors mixed show only on a GPU)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

import pyro_fed
from pyro_fed import DulaKernel, FaldKernel, QlsdKernel, VrFaldKernel

from .models import logistic_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    """A device, made torch's default one the way a Pyro user does it (``torch.set_default_device``); the
    CPU through a device context, which ``set_default_device("cpu")`` would not install."""
    if request.param == "cuda":
        torch.set_default_device("cuda")
        yield "cuda"
        torch.set_default_device("cpu")
    else:
        with torch.device("cpu"):
            yield "cpu"


def titanic_split():
    """Titanic and 10 Dirichlet(0.5) clients, made on the default device (the clients on the host)."""
    x, y = pyro_fed.datasets.titanic()
    return x, y, pyro_fed.partition.dirichlet(y, num_clients=10, alpha=0.5, seed=0)


def sample_on(device: str, kernel, x, y, *, warmup_steps=32, posterior_predictive=False) -> MCMC:
    """Two chains of 64 draws of ``kernel``: finite draws on ``device``, and ArviZ's posterior of them."""
    mcmc = MCMC(kernel, num_samples=64, warmup_steps=warmup_steps, num_chains=2, disable_progbar=True)
    mcmc.run(x, y)
    samples = mcmc.get_samples()["w"]
    assert samples.device.type == device and torch.isfinite(samples).all()
    idata = pyro_fed.to_inference_data(mcmc, posterior_predictive=posterior_predictive)
    assert idata.posterior["w"].shape == (2, 64, 4)
    return mcmc


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


@needs_cuda
@pytest.mark.parametrize("device", ["cuda"], indirect=True)
@pytest.mark.parametrize(
    "kernel_class, options",
    [
        (FaldKernel, {"batch_size": 8}),
        (FaldKernel, {}),
        (VrFaldKernel, {"batch_size": 8, "refresh_prob": 0.05}),
    ],
)
def test_cuda_graph_chunks_give_the_eager_draws(device, kernel_class, options):
    eager, _ = draws(kernel_class, "eager", **options)
    compiled, kernel = draws(kernel_class, "compiled", **options)
    # FALD runs whole chunks of 64 iterations: they must have been captured and replayed as CUDA graphs
    if kernel_class is FaldKernel:
        assert kernel.engine()._graphs
    # float64; compiled kernels may reassociate sums: rounding differences only
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-9)
    assert not torch.equal(compiled[0], compiled[1])


@pytest.mark.parametrize("kernel_class", [FaldKernel, VrFaldKernel])
def test_defaults_and_the_readme_setting_under_the_default_device(device, kernel_class):
    # torch.set_default_device("cuda") is how a Pyro user moves a model to the GPU: the data sets, the
    # partitions (host generators), the warm-up adaptation, coins and minibatches must all follow it
    x, y, clients = titanic_split()
    pyro.set_rng_seed(0)
    for kernel in (
        kernel_class(logistic_model),
        kernel_class(logistic_model, clients, comm_prob=0.2, batch_size=32),
    ):
        sample_on(device, kernel, x, y, posterior_predictive=True)
        assert kernel.adaptation.preconditioner.device.type == device


def test_qlsd_plus_plus_under_the_default_device(device):
    x, y, clients = titanic_split()
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
    sample_on(device, kernel, x, y)
    assert kernel.diagnostics()["uploaded bits"] > 0


@pytest.mark.parametrize("graph", ["ring", "complete"])
def test_dula_at_its_defaults_under_the_default_device(device, graph):
    # D-ULA's automatic step reads the graph's spectrum and its agents' data pulls: both must follow the
    # default device, as must the gossip of every step
    x, y, clients = titanic_split()
    pyro.set_rng_seed(0)
    sample_on(device, DulaKernel(logistic_model, clients, graph=graph, record_agents=True), x, y)


@pytest.mark.parametrize(
    "make",
    [
        lambda clients: QlsdKernel(logistic_model, clients),  # QLSD: compression and partial participation
        lambda clients: DulaKernel(logistic_model, clients, graph="erdos_renyi"),
        lambda clients: pyro_fed.SgldKernel(logistic_model),
        lambda clients: pyro_fed.PsgldKernel(logistic_model, clients),
        lambda clients: pyro_fed.SvrgLdKernel(logistic_model),
        lambda clients: pyro_fed.FsgldKernel(logistic_model, clients),
        lambda clients: pyro_fed.DglmcKernel(logistic_model, clients),
    ],
    ids=["QLSD", "D-ULA erdos_renyi", "SGLD", "pSGLD", "SVRG-LD", "FSGLD", "DG-LMC"],
)
def test_the_other_kernels_at_their_defaults_under_the_default_device(device, make):
    x, y, clients = titanic_split()
    pyro.set_rng_seed(0)
    sample_on(device, make(clients), x, y)


def logistic_model_on_the_data_device(x, y=None):
    """:func:`~tests.models.logistic_model` with its prior's parameters made where the data are, as a model
    must be written for data moved to a GPU alone (Pyro's own NUTS needs the same)."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        pyro.sample(
            "y", dist.Bernoulli(logits=pyro.subsample(x, event_dim=1) @ w), obs=pyro.subsample(y, event_dim=0)
        )


@needs_cuda
@pytest.mark.parametrize(
    "kernel_class, options",
    [(FaldKernel, {}), (VrFaldKernel, {}), (QlsdKernel, {"control_variate": "svrg"}), (DulaKernel, {})],
)
def test_every_kernel_at_its_defaults_with_the_data_moved_to_the_gpu(kernel_class, options):
    # the other way a user moves a model to the GPU: the data alone (x.cuda()), the default device left on
    # the CPU; the warm-up's host-side draws (typical points, the Lanczos start, the pilot's noise) and its
    # windowed re-adaptation from the chains' draws must follow the data, not the default device
    x, y, clients = titanic_split()
    pyro.set_rng_seed(0)
    kernel = kernel_class(logistic_model_on_the_data_device, clients, **options)
    # a warm-up long enough for the windowed re-adaptation (a fraction of it, at least MIN_WINDOW_DRAWS)
    sample_on("cuda", kernel, x.cuda(), y.cuda(), warmup_steps=200, posterior_predictive=True)
