"""Clients held in several processes: a real gloo group on localhost (forked ranks, no mocks) gives, through
:class:`~pyro_fed.network.distributed.TorchDistributedNetwork`, what the one-process network gives on the
whole tensors — per operation, over hundreds of FALD, QLSD and D-ULA iterations, eager and traced — and
the same bits on every rank.

Every rank draws the whole problem and randomness from the same seeds and keeps its held clients' rows:
the ranks then compute what the one process does, with the sums over the clients reassociated (each
rank's partial sum, then the ranks'), to float64 rounding."""

import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_fed.algorithms import dula, fald, qlsd
from pyro_fed.data.partition import iid, to_index_lists
from pyro_fed.network.compression import StochasticQuantizer
from pyro_fed.network.distributed import TorchDistributedNetwork, blocks, shard
from pyro_fed.network.graphs import make_graph
from pyro_fed.network.in_process import InProcessNetwork

from .forked import run_forked

CHAINS, DIM, ITERATIONS = 2, 3, 300
#: the clients of the two-rank group: blocks of 2 and 3, uneven
CLIENTS = 5
TOLERANCE = 1e-12
#: iterations of the traced runs (a trace replays the eager operations: a few show it)
TRACED = 20


def problem(num_clients):
    """Each client's Gaussian potential, gradient :math:`A_i x - c_i` (``A_i`` SPD), the same on every
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
    """The runs' randomness for all clients, the same on every rank."""
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


def run_fald(network, held, num_clients, iterations=ITERATIONS, prepare=None):
    """FALD on the ``held`` clients; ``prepare`` maps the iteration (a function of the clients, noise and
    coins) to what runs (a traced graph...)."""
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held], centres[held])
    step_size = torch.tensor(0.05)

    def iteration(clients, noise, communicate):
        return fald.step(fald.FaldState(clients), grads, noise, communicate, network, step_size=step_size)[0]

    clients = fald.init(r["start"], held.stop - held.start).clients
    run = (
        iteration
        if prepare is None
        else prepare(iteration, (clients, r["noise"][0][:, held], r["communicate"][0]))
    )
    for k in range(iterations):
        clients = run(clients, r["noise"][k][:, held], r["communicate"][k])
    return fald.position(fald.FaldState(clients), network), clients


def trace(function, example_args):
    return make_fx(function)(*example_args)


