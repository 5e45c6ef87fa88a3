"""Clients held in several processes: a real gloo group on localhost (forked ranks, no mocks) gives, through
:class:`~pyro_fed.network.distributed.TorchDistributedNetwork`, what the one-process network gives on the
whole tensors — per operation, over hundreds of FALD, QLSD and D-ULA iterations, eager, traced and compiled
— and the same bits on every rank.

Every rank draws the whole problem and its randomness from the same seeds and keeps its held clients' rows:
the ranks then compute what the one process does, with the sums over the clients reassociated (each rank's
partial sum, then the ranks'), equal to float64 rounding."""

import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_fed.algorithms import dula, fald, qlsd
from pyro_fed.algorithms.dispersion import dispersion
from pyro_fed.data.partition import iid, to_index_lists
from pyro_fed.engine.compile import prepare
from pyro_fed.network.base import held_finite
from pyro_fed.network.compression import StochasticQuantizer
from pyro_fed.network.distributed import ENVIRONMENT, TorchDistributedNetwork, blocks, join, shard
from pyro_fed.network.graphs import make_graph
from pyro_fed.network.in_process import InProcessNetwork

from .forked import run_forked

CHAINS, DIM, ITERATIONS = 2, 3, 300
#: the clients of the two-rank group (blocks of 2 and 3) and of the three-rank one (2, 2 and 3): uneven
CLIENTS, CLIENTS_OF_THREE = 5, 7
#: iterations of the traced runs (a trace replays the eager operations: a few show it)
TRACED = 20
TOLERANCE = 1e-12


# ----------------------------------------------------------------- what every rank computes
def problem(num_clients):
    """Each client's Gaussian potential, of gradient :math:`A_i x - c_i` (``A_i`` SPD), the same on every
    rank."""
    generator = torch.Generator().manual_seed(1)
    roots = torch.randn(num_clients, DIM, DIM, generator=generator, dtype=torch.float64)
    curvatures = roots @ roots.mT / DIM + torch.eye(DIM, dtype=torch.float64)
    centres = torch.randn(num_clients, DIM, generator=generator, dtype=torch.float64)
    return curvatures, centres


def gradient(curvatures, centres):
    """The clients' gradients at their points ``[..., b, d]`` (``curvatures`` and ``centres`` of the same
    clients)."""
    return lambda x: (curvatures @ x.unsqueeze(-1)).squeeze(-1) - centres


