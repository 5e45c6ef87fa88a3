"""The chunked iteration engine through the kernels: modes agree, chunks and thinning respect MCMC's counts,
chains are independent and batched, prepared iterations are cached, failures fall back."""

import warnings

import pyro
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel, QlsdKernel, VrFaldKernel
from pyro_fed.engine.chunk_engine import ChunkEngine

from ..models import lkj_normal, logistic_model, regression_data

X, Y = regression_data(40)
LABELS = (Y > 0).double()
CLIENTS = torch.arange(40) % 4


def run(kernel, num_samples=60, warmup=20, **kwargs):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, disable_progbar=True, **kwargs)
    mcmc.run(X, LABELS)
    return mcmc


def draws(kernel_class, mode, seed=0, num_chains=2, **options):
    options = {"step_size": 0.02, "comm_prob": 0.3, "batch_size": 5, **options}
    pyro.set_rng_seed(seed)
    kernel = kernel_class(logistic_model, CLIENTS, gradient_mode=mode, chunk_size=16, **options)
    return run(kernel, num_chains=num_chains).get_samples(group_by_chain=True)["w"]


@pytest.mark.parametrize(
    "kernel_class, options",
    [
        (FaldKernel, {}),
        (FaldKernel, {"batch_size": None, "noise_corr": 0.5}),
        (FaldKernel, {"noise_corr": 0.0}),
        (VrFaldKernel, {"refresh_prob": 0.3}),
        (VrFaldKernel, {"batch_size": None, "refresh_prob": 0.3}),
    ],
)
def test_traced_and_compiled_iterations_give_the_eager_draws(kernel_class, options):
    # the three modes consume the same pre-drawn randomness: the draws differ only by rounding
    eager = draws(kernel_class, "eager", **options)
    # tracing records the eager operations in the same order: identical up to the last bit or so
    torch.testing.assert_close(draws(kernel_class, "traced", **options), eager, rtol=0, atol=1e-12)
    # compiled kernels may reassociate sums (relative rounding ~1e-16 per iteration); the chain is
    # contractive at this step, so 80 iterations cannot amplify that beyond ~1e-12
    torch.testing.assert_close(draws(kernel_class, "compiled", **options), eager, rtol=0, atol=1e-10)


def test_chains_are_independent_reproducible_and_keep_their_statistics():
    first, again = (
        draws(FaldKernel, "traced", seed=3, num_chains=3),
        draws(FaldKernel, "traced", seed=3, num_chains=3),
    )
    assert torch.equal(first, again)
    assert first.shape == (3, 60, 3)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    pyro.set_rng_seed(4)
    kernel = FaldKernel(
        logistic_model, CLIENTS, step_size=0.02, comm_prob=0.3, batch_size=5, gradient_mode="traced"
    )
    mcmc = run(kernel, num_chains=3)
    stats = [kernel.sample_stats(chain) for chain in range(3)]
    per_average = 4 * 3 * 32  # 4 clients upload d = 3 floats
    for chain, s in enumerate(stats):
        assert len(s["communicated"]) == 60
        # each chain's bits follow its own coins
        steps = s["communicated"][1:].astype(int)
        assert (s["uploaded_bits"][1:] - s["uploaded_bits"][:-1] == per_average * steps).all()
        assert mcmc.diagnostics()["communication rounds"][f"chain {chain}"] >= s["communicated"].sum()
    assert not all((s["communicated"] == stats[0]["communicated"]).all() for s in stats[1:])


