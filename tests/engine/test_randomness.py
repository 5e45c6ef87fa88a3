"""The clients' randomness is drawn by blocks: what a client draws does not depend on which clients are held
with it, and a holder draws only the blocks of its own clients."""

import torch

from pyro_fed.data.minibatch import MinibatchSampler
from pyro_fed.engine import randomness
from pyro_fed.engine.randomness import CLIENTS_PER_BLOCK, Randomness

#: three blocks, the last one short
CLIENTS = 2 * CLIENTS_PER_BLOCK + 88
#: held parts: all, inside one block, across a block's boundary, two clients around it, the short block
HELD = [slice(0, CLIENTS), slice(10, 40), slice(100, 300), slice(255, 257), slice(512, CLIENTS)]


def test_a_client_draws_the_same_wherever_it_is_held_and_a_holder_only_its_blocks():
    whole = Randomness(3).client_normal(4, 2, num_clients=CLIENTS, held=HELD[0], dim=3, dtype=torch.float64)
    assert whole.shape == (4, 2, CLIENTS, 3)
    for held in HELD[1:]:
        rng = Randomness(3)
        part = rng.client_normal(4, 2, num_clients=CLIENTS, held=held, dim=3, dtype=torch.float64)
        assert torch.equal(part, whole[:, :, held])
        first, last = held.start // CLIENTS_PER_BLOCK, (held.stop - 1) // CLIENTS_PER_BLOCK
        assert sorted(rng.blocks) == list(range(first, last + 1))
    # the blocks' streams differ from each other, and from another seed's
    assert not torch.equal(
        whole[:, :, :CLIENTS_PER_BLOCK], whole[:, :, CLIENTS_PER_BLOCK : 2 * CLIENTS_PER_BLOCK]
    )
    other = Randomness(4).client_normal(4, 2, num_clients=CLIENTS, held=HELD[0], dim=3, dtype=torch.float64)
    assert not torch.equal(whole, other)


def test_blocks_whose_seeds_a_cpu_generator_reads_alike_are_seeded_apart(monkeypatch):
    # a CPU generator reads 32 bits of its seed: seeds equal there draw the same numbers
    assert torch.equal(
        torch.randn(4, generator=torch.Generator().manual_seed(5)),
        torch.randn(4, generator=torch.Generator().manual_seed(5 + 2**32)),
    )
    # seeds that collide with none are derived once, as they always were
    assert [Randomness(3).block_seed(n) for n in range(3)] == [randomness._seed(3, n) for n in range(3)]
    # every block's first derivation made to agree in those bits with the others' (and the run's seed)
    derive = randomness._seed
    monkeypatch.setattr(randomness, "_seed", lambda *e: 3 + (e[1] << 32) if len(e) == 2 else derive(*e))
    rng = Randomness(3)
    seeds = [rng.block_seed(n) for n in range(3)]
    assert len({seed % 2**32 for seed in seeds} | {3}) == 4
    draws = rng.client_normal(num_clients=CLIENTS, held=HELD[0], dim=1, dtype=torch.float64)
    blocks = draws[: 3 * CLIENTS_PER_BLOCK : CLIENTS_PER_BLOCK]  # the first client of each block
    assert len(set(blocks.flatten().tolist())) == 3


def test_the_blocks_states_restore_their_next_draws():
    rng = Randomness(5)
    draw = {"num_clients": CLIENTS, "held": slice(200, 600), "dim": 2, "dtype": torch.float64}
    rng.client_uniform(3, **draw)
    state = rng.state()
    assert state["block_numbers"].tolist() == [0, 1, 2] and state["blocks"].dtype == torch.uint8
    expected = rng.client_uniform(3, **draw)
    restored = Randomness(5)
    restored.set_state(state)
    assert torch.equal(restored.client_uniform(3, **draw), expected)


def test_minibatches_are_those_of_one_holder_of_all_clients():
    sizes = torch.randint(2, 9, (CLIENTS,), generator=torch.Generator().manual_seed(0))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    indices = [torch.arange(offsets[i], offsets[i + 1]) for i in range(CLIENTS)]

    def sampler(held):
        # the held clients' indices counted from their first point, as a holder of them loads its rows
        local = [ix - offsets[held.start] for ix in indices[held]]
        options = {"chunk_size": 5, "num_chains": 2, "dtype": torch.float64}
        return MinibatchSampler(local, 3, rng=Randomness(7), all_client_sizes=sizes, held=held, **options)

    whole = sampler(HELD[0])
    batches = whole().reshape(5, 2, CLIENTS, -1)
    weights = whole.datum_weights.reshape(2, CLIENTS, -1)
    for held in HELD[1:]:
        part = sampler(held)
        assert torch.equal(
            part().reshape(5, 2, held.stop - held.start, -1), batches[:, :, held] - offsets[held.start]
        )
        assert torch.equal(part.datum_weights.reshape(2, held.stop - held.start, -1), weights[:, held])
        assert part.batch_sizes == whole.batch_sizes[held]
