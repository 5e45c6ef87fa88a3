import numpy as np
import torch

from pyro_fed.data.minibatch import MinibatchSampler, smallest_on_device, smallest_on_host
from pyro_fed.engine.randomness import Randomness

SIZES = [10, 7, 3]


def client_indices():
    start, out = 0, []
    for n in SIZES:
        out.append(torch.arange(start, start + n))
        start += n
    return out


def sampler(batch_size=3, chunk_size=6, num_chains=1, seed=0):
    return MinibatchSampler(
        client_indices(),
        batch_size,
        chunk_size=chunk_size,
        num_chains=num_chains,
        rng=Randomness(seed),
        dtype=torch.float64,
    )


def test_each_epoch_visits_every_point_once():
    indices = sampler()()  # [K = 6, b = 3, n = 3]
    assert indices.shape == (6, 3, 3)
    # client 0 (10 points, 3 per batch): 3 batches per epoch, one point left out per epoch
    for epoch in (indices[0:3, 0], indices[3:6, 0]):
        assert len(epoch.unique()) == 9 and epoch.min() >= 0 and epoch.max() < 10
    # client 1 (7 points): 2 batches per epoch
    for epoch in (indices[0:2, 1], indices[2:4, 1], indices[4:6, 1]):
        assert len(epoch.unique()) == 6 and epoch.min() >= 10 and epoch.max() < 17
    # client 2 has 3 points: the whole client every iteration
    for k in range(6):
        assert sorted(indices[k, 2].tolist()) == [17, 18, 19]


