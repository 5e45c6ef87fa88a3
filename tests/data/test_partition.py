import math
import re

import pytest
import torch

from pyro_fed.data import partition

LABELS = torch.arange(1000) % 10  # 10 labels x 100 points

GENERATORS = {
    "iid": lambda seed: partition.iid(1000, 20, seed=seed),
    "dirichlet": lambda seed: partition.dirichlet(LABELS, 20, alpha=0.3, seed=seed),
    "dirichlet_tiny_alpha": lambda seed: partition.dirichlet(LABELS, 20, alpha=1e-3, seed=seed),
    "shards": lambda seed: partition.shards(LABELS, 20, seed=seed),
    "shards_all_major": lambda seed: partition.shards(LABELS, 20, major=1.0, seed=seed),
}


def label_entropy(clients, labels, num_clients):
    """Mean over clients of the entropy of the client's label distribution."""
    entropies = []
    for k in range(num_clients):
        p = torch.bincount(labels[clients == k], minlength=int(labels.max()) + 1).double()
        p = p[p > 0] / p.sum()
        entropies.append(-(p * p.log()).sum())
    return torch.stack(entropies).mean().item()


@pytest.mark.parametrize("name", GENERATORS)
def test_assignment_is_a_valid_partition(name):
    clients = GENERATORS[name](0)
    assert clients.dtype == torch.long and clients.shape == (1000,)
    assert torch.bincount(clients, minlength=20).min() >= 1
    assert clients.max() == 19
    index_lists = partition.to_index_lists(clients, num_data=1000)
    assert len(index_lists) == 20
    assert torch.equal(torch.cat(index_lists).sort().values, torch.arange(1000))


@pytest.mark.parametrize("name", GENERATORS)
def test_deterministic_for_a_seed_and_different_across_seeds(name):
    assert torch.equal(GENERATORS[name](3), GENERATORS[name](3))
    assert not torch.equal(GENERATORS[name](3), GENERATORS[name](4))


@pytest.mark.parametrize("name", GENERATORS)
def test_global_rng_untouched(name):
    torch.manual_seed(0)
    state = torch.get_rng_state()
    GENERATORS[name](0)
    assert torch.equal(torch.get_rng_state(), state)


def test_iid_sizes_nearly_equal():
    sizes = torch.bincount(partition.iid(103, 10))
    assert len(sizes) == 10 and sizes.sum() == 103 and sizes.max() - sizes.min() <= 1


def test_iid_one_point_per_client():
    assert torch.equal(partition.iid(7, 7).sort().values, torch.arange(7))


def test_dirichlet_small_alpha_is_label_skewed():
    # Over 20 seeds, the mean client label entropy was 0.47-0.93 for alpha=0.05 and 2.297-2.299 for
    # alpha=100 (the maximum is log 10 = 2.303): the thresholds leave a wide margin.
    skewed = partition.dirichlet(LABELS, 10, alpha=0.05, seed=0)
    uniform = partition.dirichlet(LABELS, 10, alpha=100.0, seed=0)
    assert label_entropy(skewed, LABELS, 10) < 1.5
    assert label_entropy(uniform, LABELS, 10) > 2.2


def test_dirichlet_fills_empty_clients():
    # With alpha tiny each label goes almost entirely to one client, so most clients start empty.
    clients = partition.dirichlet(torch.arange(20) % 2, 20, alpha=1e-3)
    assert torch.equal(clients.sort().values, torch.arange(20))


def test_dirichlet_accepts_float_and_string_labels():
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert torch.equal(
        partition.dirichlet(y, 2, alpha=1.0, seed=1),
        partition.dirichlet(["a", "b", "b", "a", "b", "a"], 2, alpha=1.0, seed=1),
    )


