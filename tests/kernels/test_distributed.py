"""Every kernel with its clients split over the ranks of a real gloo group on localhost gives, on every rank,
the draws of the one-process run on all the data with the same seed and the same global assignment."""

import json
import os
import time
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import MCMC
from pyro.infer.reparam import LocScaleReparam

from pyro_fed import (
    DglmcKernel,
    DulaKernel,
    FaldKernel,
    FsgldKernel,
    PsgldKernel,
    QlsdKernel,
    VrFaldKernel,
    to_inference_data,
)
from pyro_fed.algorithms.dula_step import CONSENSUS_MEAN_TARGET
from pyro_fed.kernels.chunks import ChunkRunner
from pyro_fed.network.distributed import CENSUS_SECONDS, shard
from pyro_fed.partition import dirichlet
from tests.kernels.test_dula import drift_at
from tests.kernels.test_user_posteriors import centred_effects, grouped_data
from tests.models import logistic_data, logistic_model, logistic_model_for_nuts
from tests.network.forked import run_forked

NUM_DATA, NUM_CLIENTS = 60, 6
TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "own_kernel.ipynb"


def tutorial_classes() -> dict:
    """The own-kernel tutorial's code cells that define its algorithms and kernels (and their imports), run
    as they are: what a reader copies must hold under several processes too."""
    namespace = {}
    for cell in json.loads(TUTORIAL.read_text())["cells"]:
        source = "".join(cell["source"])
        if (
            cell["cell_type"] == "code"
            and ("import" in source or "class " in source)
            and "MCMC(" not in source
        ):
            exec(compile(source, str(TUTORIAL), "exec"), namespace)
    return namespace


OWN = tutorial_classes()
KERNELS = {
    "FALD": lambda c, **kw: FaldKernel(
        logistic_model, c, comm_prob=0.5, noise_corr=0.5, batch_size=4, step_size=0.01, **kw
    ),
    "VR-FALD*": lambda c, **kw: VrFaldKernel(
        logistic_model, c, comm_prob=0.5, batch_size=4, refresh_prob=0.2, step_size=0.01, **kw
    ),
    "QLSD#": lambda c, **kw: QlsdKernel(
        logistic_model, c, quantization_levels=4, participation=0.5, batch_size=4, step_size=0.002, **kw
    ),
    "QLSD++": lambda c, **kw: QlsdKernel(
        logistic_model, c, control_variate="svrg", batch_size=4, snapshot_every=5, step_size=0.002, **kw
    ),
    "D-ULA ring": lambda c, **kw: DulaKernel(logistic_model, c, step_size=0.002, **kw),
    "D-ULA graph": lambda c, **kw: DulaKernel(
        logistic_model, c, graph="erdos_renyi", schedule="decaying", step_size=0.002, **kw
    ),
    # the oracle evaluates the active clients alone, of their whole data
    "LSD participation 0.3": lambda c, **kw: QlsdKernel(
        logistic_model, c, participation=0.3, step_size=0.002, **kw
    ),
    # the papers' baselines
    "pSGLD": lambda c, **kw: PsgldKernel(logistic_model, c, batch_size=4, step_size=0.002, **kw),
    "FSGLD": lambda c, **kw: FsgldKernel(
        logistic_model, c, local_steps=2, batch_size=4, step_size=0.002, **kw
    ),
    "DG-LMC": lambda c, **kw: DglmcKernel(logistic_model, c, tolerance=0.05, step_size=0.002, **kw),
    # the own-kernel tutorial's, as a reader writes it
    "tutorial's partial participation": lambda c, **kw: OWN["PartialServerLangevinKernel"](
        logistic_model, c, participation=0.5, step_size=0.002, **kw
    ),
    # its noise measure's coins drawn for every client: the same automatic step on any layout
    "tutorial's partial participation, automatic": lambda c, **kw: OWN["PartialServerLangevinKernel"](
        logistic_model, c, participation=0.5, **kw
    ),
    # everything automatic: the warm-up's mode search, curvatures, minibatch, pilot and thinning
    "FALD automatic": lambda c, **kw: FaldKernel(logistic_model, c, **kw),
    "QLSD++ automatic": lambda c, **kw: QlsdKernel(logistic_model, c, control_variate="svrg", **kw),
}
#: the model as a NUTS user writes it (its data read at full size): each rank runs it on its clients' rows
FOR_NUTS = {
    "FALD automatic": lambda c, **kw: FaldKernel(logistic_model_for_nuts, c, **kw),
    "QLSD++ automatic": lambda c, **kw: QlsdKernel(logistic_model_for_nuts, c, control_variate="svrg", **kw),
    "D-ULA ring": lambda c, **kw: DulaKernel(logistic_model_for_nuts, c, step_size=0.002, **kw),
}
KERNELS.update({f"{name}, model written for NUTS": make for name, make in FOR_NUTS.items()})