def draws(num_clients, seed=2):
    """The runs' randomness for all the clients, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    shape = (ITERATIONS, CHAINS, num_clients, DIM)
    return {
        "start": torch.randn(CHAINS, DIM, generator=generator, dtype=torch.float64),
        "noise": torch.randn(shape, generator=generator, dtype=torch.float64),
        "server_noise": torch.randn(shape[:2] + shape[3:], generator=generator, dtype=torch.float64),
        "communicate": torch.rand(shape[:2], generator=generator) < 0.3,
        "active": torch.rand(shape[:3], generator=generator) < 0.5,
        "uniforms": torch.rand(shape, generator=generator, dtype=torch.float64),
    }


def eager(function, example_args):
    return function


def traced(function, example_args):
    return make_fx(function)(*example_args)


def compiled(function, example_args):
    prepared = prepare(function, example_args, "compiled", what="a FALD iteration")
    assert prepared.mode == "compiled", "TorchInductor did not compile the iteration (see the warning)"
    return prepared


def run_fald(network, held, num_clients, iterations=ITERATIONS, preparing=eager):
    """FALD on the ``held`` clients, as a chunk runs it (the divergence check and the dispersion in the
    iteration): ``(position, clients)``. ``preparing`` maps the iteration and example inputs to what runs."""
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held], centres[held])
    step_size = torch.tensor(0.05)

    def iteration(clients, noise, communicate):
        new = fald.step(fald.FaldState(clients), grads, noise, communicate, network, step_size=step_size)[0]
        new = torch.where(network.everywhere(held_finite((new,)))[:, None, None], new, clients)
        return new, dispersion(new, network)

    clients = fald.init(r["start"], held.stop - held.start).clients
    run = preparing(iteration, (clients, r["noise"][0][:, held], r["communicate"][0]))
    for k in range(iterations):
        clients, _ = run(clients, r["noise"][k][:, held], r["communicate"][k])
    return fald.position(fald.FaldState(clients), network), clients


def run_qlsd(network, held, num_clients, iterations=ITERATIONS, preparing=eager):
    """QLSD with a stochastic quantiser, partial participation and memories: ``(position, memories)``."""
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held], centres[held])
    compressor = StochasticQuantizer(2**4)

    def iteration(state, noise, uniforms, active):
        step = qlsd.step(
            qlsd.QlsdState(*state),
            grads,
            noise,
            uniforms,
            active,
            network,
            compressor,
            step_size=torch.tensor(0.01),
            memory_rate=0.3,
            control_variate=None,
        )
        return tuple(step)

    def inputs(k):
        return r["server_noise"][k], r["uniforms"][k][:, held], r["active"][k][:, held]

    state = tuple(qlsd.init(r["start"], held.stop - held.start, None))
    run = preparing(iteration, (state, *inputs(0)))
    for k in range(iterations):
        state = run(state, *inputs(k))
    state = qlsd.QlsdState(*state)
    return qlsd.position(state, network), state.memory


def run_dula(network, held, num_clients, graph, iterations=ITERATIONS, preparing=eager, rounds=1):
    """D-ULA over ``graph``, ``rounds`` exchanges per step: ``(position, agents)``."""
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held] / num_clients, centres[held] / num_clients)
    alpha, beta = torch.tensor(0.01), torch.tensor(0.5 / graph.lambda_max)

    rows = dula.laplacian_rows(network, graph)

    def iteration(agents, noise):
        return dula.step(dula.DulaState(agents), grads, noise, graph, rows, alpha, beta, network, rounds)[0]

    agents = dula.init(r["start"], held.stop - held.start).clients
    run = preparing(iteration, (agents, r["noise"][0][:, held]))
    for k in range(iterations):
        agents = run(agents, r["noise"][k][:, held])
    return dula.position(dula.DulaState(agents), network), agents


def operations(network, held, num_clients):
    """Every tensor operation on this rank's held rows of data drawn for all the clients."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(CHAINS, num_clients, DIM, generator=generator, dtype=torch.float64)
    scalars = torch.randn(CHAINS, num_clients, generator=generator, dtype=torch.float64)
    active = torch.rand(CHAINS, num_clients, generator=generator) < 0.5
    server = torch.randn(CHAINS, DIM, generator=generator, dtype=torch.float64)
    network.attach(num_clients, DIM, CHAINS)
    # three chains of a state: clean, a NaN of the last client (on the last rank), an inf of the server's
    clients3 = torch.randn(3, num_clients, DIM, generator=generator, dtype=torch.float64)
    clients3[1, -1, 0] = float("nan")
    server3 = torch.randn(3, DIM, generator=generator, dtype=torch.float64)
    server3[2, 1] = float("inf")
    ring, random = make_graph("ring", num_clients), make_graph("erdos_renyi", num_clients, seed=1)
    beta = torch.tensor(0.3)
    here = x[:, held]
    return {
        "sum": network.sum(here),
        "sum_scalars": network.sum(scalars[:, held], -1),
        "count": network.sum(active[:, held], -1),
        "average": network.average(here),
        "maximum": network.maximum(scalars[:, held]),
        "broadcast": network.broadcast(server, held.stop - held.start),
        "average_where": network.average_where(torch.tensor([True, False]), here),
        "dispersion": dispersion(here, network),
        "finite": network.everywhere(held_finite((clients3[:, held], server3))),
        "mix_ring": dula.mix(here, dula.laplacian_rows(network, ring), ring, network, beta),
        "mix_random": dula.mix(here, dula.laplacian_rows(network, random), random, network, beta),
    }


def set_up(network, rank, world_size):
    """The host operations, and the errors every rank raises alike."""
    held = network.held(CLIENTS)
    sizes = 10 * torch.arange(CLIENTS)[held] + 1
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(CHAINS, CLIENTS, DIM, generator=generator, dtype=torch.float64)
    with pytest.raises(ValueError, match="rank r must hold the clients") as uneven:
        network.gather(torch.ones(3 if rank == 0 else 1), -1)  # blocks of 3 and 1, not 2 and 2
    with pytest.raises(ValueError, match="cannot be split over 2 ranks"):
        network.held(1)
    with pytest.raises(ValueError, match="the ranks attach different runs"):
        network.attach(CLIENTS if rank == 0 else 2, DIM, CHAINS)  # a rank counting its own clients
    return {
        "held": held,
        "sizes": network.gather(sizes, -1),
        "gathered": network.gather(x[:, held], -2),
        "uneven": str(uneven.value),
        "any": network.agree(rank == world_size - 1),
        "none": network.agree(False),
        "shared": network.share([torch.full((2,), float(rank)), rank, {"rank": rank}]),
        "shared_tensor": network.share(torch.tensor([rank, 7])),
    }