@pytest.mark.parametrize("num_clients", [10, 20, 25])
def test_shards_major_fraction_on_own_clients(num_clients):
    labels = LABELS[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    clients = partition.shards(labels, num_clients, major=0.8)
    for c in range(10):
        own = torch.arange(c, num_clients, 10)
        on_own = torch.isin(clients[labels == c], own).double().mean()
        assert on_own >= 0.8 - 1 / 100  # 100 points per label; the major share is rounded down


def test_shards_all_major_splits_each_label_evenly_over_its_clients():
    clients = partition.shards(LABELS, 20, major=1.0)
    assert torch.equal(LABELS, clients % 10)
    assert torch.bincount(clients).tolist() == [50] * 20
    clients = partition.shards(LABELS, 25, major=1.0)
    assert torch.equal(LABELS, clients % 10)
    assert torch.bincount(clients).tolist() == [34] * 5 + [50] * 5 + [33] * 5 + [50] * 5 + [33] * 5


def test_shards_no_major_spreads_evenly():
    sizes = torch.bincount(partition.shards(LABELS, 20, major=0.0))
    assert sizes.tolist() == [50] * 20


def test_by_group():
    assert partition.by_group(["st. mary", "general", "st. mary", "county"]).tolist() == [2, 1, 2, 0]
    assert partition.by_group(torch.tensor([30, 10, 30, 20])).tolist() == [2, 0, 2, 1]
    assert partition.by_group((5.5, 1.5)).tolist() == [1, 0]


def test_to_index_lists_from_ids():
    lists = partition.to_index_lists(torch.tensor([2, 0, 1, 0, 2], dtype=torch.int32), num_data=5)
    assert [t.tolist() for t in lists] == [[1, 3], [2], [0, 4]]
    assert all(t.dtype == torch.long for t in lists)
    assert [t.tolist() for t in partition.to_index_lists([1, 0, 1])] == [[1], [0, 2]]


def test_to_index_lists_from_index_lists():
    lists = partition.to_index_lists([torch.tensor([3, 0]), [2, 1]], num_data=4)
    assert [t.tolist() for t in lists] == [[0, 3], [1, 2]]
    assert all(t.dtype == torch.long for t in lists)
    # Without num_data, coverage is not checked.
    assert [t.tolist() for t in partition.to_index_lists((torch.tensor([5]), torch.tensor([1])))] == [
        [5],
        [1],
    ]


@pytest.mark.parametrize(
    "clients, num_data, match",
    [
        (
            torch.zeros(90, dtype=torch.long),
            100,
            re.escape(
                "clients has length 90 but the data plate has 100 points; give one client id per data point"
            ),
        ),
        (
            torch.zeros(4, dtype=torch.float32),
            None,
            r"clients must hold integer client ids, got dtype torch\.float32",
        ),
        ([True, False], None, r"clients must hold integer client ids, got dtype torch\.bool"),
        (torch.tensor([0, -1, 1]), None, r"clients has the negative id -1; ids must be 0\.\.b-1"),
        (
            torch.tensor([0, 0, 1, 2, 4]),
            None,
            re.escape("client 3 has no data points; ids must be 0..b-1 and every client non-empty"),
        ),
        ([], None, r"clients is empty; give one client id per data point or one index tensor per client"),
        (torch.tensor([], dtype=torch.long), None, r"clients must be a non-empty 1-D tensor.*shape \(0,\)"),
        (
            torch.zeros(2, 3, dtype=torch.long),
            None,
            r"clients must be a non-empty 1-D tensor.*shape \(2, 3\)",
        ),
        (
            [torch.tensor([0, 1]), torch.tensor([1, 2])],
            None,
            r"data point 1 is in more than one client's index list; .* must be disjoint",
        ),
        (
            [torch.tensor([0, 1]), torch.tensor([5])],
            4,
            re.escape("clients[1] has the index 5, out of range for the data plate of 4 points"),
        ),
        ([torch.tensor([-1, 1]), torch.tensor([0])], None, re.escape("clients[0] has the index -1")),
        (
            [torch.tensor([0, 1]), torch.tensor([2])],
            4,
            r"data point 3 is in no client's index list; .* must cover all 4 points",
        ),
        ([torch.tensor([0]), torch.tensor([], dtype=torch.long)], None, re.escape("clients[1] is empty")),
        ([[0], []], None, re.escape("clients[1] is empty; every client needs at least one data point")),
        (
            [torch.tensor([0.0]), torch.tensor([1])],
            None,
            re.escape("clients[0] must be a 1-D tensor of integer indices"),
        ),
    ],
)
def test_to_index_lists_errors(clients, num_data, match):
    with pytest.raises(ValueError, match=match):
        partition.to_index_lists(clients, num_data=num_data)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: partition.iid(0, 1), r"num_data must be >= 1, got 0"),
        (lambda: partition.iid(10, 0), r"num_clients must be >= 1, got 0"),
        (lambda: partition.iid(10, 11), r"num_clients=11 exceeds the number of data points \(10\)"),
        (lambda: partition.dirichlet(LABELS[:5], 6, alpha=1.0), r"num_clients=6 exceeds"),
        (lambda: partition.dirichlet(LABELS, 10, alpha=0.0), r"alpha must be > 0, got 0\.0"),
        (lambda: partition.dirichlet(LABELS, 10, alpha=math.nan), r"alpha must be > 0, got nan"),
        (lambda: partition.dirichlet([], 1, alpha=1.0), r"labels is empty"),
        (lambda: partition.dirichlet(LABELS.reshape(10, 100), 2, 1.0), r"labels must be a non-empty 1-D"),
        (
            lambda: partition.shards(LABELS, 9),
            r"num_clients=9 is smaller than the number of distinct labels \(10\)",
        ),
        (lambda: partition.shards(LABELS, 20, major=1.5), r"major must be in \[0, 1\], got 1\.5"),
        (lambda: partition.shards(LABELS, 20, major=-0.1), r"major must be in \[0, 1\]"),
        (lambda: partition.by_group([[1], [2]]), r"groups must be a 1-D sequence of hashable"),
        (
            lambda: partition.by_group([1, "a"]),
            r"groups must be a 1-D sequence of hashable, mutually comparable",
        ),
        (lambda: partition.by_group(torch.tensor([])), r"groups must be a non-empty 1-D tensor"),
    ],
)
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_assignments_under_another_default_device():
    # torch.set_default_device("cuda") is how users put a Pyro model on the GPU: the seeded host generators
    # of the partitions must still get host tensors. The "meta" device stands in for a GPU here: the
    # assignments are the same host tensors as with the CPU as default device.
    labels = torch.arange(40) % 4
    expected = (partition.iid(40, 4), partition.dirichlet(labels, 4, 0.5), partition.shards(labels, 4))
    with torch.device("meta"):
        found = (partition.iid(40, 4), partition.dirichlet(labels, 4, 0.5), partition.shards(labels, 4))
    for ids, same in zip(found, expected, strict=True):
        assert ids.device.type == "cpu" and torch.equal(ids, same)