def test_chains_run_as_one_batch_in_one_process(monkeypatch):
    # on a machine with cores to spare Pyro would start worker processes; pyro_fed kernels stay in one
    from pyro.infer import NUTS
    from pyro.infer.mcmc.api import _MultiSampler, _UnarySampler

    monkeypatch.setattr("pyro.infer.mcmc.api.mp.cpu_count", lambda: 32)
    kernel = FaldKernel(logistic_model, CLIENTS, step_size=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "chains drawn sequentially" warning either
        mcmc = MCMC(kernel, num_samples=10, num_chains=4)
    assert isinstance(mcmc.sampler, _UnarySampler)
    assert kernel.plan.num_chains == 4 and kernel.plan.num_samples == 10
    assert isinstance(MCMC(NUTS(logistic_model), num_samples=10, num_chains=4).sampler, _MultiSampler)


def test_counts_and_thinning():
    # comm_prob = 1: every iteration averages once, so the bits count the iterations exactly
    per_iteration = 4 * 3 * 32
    pyro.set_rng_seed(1)
    kernel = FaldKernel(logistic_model, CLIENTS, step_size=0.02, batch_size=5, thinning=5, chunk_size=30)
    mcmc = run(kernel, num_samples=13, warmup=7)
    assert mcmc.get_samples()["w"].shape == (13, 3)
    stats = kernel.sample_stats(0)
    assert len(stats["uploaded_bits"]) == 13
    # draw j after warm-up is iteration 5 (7 + j + 1)
    assert stats["uploaded_bits"].tolist() == [per_iteration * 5 * (7 + j + 1) for j in range(13)]
    assert kernel.network.uploaded_bits.tolist() == [per_iteration * 5 * 20]  # nothing computed beyond

    # thinning keeps every 5th iterate of the same chain (chunks of 30 iterations: the same random stream)
    def chain(thinning, num_samples):
        pyro.set_rng_seed(2)
        k = FaldKernel(
            logistic_model,
            CLIENTS,
            step_size=0.02,
            comm_prob=0.3,
            batch_size=5,
            thinning=thinning,
            chunk_size=30,
            gradient_mode="traced",
        )
        return run(k, num_samples=num_samples, warmup=0).get_samples()["w"]

    torch.testing.assert_close(chain(5, 12), chain(1, 60)[4::5], rtol=0, atol=1e-12)


def test_initial_params_per_chain():
    start = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -1.0]])
    kernel = FaldKernel(logistic_model, CLIENTS, step_size=1e-12, gradient_mode="traced")
    mcmc = run(kernel, num_samples=3, warmup=0, num_chains=2, initial_params={"w": start})
    # a step of 1e-12 moves a chain by ~1e-6 from where it started
    got = mcmc.get_samples(group_by_chain=True)["w"]
    torch.testing.assert_close(got, start[:, None].expand(2, 3, 3), atol=1e-5, rtol=0)


MODULE_DATA = {"y": torch.zeros(40)}


def reads_module_data(x):
    """A model that reads its observations from outside its arguments."""
    w = pyro.sample("w", pyro.distributions.Normal(0.0, 10.0))
    with pyro.plate("data", 40) as idx:
        pyro.sample("y", pyro.distributions.Normal(w, 1.0), obs=MODULE_DATA["y"][idx])


def test_a_kernel_run_again_reads_the_models_data_again():
    # the same kernel, the same arguments, the model's data changed in between: the second run samples the
    # new posterior (a traced iteration holds what the model read as constants: it was once kept across
    # runs whose arguments were equal, and sampled the old posterior, 18 sds off)
    MODULE_DATA["y"] = torch.zeros(40)
    kernel = FaldKernel(reads_module_data, CLIENTS, step_size=0.01, batch_size=5, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=50, disable_progbar=True)
    mcmc.run(X)
    first = mcmc.get_samples()["w"]
    MODULE_DATA["y"] = torch.full((40,), 3.0)
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=50, disable_progbar=True)
    mcmc.run(X)
    second = mcmc.get_samples()["w"]
    # posteriors N(0, 1/40) and N(120/40.01, 1/40): sd 0.16, means 3 apart
    assert abs(float(first.mean())) < 0.5 and abs(float(second.mean()) - 3.0) < 0.5


def test_iteration_that_cannot_be_compiled_falls_back_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("torch._inductor.compile", broken)
    with pytest.warns(
        UserWarning, match="could not prepare the FaldKernel iteration in gradient_mode='compiled'"
    ):
        fallback = draws(FaldKernel, "compiled", seed=6)
    torch.testing.assert_close(fallback, draws(FaldKernel, "traced", seed=6), rtol=0, atol=0)