def sent_by_one_exchange(network, held, graph):
    before = network.sent_bytes
    network.neighbours(graph, torch.zeros(CHAINS, held.stop - held.start, DIM))
    return network.sent_bytes - before


def shards(network):
    ids = iid(23, CLIENTS, seed=1)
    return {"ids": shard(ids, 23, network), "lists": network.shard(to_index_lists(ids, 23), 23)}


def two_ranks(rank, world_size, network):
    """Every scenario of the two-rank group, in one group."""
    torch.set_default_dtype(torch.float64)
    held = network.held(CLIENTS)
    ring = make_graph("ring", CLIENTS)
    return {
        "set_up": set_up(network, rank, world_size),
        "shards": shards(network),
        "operations": operations(network, held, CLIENTS),
        "unordered": operations(TorchDistributedNetwork(ordered=False), held, CLIENTS),
        "fald": run_fald(network, held, CLIENTS),
        "qlsd": run_qlsd(network, held, CLIENTS),
        "dula_ring": run_dula(network, held, CLIENTS, ring),
        "dula_random": run_dula(network, held, CLIENTS, make_graph("erdos_renyi", CLIENTS, seed=1)),
        "dula_ring_rounds": run_dula(network, held, CLIENTS, ring, rounds=3),
        "ring_bytes": sent_by_one_exchange(network, held, ring),
        "fald_traced": (
            run_fald(network, held, CLIENTS, TRACED, traced),
            run_fald(network, held, CLIENTS, TRACED),
        ),
        "qlsd_traced": (
            run_qlsd(network, held, CLIENTS, TRACED, traced),
            run_qlsd(network, held, CLIENTS, TRACED),
        ),
        "dula_traced": (
            run_dula(network, held, CLIENTS, ring, TRACED, traced),
            run_dula(network, held, CLIENTS, ring, TRACED),
        ),
    }


