import torch

from pyro_fed.algorithms.rng import Randomness
from pyro_fed.minibatch import MinibatchSampler

SIZES = [10, 7, 3]


def client_indices():
    start, out = 0, []
    for n in SIZES:
        out.append(torch.arange(start, start + n))
        start += n
    return out


def test_each_epoch_visits_every_point_once():
    sampler = MinibatchSampler(client_indices(), batch_size=3, rng=Randomness(0), dtype=torch.float64)
    seen = [[] for _ in SIZES]
    # client 0 (10 points, 3 per batch): 3 batches per epoch, one point left out per epoch
    for _ in range(3):
        batch = sampler()
        for i, n in enumerate(SIZES):
            k = min(3, n)
            seen[i].append(batch.indices[i, :k])
    first_epoch = torch.cat(seen[0])
    assert len(first_epoch.unique()) == 9 and first_epoch.min() >= 0 and first_epoch.max() < 10
    # client 2 has 3 points: the whole client every iteration
    for b in seen[2]:
        assert sorted(b.tolist()) == [17, 18, 19]


def test_weights_and_padding():
    sampler = MinibatchSampler(client_indices(), batch_size=4, rng=Randomness(1), dtype=torch.float64)
    batch = sampler()
    expected = torch.tensor([[10 / 4] * 4, [7 / 4] * 4, [1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(batch.datum_weights, expected)
    for i, ix in enumerate(client_indices()):
        k = min(4, SIZES[i])
        assert set(batch.indices[i, :k].tolist()) <= set(ix.tolist())


def test_inclusion_frequencies_are_uniform():
    sampler = MinibatchSampler(client_indices(), batch_size=3, rng=Randomness(2), dtype=torch.float64)
    counts = torch.zeros(10)
    iterations = 3000
    for _ in range(iterations):
        counts.index_add_(0, sampler().indices[0, :3], torch.ones(3))
    # each point of client 0 is in a batch with probability 3/10; binomial-like sd sqrt(3000 * 0.3 * 0.7)
    # is an upper bound for these negatively correlated epochs; 5 sd
    assert ((counts - iterations * 0.3).abs() < 5 * (iterations * 0.21) ** 0.5).all()


def test_same_seed_same_batches():
    a = MinibatchSampler(client_indices(), batch_size=3, rng=Randomness(5), dtype=torch.float64)
    b = MinibatchSampler(client_indices(), batch_size=3, rng=Randomness(5), dtype=torch.float64)
    for _ in range(10):
        assert torch.equal(a().indices, b().indices)