def run_kernel(name, clients, data, network=None) -> MCMC:
    kernel = KERNELS[name](clients, network=network, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
    pyro.set_rng_seed(0)
    mcmc.run(*data)
    return mcmc


def draws(name, clients, data, network=None):
    mcmc = run_kernel(name, clients, data, network)
    diagnostics = mcmc.kernel.diagnostics()
    bits = (diagnostics["uploaded bits"], diagnostics["downloaded bits"], diagnostics["communication rounds"])
    return mcmc.get_samples(group_by_chain=True)["w"], bits


def on_ranks(names):
    """Each rank loads only its clients' rows of the data and runs the kernels on them."""

    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        return {name: draws(name, clients, (x[rows], y[rows]), network) for name in names}

    return run


@pytest.fixture(scope="module")
def two_ranks():
    return run_forked(on_ranks(list(KERNELS)), 2, timeout_seconds=300)


@pytest.mark.parametrize("name", KERNELS)
def test_two_ranks_give_the_one_process_draws(two_ranks, name):
    expected, expected_bits = draws(name, NUM_CLIENTS, logistic_data(num_data=NUM_DATA, dim=3))
    first, second = (result[name] for result in two_ranks)
    # the ranks reduce the same partial sums in the same order: the same bits on both
    assert torch.equal(first[0], second[0]) and first[1] == second[1]
    # the one-process sums reassociated over two blocks of clients: float64 rounding, far below the
    # draws' scale of 0.1-1 (the warm-up's choices, from the same sums, are the same)
    torch.testing.assert_close(first[0], expected, rtol=1e-9, atol=1e-9)
    assert first[1] == expected_bits  # the bits the algorithm sends, counted from the same coins


@pytest.mark.parametrize("name", FOR_NUTS)
def test_a_model_written_for_nuts_gives_the_subsample_form_s_draws_on_every_rank(two_ranks, name):
    for result in two_ranks:
        assert torch.equal(result[f"{name}, model written for NUTS"][0], result[name][0])


def test_three_ranks_holding_unequal_blocks_give_the_one_process_draws():
    # 7 clients over 3 ranks: blocks of 2, 2 and 3
    names = ["FALD", "QLSD#", "D-ULA ring"]

    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(7, NUM_DATA, network)
        return {name: draws(name, clients, (x[rows], y[rows]), network)[0] for name in names}

    results = run_forked(run, 3, timeout_seconds=300)
    for name in names:
        expected, _ = draws(name, 7, logistic_data(num_data=NUM_DATA, dim=3))
        for result in results:
            torch.testing.assert_close(result[name], expected, rtol=1e-9, atol=1e-9)


def local_steps_automatic(clients, data, network=None):
    """FALD with local steps (its stiffness per client) and everything else automatic."""
    kernel = FaldKernel(logistic_model, clients, comm_prob=0.5, network=network, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
    pyro.set_rng_seed(0)
    mcmc.run(*data)
    return mcmc.get_samples(group_by_chain=True)["w"]


def test_a_rank_holding_one_client_runs_the_automatic_warm_up_of_the_others():
    # 3 clients over 2 ranks (1 and 2): the minibatch noise of the clients' own estimates was told from a
    # server's by the number of rows held, so the rank with one row skipped the others' sum

    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(3, NUM_DATA, network)
        return local_steps_automatic(clients, (x[rows], y[rows]), network)

    results = run_forked(run, 2, timeout_seconds=300)
    expected = local_steps_automatic(3, logistic_data(num_data=NUM_DATA, dim=3))
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-9, atol=1e-9)


def test_clients_of_a_block_split_between_ranks_draw_what_they_draw_in_one_process():
    # 600 clients of 6 points: three blocks of randomness, the ranks' boundary (300) inside the second one;
    # noise, minibatches (4 of 6 points), compressor uniforms and agents' noise all drawn by blocks
    names, clients, num_data = ["FALD", "QLSD#", "D-ULA ring"], 600, 3600

    def run(rank, world_size, network):
        x, y = logistic_data(num_data=num_data, dim=3)
        rows, held = shard(clients, num_data, network)
        return {name: draws(name, held, (x[rows], y[rows]), network)[0] for name in names}

    results = run_forked(run, 2, timeout_seconds=300)
    for name in names:
        expected, _ = draws(name, clients, logistic_data(num_data=num_data, dim=3))
        for result in results:
            torch.testing.assert_close(result[name], expected, rtol=1e-9, atol=1e-9)


# the warm-up with everything automatic on clients that differ: a label-skewed split of a logistic regression
SKEWED_DATA, SKEWED_CLIENTS = 200, 8
AUTOMATIC = {
    "QLSD++ 2^8 levels, participation 0.5": lambda c, **kw: QlsdKernel(
        logistic_model, c, quantization_levels=2**8, control_variate="svrg", participation=0.5, **kw
    ),
    # the quantiser's noise measured at each setting of the levels, summed over the clients wherever held
    "QLSD++ automatic levels": lambda c, **kw: QlsdKernel(
        logistic_model, c, quantization_levels="auto", control_variate="svrg", **kw
    ),
    "D-ULA ring": lambda c, **kw: DulaKernel(logistic_model, c, **kw),
    "D-ULA graph": lambda c, **kw: DulaKernel(logistic_model, c, graph="erdos_renyi", **kw),
}


def skewed_data():
    """Binary labels of a logistic regression, split over 8 clients by a Dirichlet(0.5) label skew: clients
    of 4 to 55 points, with 7% to 100% of ones (their posteriors and gradients differ)."""
    x, _ = logistic_data(num_data=SKEWED_DATA, dim=3)
    generator = torch.Generator().manual_seed(1)
    y = (
        torch.rand(SKEWED_DATA, generator=generator) < torch.sigmoid(x @ torch.tensor([1.0, -1.0, 0.5]))
    ).double()
    return x, y, dirichlet(y, SKEWED_CLIENTS, alpha=0.5, seed=0)


def automatic_run(name, clients, data, network=None):
    """The draws of an automatic run, its step, and for D-ULA the drift of the average that the agents'
    disagreement causes (what its automatic step is shrunk by) at the chosen step and at 2 and 4 times it."""
    kernel = AUTOMATIC[name](clients, network=network, gradient_mode="traced")
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
    pyro.set_rng_seed(0)
    mcmc.run(*data)
    step = kernel.current_step_size
    drifts = []
    if isinstance(kernel, DulaKernel):
        drifts = [drift_at(kernel, factor * step) for factor in (1, 2, 4)]
    return mcmc.get_samples(group_by_chain=True)["w"], step, drifts


def automatic_on_ranks(rank, world_size, network):
    x, y, assignment = skewed_data()
    rows, clients = shard(assignment, SKEWED_DATA, network)
    return {name: automatic_run(name, clients, (x[rows], y[rows]), network) for name in AUTOMATIC}


@pytest.fixture(scope="module")
def one_process_automatic_runs():
    x, y, assignment = skewed_data()
    clients = [torch.nonzero(assignment == i).flatten() for i in range(SKEWED_CLIENTS)]
    return {name: automatic_run(name, clients, (x, y)) for name in AUTOMATIC}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_automatic_warm_up_on_differing_clients_gives_the_one_process_draws_on_every_layout(
    world_size, one_process_automatic_runs
):
    # 8 clients: blocks of 4 and 4, or of 2, 3 and 3. Everything the warm-up draws for the clients (QLSD's
    # compressor uniforms and participation coins of its noise measure, D-ULA's disagreement) is drawn by
    # blocks of clients or for all agents alike, and every reduction is over all clients: the same step, the
    # same draws
    expected = one_process_automatic_runs
    results = run_forked(automatic_on_ranks, world_size, timeout_seconds=300)
    for name, (draws_expected, step, drifts) in expected.items():
        for result in results:
            draws_here, step_here, drifts_here = result[name]
            # sums over clients reassociated over blocks: float64 rounding
            assert step_here == pytest.approx(step, rel=1e-12), name
            torch.testing.assert_close(torch.tensor(drifts_here), torch.tensor(drifts), rtol=1e-9, atol=0)
            torch.testing.assert_close(draws_here, draws_expected, rtol=1e-9, atol=1e-9)
    # D-ULA's disagreement shrinks its step here (the drift at twice the step is past its target): the
    # search that decides it ran, on drifts measured the same on every layout
    for name in ("D-ULA ring", "D-ULA graph"):
        assert expected[name][2][1] > CONSENSUS_MEAN_TARGET


def test_each_rank_has_the_whole_posterior_for_arviz_refuses_a_partial_log_likelihood_and_rank_0_the_bar():
    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        mcmc = run_kernel("FALD", clients, (x[rows], y[rows]), network)
        try:
            to_inference_data(mcmc)
        except ValueError as error:
            refused = str(error)
        data = to_inference_data(mcmc, log_likelihood=False)
        # the progress bar of rank 0 only
        shown = not MCMC(KERNELS["FALD"](clients, network=network), num_samples=1).sampler.disable_progbar
        return refused, torch.as_tensor(data.posterior["w"].values), "observed_data" in data.groups(), shown

    expected = run_kernel("FALD", NUM_CLIENTS, logistic_data(num_data=NUM_DATA, dim=3))
    whole = expected.get_samples(group_by_chain=True)["w"]
    results = run_forked(run, 2, timeout_seconds=300)
    assert [result[-1] for result in results] == [True, False]
    for refused, posterior, observed, _ in results:
        assert "3 of the run's 6 clients are held in other processes" in refused
        torch.testing.assert_close(posterior, whole, rtol=1e-9, atol=1e-9)
        assert not observed  # each rank has only its own data points


def faulty_run(network, fault):
    """A FALD run over this rank's clients in which rank 1 calls ``fault()`` before its third chunk:
    ``(kind, seconds, message)`` of the error the run raised here (``seconds`` since this rank's last chunk
    began; the error is caught and the process lives on, as in a notebook), or ``("finished", None,
    None)``."""
    x, y = logistic_data(num_data=NUM_DATA, dim=3)
    rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
    kernel = FaldKernel(logistic_model, clients, step_size=0.01, batch_size=4, chunk_size=8, network=network)
    original, calls = ChunkRunner.run_chunk, []

    def run_chunk(self):
        calls.append(time.monotonic())
        if network.rank == 1 and len(calls) == 3:
            fault()
        return original(self)

    ChunkRunner.run_chunk = run_chunk
    try:
        MCMC(kernel, num_samples=400, warmup_steps=0, disable_progbar=True).run(x[rows], y[rows])
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, time.monotonic() - calls[-1], str(error)
    finally:
        ChunkRunner.run_chunk = original
    return "finished", None, None


def killed():
    os._exit(0)  # in the middle of the run, between two chunks


def test_a_rank_that_dies_stops_the_other_within_seconds_not_a_hang():
    (_, seconds, message), died = run_forked(
        lambda rank, world_size, network: faulty_run(network, killed), 2, timeout_seconds=120, survivors=True
    )
    assert died == ("died", 0)
    # gloo tells the survivor that its peer is gone at its next collective (the group's timeout, minutes,
    # is only for a rank that hangs alive)
    assert seconds is not None and seconds < 10, message
    assert "rank 0 of 2 lost another process of its group: rank 1 did not say within" in message, message


def test_a_rank_that_hangs_is_named_at_the_groups_timeout():
    group_timeout = 6.0  # longer than either rank's set-up (tracing), so that only the hang times out

    def hung():
        time.sleep(2 * group_timeout + CENSUS_SECONDS)  # alive, but away from the collectives
        killed()

    (_, seconds, message), hung_rank = run_forked(
        lambda rank, world_size, network: faulty_run(network, hung),
        2,
        timeout_seconds=120,
        survivors=True,
        group_timeout_seconds=group_timeout,
    )
    assert hung_rank == ("died", 0)
    # the group's timeout, then the census (the time of a chunk's collectives aside)
    assert seconds is not None and group_timeout <= seconds < group_timeout + CENSUS_SECONDS + 3, message
    assert "rank 0 of 2 lost another process of its group: rank 1 did not come to a collective" in message


def test_an_error_of_one_rank_alone_stops_the_other_within_seconds_and_names_it():
    def fails():
        raise ValueError("a model that fails on this rank's data only")

    (kind, seconds, message), own = run_forked(
        lambda rank, world_size, network: faulty_run(network, fails), 2, timeout_seconds=120
    )
    assert own[0] == "ValueError"
    assert kind == "RuntimeError" and seconds < 10, (kind, seconds, message)
    expected = "rank 1 failed: ValueError: a model that fails on this rank's data only"
    assert f"rank 0 of 2 lost another process of its group: {expected}" in message, message


def test_an_input_every_rank_refuses_leaves_the_group_for_another_run_whose_faults_are_its_own():
    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=3)
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        data = (x[rows], y[rows])
        options = {"step_size": 0.01, "chunk_size": 8, "network": network}
        try:  # refused alike by every rank (a preconditioner of the wrong size), and caught, as in a notebook
            kernel = FaldKernel(logistic_model, clients, preconditioner=torch.ones(5), **options)
            MCMC(kernel, num_samples=4, warmup_steps=0, disable_progbar=True).run(*data)
        except ValueError as error:
            refused = str(error)
        MCMC(FaldKernel(logistic_model, clients, **options), num_samples=4, warmup_steps=0).run(*data)
        # a third run, in which rank 1 dies: its loss, not the first run's refusal, is what rank 0 reports
        return refused, faulty_run(network, killed)[2]

    (refused, message), died = run_forked(run, 2, timeout_seconds=120, survivors=True)
    assert refused.startswith("preconditioner has shape (5,)"), refused
    assert died == ("died", 0)
    assert "rank 0 of 2 lost another process of its group: rank 1 did not say within" in message, message