def three_ranks(rank, world_size, network):
    """Blocks of 2, 2 and 3 clients: the padded gathers."""
    torch.set_default_dtype(torch.float64)
    held = network.held(CLIENTS_OF_THREE)
    graph = make_graph("erdos_renyi", CLIENTS_OF_THREE, seed=1)
    return {
        "held": held,
        "sizes": network.gather(torch.arange(CLIENTS_OF_THREE)[held], -1),
        "operations": operations(network, held, CLIENTS_OF_THREE),
        "fald": run_fald(network, held, CLIENTS_OF_THREE, 100),
        "dula": run_dula(network, held, CLIENTS_OF_THREE, graph, 100),
        "dula_traced": run_dula(network, held, CLIENTS_OF_THREE, graph, 100, traced),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_forked(two_ranks, 2)


# ----------------------------------------------------------------- checks
#: the operations whose result carries the held clients' rows; the others' is the same on every rank
PER_CLIENT = ("broadcast", "average_where", "mix_ring", "mix_random")


def held_rows(everyone, rank, world_size, num_clients):
    return everyone[:, blocks(num_clients, world_size)[rank]]


def check_operations(results, world_size, num_clients):
    expected = operations(InProcessNetwork(), slice(0, num_clients), num_clients)
    for rank, result in enumerate(results):
        for name, value in result.items():
            want = expected[name]
            want = held_rows(want, rank, world_size, num_clients) if name in PER_CLIENT else want
            assert value.dtype == want.dtype and value.shape == want.shape, name
            torch.testing.assert_close(value, want, rtol=0, atol=TOLERANCE, msg=name)
            # exact: counts, maxima, verdicts (the mix reads the neighbours only: its products are the
            # one-process ones without the zero terms, equal to rounding)
            if name in ("count", "maximum", "finite"):
                assert torch.equal(value, want), name
            if name not in PER_CLIENT:  # the same bits on every rank
                assert torch.equal(value, results[0][name]), name
    assert results[0]["finite"].tolist() == [True, False, False]


def test_a_neighbour_exchange_sends_only_the_agents_the_other_rank_reads(ranks):
    # a ring of 5 agents over blocks (0, 1) and (2, 3, 4): each rank's rows read the two agents at the ends
    # of the other's block, and each sends those two, C d floats each
    assert [r["ring_bytes"] for r in ranks] == [2 * CHAINS * DIM * 8] * 2


@pytest.mark.parametrize("key", ["operations", "unordered"])
def test_each_operation_gives_the_one_process_result(ranks, key):
    check_operations([r[key] for r in ranks], 2, CLIENTS)


def test_the_set_up_operations(ranks):
    assert [r["set_up"]["held"] for r in ranks] == [slice(0, 2), slice(2, 5)]
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(CHAINS, CLIENTS, DIM, generator=generator, dtype=torch.float64)
    for r in ranks:
        got = r["set_up"]
        assert torch.equal(got["sizes"], 10 * torch.arange(CLIENTS) + 1)
        assert torch.equal(got["gathered"], x)
        assert "the ranks hold [3, 1] clients" in got["uneven"] and "[2, 2]" in got["uneven"]
        assert got["any"] is True and got["none"] is False
        shared, number, mapping = got["shared"]
        assert torch.equal(shared, torch.zeros(2)) and number == 0 and mapping == {"rank": 0}
        assert torch.equal(got["shared_tensor"], torch.tensor([0, 7]))


def test_shards_cover_the_data_and_relabel_each_client(ranks):
    everyone = to_index_lists(iid(23, CLIENTS, seed=1), 23)
    for form in ("ids", "lists"):
        rows = [r["shards"][form][0] for r in ranks]
        assert torch.equal(torch.cat(rows).sort().values, torch.arange(23))  # every row, once
        for rank, r in enumerate(ranks):
            loaded, local = r["shards"][form]
            held = everyone[blocks(CLIENTS, 2)[rank]]
            assert len(local) == len(held)
            for mine, theirs in zip(local, held, strict=True):
                assert torch.equal(loaded[mine], theirs)  # the relabelled indices read the client's points
            # a valid assignment of the loaded rows, for a kernel's clients=
            assert [len(ix) for ix in to_index_lists(local, len(loaded))] == [len(ix) for ix in held]


def one_process(name, num_clients=CLIENTS, iterations=ITERATIONS):
    everyone, network = slice(0, num_clients), InProcessNetwork()
    if name == "fald":
        return run_fald(network, everyone, num_clients, iterations)
    if name == "qlsd":
        return run_qlsd(network, everyone, num_clients, iterations)
    graph = (
        make_graph("erdos_renyi", num_clients, seed=1)
        if name == "dula_random"
        else make_graph("ring", num_clients)
    )
    rounds = 3 if name == "dula_ring_rounds" else 1
    return run_dula(network, everyone, num_clients, graph, iterations, rounds=rounds)


def check_run(results, expected, num_clients):
    position, clients = expected
    assert position.abs().max() > 0.1  # the chains moved
    for rank, (got_position, got_clients) in enumerate(results):
        torch.testing.assert_close(got_position, position, rtol=0, atol=TOLERANCE)
        want = held_rows(clients, rank, len(results), num_clients)
        torch.testing.assert_close(got_clients, want, rtol=0, atol=TOLERANCE)
        assert torch.equal(got_position, results[0][0])  # the draws: the same bits on every rank


@pytest.mark.parametrize("name", ["fald", "qlsd", "dula_ring", "dula_random", "dula_ring_rounds"])
def test_iterations_give_the_one_process_draws(ranks, name):
    check_run([r[name] for r in ranks], one_process(name), CLIENTS)


@pytest.mark.parametrize("name", ["fald", "qlsd", "dula"])
def test_traced_iterations_give_the_eager_ones(ranks, name):
    # make_fx records the functional collectives as graph nodes, which the graph replays
    for r in ranks:
        (traced_position, traced_clients), (eager_position, eager_clients) = r[f"{name}_traced"]
        assert torch.equal(traced_position, eager_position) and torch.equal(traced_clients, eager_clients)


def test_three_ranks_of_uneven_blocks():
    results = run_forked(three_ranks, 3)
    assert [r["held"] for r in results] == [slice(0, 2), slice(2, 4), slice(4, 7)]
    for r in results:
        assert torch.equal(r["sizes"], torch.arange(CLIENTS_OF_THREE))
    check_operations([r["operations"] for r in results], 3, CLIENTS_OF_THREE)
    check_run([r["fald"] for r in results], one_process("fald", CLIENTS_OF_THREE, 100), CLIENTS_OF_THREE)
    expected = one_process("dula_random", CLIENTS_OF_THREE, 100)
    check_run([r["dula"] for r in results], expected, CLIENTS_OF_THREE)
    check_run([r["dula_traced"] for r in results], expected, CLIENTS_OF_THREE)


def compiled_fald(rank, world_size, network):
    torch.set_default_dtype(torch.float64)
    held = network.held(CLIENTS)
    start = time.perf_counter()
    result = run_fald(network, held, CLIENTS, TRACED, compiled)
    return result, run_fald(network, held, CLIENTS, TRACED), time.perf_counter() - start


def test_a_compiled_iteration_gives_the_eager_one():
    # TorchInductor compiles the functional collectives' nodes as they are (it may fuse the arithmetic
    # around them differently: to rounding)
    for result, eager_result, _ in run_forked(compiled_fald, 2):
        for got, want in zip(result, eager_result, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def test_a_network_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        TorchDistributedNetwork()


def test_a_fallback_on_one_rank_is_every_ranks():
    # rank 0 cannot trace the function (as a model that make_fx refuses): it falls back to eager, and
    # rank 1, which could trace it, runs it eager too, so that both run the same preparation
    def run(rank, world_size, network):
        import warnings

        import pyro_fed.engine.compile as compile_module

        if rank == 0:

            def refuse(function):
                raise RuntimeError("no tracing here")

            compile_module.make_fx = refuse
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 0's fallback warning
            prepared = prepare(torch.sin, (torch.ones(3),), "traced", what="sin", agree=network.agree)
        alone = prepare(torch.sin, (torch.ones(3),), "traced", what="sin")  # no agreement: its own
        return prepared.mode, alone.mode

    assert run_forked(run, 2) == [("eager", "eager"), ("eager", "traced")]


@pytest.mark.parametrize(
    "unset, named",
    [
        (ENVIRONMENT, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
        (("MASTER_PORT",), "MASTER_PORT is not set"),
    ],
)
def test_join_outside_torchrun_names_what_is_missing(monkeypatch, unset, named):
    # a one-process group, but for the variables unset
    for name, value in zip(ENVIRONMENT, ("0", "1", "localhost", "29500"), strict=True):
        monkeypatch.setenv(name, value)
    for name in unset:
        monkeypatch.delenv(name)
    with pytest.raises(
        RuntimeError, match=rf"torchrun describes, and {named}: run the script under torchrun"
    ):
        join()


@pytest.mark.parametrize(
    "arguments, match",
    [
        (
            (InProcessNetwork(), 4, torch.tensor([1, 0, 1, 0])),
            r"the network was passed as clients, and Tensor",
        ),
        (
            (torch.tensor([1, 0, 1, 0]), InProcessNetwork(), 4),
            r"the network was passed as num_data, and int 4",
        ),
        (
            (4, torch.tensor([1, 0, 1, 0]), InProcessNetwork()),
            r"got Tensor of shape \(4,\) \(clients and num",
        ),
        ((torch.tensor([1, 0, 1, 0]), 4, "gloo"), r"network must be a pyro_fed Network .*; got str 'gloo'"),
        (
            (torch.tensor([1, 0, 1, 0]), 4.0, InProcessNetwork()),
            r"num_data must be the number .*; got float 4\.0",
        ),
    ],
)
def test_shard_with_its_arguments_out_of_order_says_so(arguments, match):
    with pytest.raises(ValueError, match=match):
        shard(*arguments)


def test_shard_refuses_assignments_that_differ_between_the_ranks():
    # a random split drawn with another seed in one process (or another number of points) would load some
    # points twice and others never: every rank refuses it, none left waiting; the same split passes
    def run(rank, world_size, network):
        said = {}
        for name, (seed, num_data) in {"seed": (rank, 23), "points": (1, 23 + rank), "same": (1, 23)}.items():
            try:
                rows, _ = shard(iid(num_data, CLIENTS, seed=seed), num_data, network)
                said[name] = rows.tolist()
            except ValueError as error:
                said[name] = str(error)
        return said

    ranks = run_forked(run, 2, timeout_seconds=120)
    for said in ranks:
        assert "the processes passed different assignments" in said["seed"]
        assert "the processes passed different assignments" in said["points"]
    assert sorted(ranks[0]["same"] + ranks[1]["same"]) == list(range(23))
