"""How a chunk runs: its steps unchecked, then one divergence check at its end (a diverging chunk is run
again, each step checked), and the steps that meet no other client without the network."""

import time
import warnings

import numpy as np
import pytest
import torch
from pyro.infer import MCMC

from pyro_fed import FaldKernel, QlsdKernel, VrFaldKernel
from pyro_fed.algorithms import qlsd as qlsd_module
from pyro_fed.kernels.chunks import ChunkRunner, working_rows
from pyro_fed.model.potential import FederatedPotential
from pyro_fed.network.in_process import InProcessNetwork

from ..models import gaussian_regression, logistic_data, logistic_model, regression_data

CLIENTS = torch.arange(40) % 4
MODEL = gaussian_regression(0.5)
#: steps too large for the data: some of the chains' steps explode, others not
DIVERGING = {
    "FALD": lambda model=MODEL, **kw: FaldKernel(
        model, CLIENTS, step_size=0.2, comm_prob=0.5, batch_size=5, **kw
    ),
    "VR-FALD*": lambda model=MODEL, **kw: VrFaldKernel(
        model, CLIENTS, step_size=0.2, refresh_prob=0.3, batch_size=5, **kw
    ),
    "QLSD++": lambda model=MODEL, **kw: QlsdKernel(
        model, CLIENTS, step_size=0.06, control_variate="svrg", snapshot_every=3, batch_size=5, **kw
    ),
}


def run(kernel, num_samples=120):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=0, num_chains=2, disable_progbar=True)
    torch.manual_seed(0)
    with pytest.warns(UserWarning):  # the end-of-run checks, and the divergences'
        mcmc.run(*regression_data(40))
    return mcmc.get_samples(group_by_chain=True)["w"], kernel


@pytest.mark.parametrize("name", DIVERGING)
def test_a_chunk_checked_at_its_end_gives_the_draws_of_steps_checked_one_by_one(name, monkeypatch):
    draws, kernel = run(DIVERGING[name]())
    diverging = kernel.runner.buffer.sample_stats(0, 0, 120)["diverging"]
    # the case this is about: a chunk where some steps diverge and others not
    assert 0 < diverging.sum() < len(diverging), diverging.sum()
    checked_run = ChunkRunner._run
    monkeypatch.setattr(
        ChunkRunner, "_run", lambda self, *args, checked: checked_run(self, *args, checked=True)
    )
    every_step_checked, _ = run(DIVERGING[name]())
    assert torch.equal(draws, every_step_checked)
    # a reverted step leaves the chain where it was: its draw repeats the one before, to the bit
    for chain in range(2):
        stats = kernel.runner.buffer.sample_stats(chain, 0, 120)
        for j in stats["diverging"].nonzero()[0]:
            if j > 0:
                assert torch.equal(draws[chain, j], draws[chain, j - 1])


@pytest.mark.parametrize("name", DIVERGING)
def test_the_model_is_never_evaluated_where_a_step_diverged(name):
    # a likelihood that raises at a NaN location, run eagerly (its checks in Python), in float32, where a
    # diverging chain reaches inf, then NaN, within a chunk: the unchecked steps of a chunk, and its events,
    # must not reach the model from a point that diverged
    torch.set_default_dtype(torch.float32)
    kernel = DIVERGING[name](gaussian_regression(0.5, validate_args=True), gradient_mode="eager")
    _, kernel = run(kernel)
    assert kernel.runner.buffer.sample_stats(0, 0, 120)["diverging"].sum() > 0


class RemoteNetwork(InProcessNetwork):
    """The in-process network, as if some clients were held elsewhere; counts the averaging steps."""

    remote = True

    def __init__(self):
        super().__init__()
        self.averaging_steps = 0

    def average_where(self, communicate, clients):
        self.averaging_steps += 1
        return super().average_where(communicate, clients)