def run_qlsd(network, held, num_clients, iterations=ITERATIONS, traced=False):
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held], centres[held])
    compressor = StochasticQuantizer(2**4)
    state = qlsd.init(r["start"], held.stop - held.start, None)

    def iteration(state, noise, uniforms, active):
        return qlsd.step(
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

    def inputs(k):
        return r["server_noise"][k], r["uniforms"][k][:, held], r["active"][k][:, held]

    run = make_fx(lambda *a: tuple(iteration(*a)))(tuple(state), *inputs(0)) if traced else iteration
    for k in range(iterations):
        state = qlsd.QlsdState(*run(tuple(state), *inputs(k)))
    return qlsd.position(state, network), state.memory


def run_dula(network, held, num_clients, graph, iterations=ITERATIONS, traced=False):
    curvatures, centres = problem(num_clients)
    r = draws(num_clients)
    network.attach(num_clients, DIM, CHAINS)
    grads = gradient(curvatures[held] / num_clients, centres[held] / num_clients)
    alpha, beta = torch.tensor(0.01), torch.tensor(0.5 / graph.lambda_max)

    def iteration(agents, noise):
        return dula.step(dula.DulaState(agents), grads, noise, graph, alpha, beta, network)[0]

    agents = dula.init(r["start"], held.stop - held.start).clients
    run = make_fx(iteration)(agents, r["noise"][0][:, held]) if traced else iteration
    for k in range(iterations):
        agents = run(agents, r["noise"][k][:, held])
    return dula.position(dula.DulaState(agents), network), agents


def operations(network, held, num_clients):
    """Every tensor operation on this rank's held rows of data drawn for all clients."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(CHAINS, num_clients, DIM, generator=generator, dtype=torch.float64)
    scalars = torch.randn(CHAINS, num_clients, generator=generator, dtype=torch.float64)
    active = torch.rand(CHAINS, num_clients, generator=generator) < 0.5
    server = torch.randn(CHAINS, DIM, generator=generator, dtype=torch.float64)
    network.attach(num_clients, DIM, CHAINS)
    # three chains: clean, a client's NaN (the last client, on the last rank), the server's inf
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
        "dispersion": network.dispersion(here),
        "finite": network.finite((clients3[:, held], server3)),
        "mix_ring": network.mix(ring, here, beta),
        "mix_random": network.mix(random, here, beta),
    }


def expected_operations(num_clients):
    """:func:`operations` by the one-process network, every client's rows."""
    return operations(InProcessNetwork(), slice(0, num_clients), num_clients)


def set_up(network, rank, world_size):
    """The host operations."""
    held = network.held(CLIENTS)
    sizes = 10 * torch.arange(CLIENTS)[held] + 1
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(CHAINS, CLIENTS, DIM, generator=generator, dtype=torch.float64)
    with pytest.raises(ValueError, match="rank r must hold the clients") as uneven:
        network.gather(torch.ones(3 if rank == 0 else 1), -1)  # blocks of 3 and 1, not 2 and 2
    with pytest.raises(ValueError, match="cannot be split over 2 ranks"):
        network.held(1)
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


def shards(network):
    ids = iid(23, CLIENTS, seed=1)
    return {"ids": shard(ids, 23, network), "lists": network.shard(to_index_lists(ids, 23), 23)}


def two_ranks(rank, world_size, network):
    """Every scenario of the two-rank group, in one group (a group's start costs more than most)."""
    torch.set_default_dtype(torch.float64)
    held = network.held(CLIENTS)
    timings = {}

    def timed(name, function, *args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        timings[name] = time.perf_counter() - start
        return out

    unordered = TorchDistributedNetwork(ordered=False)
    ring = make_graph("ring", CLIENTS)
    return {
        "set_up": timed("set_up", set_up, network, rank, world_size),
        "shards": shards(network),
        "operations": timed("operations", operations, network, held, CLIENTS),
        "unordered": operations(unordered, held, CLIENTS),
        "fald": timed("fald", run_fald, network, held, CLIENTS),
        "qlsd": timed("qlsd", run_qlsd, network, held, CLIENTS),
        "dula_ring": timed("dula_ring", run_dula, network, held, CLIENTS, ring),
        "dula_random": run_dula(network, held, CLIENTS, make_graph("erdos_renyi", CLIENTS, seed=1)),
        "fald_traced": (
            timed("fald_traced", run_fald, network, held, CLIENTS, TRACED, prepare=trace),
            run_fald(network, held, CLIENTS, TRACED),
        ),
        "qlsd_traced": (
            run_qlsd(network, held, CLIENTS, TRACED, traced=True),
            run_qlsd(network, held, CLIENTS, TRACED),
        ),
        "dula_traced": (
            run_dula(network, held, CLIENTS, ring, TRACED, traced=True),
            run_dula(network, held, CLIENTS, ring, TRACED),
        ),
        "timings": timings,
    }


@pytest.fixture(scope="module")
def ranks():
    return run_forked(two_ranks, 2)


def assert_bitwise_equal_across(ranks, key):
    first = ranks[0][key]
    for other in ranks[1:]:
        for a, b in zip(first, other[key], strict=True):
            assert torch.equal(a, b), key


def held_rows(expected, rank, world_size, num_clients):
    return expected[:, blocks(num_clients, world_size)[rank]]


#: the operations whose result carries the held clients' rows; the others' is every rank's
PER_CLIENT = ("broadcast", "average_where", "mix_ring", "mix_random")


@pytest.mark.parametrize("key", ["operations", "unordered"])
def test_each_operation_gives_the_one_process_result(ranks, key):
    expected = expected_operations(CLIENTS)
    for rank, result in enumerate(ranks):
        for name, value in result[key].items():
            want = held_rows(expected[name], rank, 2, CLIENTS) if name in PER_CLIENT else expected[name]
            assert value.dtype == want.dtype and value.shape == want.shape, name
            torch.testing.assert_close(value, want, rtol=0, atol=TOLERANCE, msg=name)
    assert ranks[0][key]["finite"].tolist() == [True, False, False]
    # a count is exact; the mix computes the one-process bits (the whole Laplacian's product)
    assert torch.equal(ranks[0][key]["count"], expected["count"])
    for name in ("mix_ring", "mix_random", "maximum", "finite"):
        for rank, result in enumerate(ranks):
            assert torch.equal(
                result[key][name],
                held_rows(expected[name], rank, 2, CLIENTS) if name in PER_CLIENT else expected[name],
            ), name
    for name, value in ranks[0][key].items():
        if name not in PER_CLIENT:
            assert torch.equal(value, ranks[1][key][name]), name


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
    ids = iid(23, CLIENTS, seed=1)
    everyone = to_index_lists(ids, 23)
    for form in ("ids", "lists"):
        rows = [r["shards"][form][0] for r in ranks]
        assert torch.equal(torch.cat(rows).sort().values, torch.arange(23))  # every row, once
        for rank, r in enumerate(ranks):
            loaded, local = r["shards"][form]
            held = everyone[blocks(CLIENTS, 2)[rank]]
            assert len(local) == len(held)
            for mine, theirs in zip(local, held, strict=True):
                assert torch.equal(loaded[mine], theirs)  # the relabelled indices read the client's points
            # the local assignment is a valid one on the loaded rows
            assert [len(ix) for ix in to_index_lists(local, len(loaded))] == [len(ix) for ix in held]


@pytest.mark.parametrize("name", ["fald", "qlsd", "dula_ring", "dula_random"])
def test_iterations_give_the_one_process_draws(ranks, name):
    everyone = slice(0, CLIENTS)
    network = InProcessNetwork()
    if name == "fald":
        expected = run_fald(network, everyone, CLIENTS)
    elif name == "qlsd":
        expected = run_qlsd(network, everyone, CLIENTS)
    else:
        graph = (
            make_graph("ring", CLIENTS) if name == "dula_ring" else make_graph("erdos_renyi", CLIENTS, seed=1)
        )
        expected = run_dula(network, everyone, CLIENTS, graph)
    position, clients = expected
    assert position.abs().max() > 0.1  # the chains moved (a wrong run would not be all zeros)
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r[name][0], position, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(r[name][1], held_rows(clients, rank, 2, CLIENTS), rtol=0, atol=TOLERANCE)
    assert torch.equal(ranks[0][name][0], ranks[1][name][0])  # the draws: the same bits on every rank


@pytest.mark.parametrize("name", ["fald", "qlsd", "dula"])
def test_traced_iterations_give_the_eager_ones(ranks, name):
    # make_fx records the functional collectives as graph nodes: the graph replays the eager operations
    for r in ranks:
        traced, eager = r[f"{name}_traced"]
        assert torch.equal(traced[0], eager[0]) and torch.equal(traced[1], eager[1])