def test_a_run_over_two_ranks_resumed_after_a_kill_equals_the_uninterrupted_run(tmp_path):
    def run(kill_at=None, checkpoint=True):
        def on_rank(rank, world_size, network):
            x, y = logistic_data(num_data=NUM_DATA, dim=3)
            rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
            # each rank its own file
            path = str(tmp_path / f"run-{rank}.pt") if checkpoint else None
            options = {"step_size": 0.01, "batch_size": 4, "chunk_size": 8, "gradient_mode": "traced"}
            # a checkpoint every chunk
            kernel = FaldKernel(
                logistic_model,
                clients,
                network=network,
                checkpoint=path,
                checkpoint_every=8 if path else None,
                **options,
            )
            original, calls = ChunkRunner.run_chunk, []

            def run_chunk(self):
                calls.append(None)
                if rank == 1 and len(calls) == kill_at:
                    os._exit(0)  # killed between two chunks
                return original(self)

            ChunkRunner.run_chunk = run_chunk
            mcmc = MCMC(kernel, num_samples=40, warmup_steps=8, num_chains=2, disable_progbar=True)
            pyro.set_rng_seed(0)
            try:
                mcmc.run(x[rows], y[rows])
            except RuntimeError:
                return "stopped", len(calls)
            return mcmc.get_samples(group_by_chain=True)["w"], len(calls), network.sent_bytes

        return run_forked(on_rank, 2, timeout_seconds=120, survivors=True)

    uninterrupted = run(checkpoint=False)
    killed = run(kill_at=3)
    assert killed[1] == ("died", 0) and killed[0][0] == "stopped"
    assert (tmp_path / "run-0.pt").exists() and (tmp_path / "run-1.pt").exists()
    kept = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    resumed = run()
    for (draws, chunks, sent), (expected, all_chunks, all_sent) in zip(resumed, uninterrupted, strict=True):
        assert torch.equal(draws, expected)
        assert chunks == all_chunks - 2  # the two chunks before the kill were not run again
        # the bytes sent before the checkpoint are kept: the resumed run counts every iteration's rounds, and
        # its set-up sent more than the uninterrupted one's (it agreed on the checkpoints)
        assert sent > all_sent
    # a rank stopped between the ranks' writes, its last checkpoint a chunk behind the other's: they resume
    # from the last checkpoint both have
    for name, content in kept.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "run-1.pt.previous").replace(tmp_path / "run-1.pt")
    for (draws, chunks, _), (expected, all_chunks, _) in zip(run(), uninterrupted, strict=True):
        assert torch.equal(draws, expected)
        assert chunks == all_chunks - 1