def test_iterations_that_meet_no_client_run_without_the_network_and_to_the_same_draws():
    def fald(network=None):
        kernel = FaldKernel(
            logistic_model,
            6,
            step_size=0.01,
            comm_prob=0.3,
            batch_size=4,
            gradient_mode="eager",
            network=network,
        )
        MCMC(kernel, num_samples=200, warmup_steps=0, disable_progbar=True).run(*logistic_data(60))
        return kernel

    torch.manual_seed(0)
    here = fald()
    torch.manual_seed(0)
    elsewhere = fald(RemoteNetwork())
    rounds = int(elsewhere.network.rounds[0])
    assert 30 < rounds < 90  # 200 coins of probability 0.3: 60 +- 6.5
    # eager: one average per iteration that communicates, none in the others
    assert elsewhere.network.averaging_steps == rounds
    # an average skipped is the select of the iterates kept: the same bits
    assert (here.runner.buffer.all_draws(0) == elsewhere.runner.buffer.all_draws(0)).all()


def test_working_rows_list_the_held_working_pairs_in_a_width_every_holder_shares():
    working = np.zeros((2, 2, 5), dtype=bool)  # [K, C, b]
    working[0, 0, [1, 3]] = working[0, 1, 4] = True  # iteration 0: pairs 1, 3 and 9 of one holder of all
    working[1, 1, [0, 1, 2, 3, 4]] = True  # iteration 1: pairs 5..9
    rows = working_rows(working, [slice(0, 5)], slice(0, 5))
    assert rows.tolist() == [[1, 3, 9, 10, 10], [5, 6, 7, 8, 9]]  # padded with C b = 10
    # two holders of clients 0..2 and 3..4: the width is the larger count of either (iteration 1: 3 pairs
    # of the first, 2 of the second), the same for both, and each lists its own pairs (c b_h + i)
    first = working_rows(working, [slice(0, 3), slice(3, 5)], slice(0, 3))
    second = working_rows(working, [slice(0, 3), slice(3, 5)], slice(3, 5))
    assert first.tolist() == [[1, 6, 6], [3, 4, 5]]
    assert second.tolist() == [[0, 3, 4], [2, 3, 4]]  # the smaller holder pads to the shared width
    # widths are rounded up to a quarter of their power of two: few shapes over a run
    many = np.ones((1, 1, 1000), dtype=bool)
    many[0, 0, 101:] = False  # 101 working pairs: a width of 112
    assert working_rows(many, [slice(0, 1000)], slice(0, 1000)).shape == (1, 112)