def test_auto_mode_compiles_once_the_run_is_long_enough(monkeypatch):
    def run_auto(threshold):
        monkeypatch.setattr("pyro_fed.kernels.chunks.AUTO_COMPILE_SECONDS", threshold)
        pyro.set_rng_seed(8)
        kernel = FaldKernel(
            logistic_model, CLIENTS, step_size=0.02, comm_prob=0.3, batch_size=5, chunk_size=16
        )
        return run(kernel).get_samples()["w"], kernel.engine().mode

    short, short_mode = run_auto(float("inf"))  # never worth it: traced throughout
    long, long_mode = run_auto(0.0)  # always worth it: compiled after the first chunk
    assert (short_mode, long_mode) == ("auto", "compiled")
    # the same chain either way, up to the rounding of the compiled kernels (see above)
    torch.testing.assert_close(long, short, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["compiled", "auto"])
@pytest.mark.parametrize(
    "kernel_class, options",
    [
        (VrFaldKernel, {"refresh_prob": 0.3}),
        (QlsdKernel, {"control_variate": "svrg", "snapshot_every": 5}),
    ],
)
def test_a_model_that_cannot_be_compiled_runs_its_refreshes_and_snapshots_to_the_end(
    kernel_class, options, mode, monkeypatch
):
    # TorchInductor rewrites a graph to return a list before failing on the LKJ model's data-dependent
    # shapes: every fallback (the iteration, the clients' full gradients of a refresh or a snapshot) must
    # still return what the traced function does, also after "auto" switches to compiled mid-run (forced
    # after the first chunk here)
    monkeypatch.setattr("pyro_fed.kernels.chunks.AUTO_COMPILE_SECONDS", 0.0)
    y = torch.randn(30, 3, generator=torch.Generator().manual_seed(0))

    def sample(gradient_mode):
        pyro.set_rng_seed(4)
        kernel = kernel_class(
            lkj_normal, 3, step_size=0.01, batch_size=5, chunk_size=16, gradient_mode=gradient_mode, **options
        )
        mcmc = MCMC(kernel, num_samples=40, warmup_steps=10, disable_progbar=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pyro_fed could not prepare")
            mcmc.run(y)
        return mcmc.get_samples()["cholesky"], kernel

    draws, kernel = sample(mode)
    assert kernel.engine().mode == "compiled"  # the switch happened ("auto") or was asked for
    # the fallbacks run the very graphs gradient_mode="traced" runs: the same draws, bit for bit
    torch.testing.assert_close(draws, sample("traced")[0], rtol=0, atol=0)


def test_a_compiled_iteration_returning_its_state_in_other_strides_gives_the_eager_values():
    # compiled code reads its inputs with the strides it was prepared for, unchecked: an iteration that
    # returns its state transposed in memory must have it copied back into the strides it takes
    def iteration(state, inputs, constants):
        (x,), (noise,), (scale,) = state, inputs, constants
        moved = (x * scale + noise.cumsum(-1)).t().contiguous().t()  # [2, 3] with strides (1, 2)
        return (moved,), (moved.sum(),)

    start = torch.arange(6.0).reshape(2, 3)
    inputs = (torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(0)),)
    constants = (torch.tensor([[0.5], [2.0]]),)
    results = {}
    for mode in ("eager", "compiled"):
        engine = ChunkEngine(iteration, mode, what="a test iteration")
        (last,), (sums,) = engine.run((start,), inputs, constants, 0, 5)
        assert engine.prepared((start,), tuple(t[0] for t in inputs), constants).mode == mode
        results[mode] = last, sums
    assert torch.allclose(results["compiled"][0], results["eager"][0])
    assert torch.allclose(results["compiled"][1], results["eager"][1])
    # and the state comes back in the strides the chunk started with, so that the next chunk reuses it
    assert results["compiled"][0].stride() == start.stride()