def test_fald_meets_only_at_its_rounds_and_counts_the_bytes_it_sends():
    # with a given step there is no warm-up: besides the iterations, only the check of the initial points
    chains, dim, iterations, float_bytes = 2, 3, 30, 8

    def run(rank, world_size, network):
        x, y = logistic_data(num_data=NUM_DATA, dim=dim)
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        sent = {}
        for mode in ("eager", "traced"):
            kernel = KERNELS["FALD"](clients, network=network, gradient_mode=mode)
            mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=chains, disable_progbar=True)
            pyro.set_rng_seed(0)
            mcmc.run(x[rows], y[rows])
            stats = [
                kernel.runner.buffer.sample_stats(c, 0, iterations)["communicated"] for c in range(chains)
            ]
            sent[mode] = network.sent_bytes, int((stats[0] | stats[1]).sum())
        return sent

    for sent in run_forked(run, 2, timeout_seconds=300):
        (eager, rounds), (traced, same_rounds) = sent["eager"], sent["traced"]
        assert 0 < rounds < iterations and same_rounds == rounds
        # to the other rank, in float64: the partial potentials and gradients at the initial points (C + C d
        # floats), and the gradient check's at its two points (2 d) and its differences' eight per site (one
        # site, w); the partial sums of the iterates at each iteration where a chain averages (C d); at each
        # chunk's end, each iteration's partial moments (C (d + 1)) and, in a ring all-reduce of two ranks,
        # half of its C int32 verdicts
        initial = (chains + chains * dim + 2 * dim + 8) * float_bytes
        averages = rounds * chains * dim * float_bytes
        bookkeeping = iterations * (chains * (dim + 1) * float_bytes + chains * 4)
        assert eager == initial + averages + bookkeeping
        # a traced iteration's collectives are counted at each call, and once when traced (a real call)
        assert traced == eager + chains * dim * float_bytes