@pytest.mark.parametrize(
    "options",
    [
        {"quantization_levels": 16, "batch_size": 3},
        {"control_variate": "svrg", "snapshot_every": 5, "batch_size": 3},
        {},  # full local batches
    ],
)
def test_partial_participation_evaluates_the_active_clients_alone_to_the_same_draws(options, monkeypatch):
    def qlsd():
        kernel = QlsdKernel(
            logistic_model, 8, participation=0.3, step_size=0.01, gradient_mode="traced", **options
        )
        mcmc = MCMC(kernel, num_samples=100, warmup_steps=0, num_chains=2, disable_progbar=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc.run(*logistic_data(80))
        # traced as it is without the selection (the whole data's padding is built before the tracing)
        assert not [w for w in caught if "could not prepare" in str(w.message)]
        return kernel.runner.buffer.all_draws(0)

    evaluated = []
    gradient_fn = FederatedPotential.working_gradients

    def counted(self, points, rows, *args):
        evaluated.append(len(rows))
        return gradient_fn(self, points, rows, *args)

    monkeypatch.setattr(FederatedPotential, "working_gradients", counted)
    torch.manual_seed(0)
    selected = qlsd()
    # 2 chains x 8 clients x 0.3: about 5 active pairs, 16 at most; padded to 1.25 times the chunk's largest
    assert evaluated and max(evaluated) < 16
    monkeypatch.setattr(qlsd_module.Qlsd, "selects_clients", False)  # every client's gradient, as before
    torch.manual_seed(0)
    assert np.array_equal(selected, qlsd())


def run_quietly(kernel, num_samples: int) -> None:
    """Two chains of ``num_samples`` draws of the regression, without warm-up, their end-of-run warnings (a
    short run's) silenced."""
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=0, num_chains=2, disable_progbar=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(*regression_data(40))


def test_an_events_first_preparation_does_not_count_as_the_iterations_time(monkeypatch):
    # gradient_mode="auto" compiles when the traced iterations still to run are projected to take longer
    # than AUTO_COMPILE_SECONDS. A refresh's first preparation of the clients' full gradients (made 1 s long
    # here) once counted as the iterations' time: projected over the run's ~12 chunks it made a short run
    # pay a compilation (VR-FALD* on posteriordb's logearn_interaction_z: 3.6 s traced, 8.3 s compiled). The
    # iterations themselves take milliseconds, projected far below the 10 s threshold here
    import pyro_fed.model.potential as potential_module

    prepare = potential_module.prepare

    def slow_prepare(function, args, mode, *, what, **kwargs):
        prepared = prepare(function, args, mode, what=what, **kwargs)
        if what == "the clients' full gradients":  # a preparation 1 s longer, and counted so
            time.sleep(1.0)
            prepared.seconds += 1.0
        return prepared

    monkeypatch.setattr(potential_module, "prepare", slow_prepare)
    monkeypatch.setattr("pyro_fed.kernels.chunks.AUTO_COMPILE_SECONDS", 10.0)
    kernel = VrFaldKernel(MODEL, CLIENTS, step_size=0.01, refresh_prob=0.3, batch_size=5, chunk_size=16)
    run_quietly(kernel, 200)
    assert kernel.preparation_seconds >= 1.0  # a refresh prepared a new shape of the full gradients
    assert kernel.engine().mode == "auto" and kernel.potential.gradient_mode == "auto"


def test_one_stalled_chunk_does_not_make_a_run_compile(monkeypatch):
    # gradient_mode="auto" projects the traced iterations still to run at the rate of the fastest chunk so
    # far: one chunk stalled by the machine (0.5 s here; a tenth of a second is enough on a run of thousands
    # of iterations) projected over the rest would have exceeded the 2 s threshold, where the iterations
    # themselves (about a millisecond a chunk) project a few tenths of a second
    runs = ChunkRunner._run
    calls = []

    def stalled(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            time.sleep(0.5)
        return runs(self, *args, **kwargs)

    monkeypatch.setattr(ChunkRunner, "_run", stalled)
    monkeypatch.setattr("pyro_fed.kernels.chunks.AUTO_COMPILE_SECONDS", 2.0)
    kernel = FaldKernel(MODEL, CLIENTS, step_size=0.01, batch_size=5, thinning=1, chunk_size=16)
    run_quietly(kernel, 400)
    assert len(calls) > 3  # the stalled chunk ran, and others after it
    assert kernel.engine().mode == "auto"


def test_after_a_first_compilation_the_threshold_to_compile_drops(monkeypatch):
    # a process's first TorchInductor compilation also loads and warms TorchInductor (13 s on a posteriordb
    # regression here), a later one of another function costs 4 to 5 s: gradient_mode="auto" then compiles
    # from AUTO_COMPILE_SECONDS_AFTER_FIRST seconds of traced iterations ahead, never from more than before
    from pyro_fed.engine import compile as compile_module
    from pyro_fed.kernels import chunks

    monkeypatch.setattr(compile_module, "_compilations", 0)
    assert chunks.auto_compile_seconds() == chunks.AUTO_COMPILE_SECONDS == 20.0
    monkeypatch.setattr(compile_module, "_compilations", 1)
    assert chunks.auto_compile_seconds() == chunks.AUTO_COMPILE_SECONDS_AFTER_FIRST == 8.0
    monkeypatch.setattr(chunks, "AUTO_COMPILE_SECONDS", 2.0)  # a threshold set lower stays lower
    assert chunks.auto_compile_seconds() == 2.0
    # a run decides with it: no threshold before a compilation, a zero one after
    monkeypatch.setattr(chunks, "AUTO_COMPILE_SECONDS", float("inf"))
    monkeypatch.setattr(chunks, "AUTO_COMPILE_SECONDS_AFTER_FIRST", 0.0)
    for compilations, mode in ((0, "auto"), (1, "compiled")):
        monkeypatch.setattr(compile_module, "_compilations", compilations)
        kernel = FaldKernel(MODEL, CLIENTS, step_size=0.01, batch_size=5, thinning=1, chunk_size=16)
        run_quietly(kernel, 64)
        assert kernel.engine().mode == mode