def test_weights_and_padding():
    s = sampler(batch_size=4)
    expected = torch.tensor([[10 / 4] * 4, [7 / 4] * 4, [1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(s.datum_weights, expected)
    indices = s()
    for i, ix in enumerate(client_indices()):
        assert set(indices[:, i].flatten().tolist()) <= set(ix.tolist())


def test_inclusion_frequencies_are_uniform():
    s = sampler(chunk_size=50)
    counts = torch.zeros(10)
    chunks = 60
    for _ in range(chunks):
        counts.index_add_(0, s()[:, 0].flatten(), torch.ones(50 * 3))
    iterations = 50 * chunks
    # each point of client 0 is in a batch with probability 3/10; the binomial sd sqrt(3000 * 0.3 * 0.7)
    # is an upper bound for these negatively correlated epochs; 5 sd
    assert ((counts - iterations * 0.3).abs() < 5 * (iterations * 0.21) ** 0.5).all()


def test_every_subset_equally_likely():
    # client 1 of 7 points, batches of 3: the first batch of an epoch is one of C(7, 3) = 35 subsets,
    # each with probability 1/35; chi-square over 35 cells with 20000 draws
    s = sampler(chunk_size=1)
    counts = {}
    for _ in range(20000):
        key = tuple(sorted(s()[0, 1].tolist()))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 35
    expected = 20000 / 35
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 80  # 34 degrees of freedom: P(chi2 > 80) < 1e-5


def test_same_seed_same_batches_and_chains_differ():
    a, b = sampler(num_chains=2, seed=5), sampler(num_chains=2, seed=5)
    for _ in range(3):
        first = a()
        assert torch.equal(first, b())
        assert first.shape == (6, 6, 3)  # [K, C·b, n]
        assert not torch.equal(first[:, :2], first[:, 3:5])  # chain 1's clients draw their own batches


def test_batch_size_as_a_fraction_of_each_client():
    # 0.3 of each client: n_i = floor(0.3 N_i) = 3, 2, then 0 -> at least 1
    batches = sampler(batch_size=0.3)
    assert batches.batch_sizes == [3, 2, 1]
    indices = batches()
    torch.testing.assert_close(
        batches.datum_weights[:, 0], torch.tensor([10 / 3, 7 / 2, 3.0], dtype=torch.float64)
    )
    assert (batches.datum_weights[1, 2:] == 0).all() and (batches.datum_weights[2, 1:] == 0).all()
    # client 2 draws one of its 3 points at a time, each epoch visiting all of them
    assert sorted(indices[0:3, 2, 0].tolist()) == [17, 18, 19]


def test_a_size_per_client_is_each_clients_own_at_most_its_data():
    # the warm-up's noise probe: half of each client's data, at most 16 (adaptation.probe_batch_sizes)
    from pyro_fed.algorithms.adaptation import probe_batch_sizes

    sizes = probe_batch_sizes(torch.tensor(SIZES))
    assert sizes.tolist() == [5, 3, 1]
    assert probe_batch_sizes(torch.tensor([1, 2, 40])).tolist() == [1, 1, 16]
    drawn = sampler(batch_size=sizes)
    indices, weights = drawn(), drawn.datum_weights
    assert drawn.batch_sizes == [5, 3, 1]
    # each client's minibatch holds distinct points of its own, weighted N_i / n_i (0 on the padding)
    for client, (start, n, size) in enumerate(zip((0, 10, 17), (5, 3, 1), SIZES, strict=True)):
        rows = indices[:, client, :n]
        assert all(len(row.unique()) == n for row in rows)
        assert rows.min() >= start and rows.max() < start + size
        assert torch.equal(weights[client, :n], torch.full((n,), size / n))
        assert (weights[client, n:] == 0).all()


def test_only_the_permutations_that_working_clients_read_are_sorted_and_those_are_unchanged():
    # every key is drawn whether its row is sorted or not: the minibatches read are those of a sampler that
    # sorts every row, and the next chunk's too
    working = np.random.default_rng(0).random((6, 2, len(SIZES))) < 0.4
    every, some = sampler(num_chains=2), sampler(num_chains=2)
    for _ in range(2):
        full, selected = every(), some(working)  # [K, C b, n]
        read = torch.as_tensor(working.reshape(6, -1))
        assert torch.equal(full[read], selected[read])
        # the placeholders are valid indices of their client's data
        owners = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
        clients = torch.arange(len(SIZES)).repeat(2).expand(6, -1)
        assert (owners[selected] == clients[..., None]).all()


def test_ordering_only_the_keys_a_chunk_reads_gives_the_full_sort_minibatches(monkeypatch):
    # a chunk of 4 iterations reads the first 4 minibatches of 2 points of a 100-point client's permutation:
    # only the 8 smallest keys are ordered (by NumPy on the CPU); torch's full sort of the same keys gives the
    # same minibatches
    sizes = [100, 60, 9, 1]
    indices = list(torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(0)).split(sizes))

    def draws():
        made = MinibatchSampler(
            indices, 2, chunk_size=4, num_chains=3, rng=Randomness(5), dtype=torch.float64
        )
        working = np.zeros((4, 3, len(sizes)), dtype=bool)
        working[1, :, 0] = working[3, 2, 1:] = True
        return [made(), made(working), made()], made.blocks[0].sorted_width

    partial, width = draws()
    assert width == 8  # of the rows' 100 keys (padded): 4 minibatches of 2 (the 1-point client reads 1)
    monkeypatch.setattr(
        "pyro_fed.data.minibatch._BlockSampler._smallest",
        lambda self, keys: keys.argsort(1)[:, : self.sorted_width],
    )
    full, _ = draws()
    for chunk_partial, chunk_full in zip(partial, full, strict=True):
        assert torch.equal(chunk_partial, chunk_full)


def test_the_host_and_device_orderings_are_a_full_sort_s_first_positions():
    # distinct keys (float64 uniforms: ties have probability ~1e-12 here), padding at 2.0 past each row's end
    keys = torch.rand(50, 30, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    keys[:10, 20:] = 2.0
    for width in (1, 7, 20, 30):
        expected = keys.argsort(1)[:, :width]
        real = slice(None) if width <= 20 else slice(10, None)  # padding ties may come in any order
        for found in (smallest_on_host(keys, width), smallest_on_device(keys, width)):
            assert torch.equal(found[real], expected[real])