def test_hierarchical_effects_over_two_ranks_refused_alike_centred_and_sampled_alike_non_centred():
    # centred, the groups barely differing: every rank's warm-up finds that the posterior has no mode (a
    # funnel) and refuses it with the same words before any iteration, none left waiting in a collective;
    # made non-centred with Pyro's LocScaleReparam, the ranks give the one-process draws
    group, y = grouped_data(spread=0.0)
    non_centred = poutine.reparam(centred_effects, config={"intercept": LocScaleReparam(centered=0.0)})

    def sample(model, clients, data, network=None):
        kernel = FaldKernel(model, clients, network=network, gradient_mode="traced")
        mcmc = MCMC(kernel, num_samples=20, warmup_steps=10, num_chains=2, disable_progbar=True)
        pyro.set_rng_seed(0)
        mcmc.run(*data)
        return mcmc.get_samples(group_by_chain=True)["intercept_decentered"]

    def run(rank, world_size, network):
        rows, clients = shard(4, len(y), network)
        try:
            sample(centred_effects, clients, (group[rows], y[rows]), network)
        except ValueError as error:
            refused = str(error)
        return refused, sample(non_centred, clients, (group[rows], y[rows]), network)

    ranks = run_forked(run, 2, timeout_seconds=300)
    assert ranks[0][0] == ranks[1][0] and "found no mode" in ranks[0][0]
    expected = sample(non_centred, 4, (group, y))
    for _, draws in ranks:
        torch.testing.assert_close(draws, expected, rtol=0, atol=1e-10)


def test_a_parameter_or_prior_made_from_the_data_a_rank_holds_is_refused_or_named():
    # eight schools as first written, its effects sized from len(y) and read by the data's own positions:
    # over ranks, each process would sample effects of its own schools under the same name, summed into a
    # wrong posterior without a word. Three ranks holding 3, 3 and 2 schools: the shapes differ, every rank
    # refuses it alike; two ranks of 4 schools each: the shapes agree, and the site is named with the fix.
    # Sized from the whole data (J given) and read by each datum's school: nothing is said, unless the prior
    # of mu is scaled by the data each rank holds (rstanarm's autoscaling, 2.5 sd(y)): refused alike
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])

    def schools(school, y, sigma, J, prior_scale):
        mu = pyro.sample("mu", dist.Normal(0.0, prior_scale))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        theta = pyro.sample("theta", dist.Normal(0.0, 1.0).expand([J]).to_event(1))
        with pyro.plate("schools", len(y)) as idx:
            pyro.sample("y", dist.Normal(mu + tau * theta[..., school[idx]], sigma[idx]), obs=y[idx])

    def run(rank, world_size, network):
        rows, clients = shard(8, 8, network)
        said = {}
        for name, data in {
            "local": (torch.arange(len(rows)), len(rows), 5.0),
            "whole": (rows, 8, 5.0),
            "autoscaled": (rows, 8, float(2.5 * y[rows].std())),
        }.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    kernel = FaldKernel(schools, clients, network=network, step_size=0.01)
                    MCMC(kernel, num_samples=2, warmup_steps=2, disable_progbar=True).run(
                        data[0], y[rows], sigma[rows], *data[1:]
                    )
                    said[name] = [str(w.message) for w in caught if "latent site" in str(w.message)]
                except ValueError as error:
                    said[name] = str(error)
        return said

    three = run_forked(run, 3, timeout_seconds=300)
    assert all("have other shapes in the processes" in said["local"] for said in three)
    assert all(said["whole"] == [] for said in three)
    assert all("The model's prior differs between the processes" in said["autoscaled"] for said in three)
    two = run_forked(run, 2, timeout_seconds=300)
    for said in two:
        assert len(said["local"]) == 1 and "['theta'] have a dimension of 4" in said["local"][0]
        assert "of 8 in all" in said["local"][0] and said["whole"] == []
        assert "The model's prior differs between the processes" in said["autoscaled"]


def test_ranks_given_different_kernels_or_settings_refuse_alike_before_any_iteration():
    # another step size in one process made its clients step with it (a hybrid of two runs, with no word);
    # another comm_prob or kernel left the processes in different collectives until one aborted: now every
    # rank refuses at set-up, the others naming what differs from the first's
    x, y = logistic_data(num_data=NUM_DATA, dim=3)

    def run(rank, world_size, network):
        rows, clients = shard(NUM_CLIENTS, NUM_DATA, network)
        said = {}
        for name, make in {
            "step": lambda: FaldKernel(logistic_model, clients, network=network, step_size=0.01 * (1 + rank)),
            "kernel": lambda: (FaldKernel if rank == 0 else QlsdKernel)(
                logistic_model, clients, network=network, step_size=0.01
            ),
        }.items():
            try:
                MCMC(make(), num_samples=4, warmup_steps=2, disable_progbar=True).run(x[rows], y[rows])
                said[name] = "ran"
            except ValueError as error:
                said[name] = str(error)
        return said

    first, second = run_forked(run, 2, timeout_seconds=120)
    for said in (first, second):
        assert all("were given different kernels or settings" in message for message in said.values())
    assert "step_size: 0.01 in the first, 0.02 here" in second["step"]
    assert "kernel: 'pyro_fed.kernels.fald.FaldKernel' in the first" in second["kernel"]
