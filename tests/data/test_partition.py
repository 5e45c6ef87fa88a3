import math
import re

import numpy as np
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


def test_dirichlet_gives_each_client_its_expected_size_however_small_the_labels():
    # 50 labels of 2 points, 10 clients, alpha=100: each client's expected share of each label is 1/10, so
    # its expected size is N/b = 10 (flooring the label boundaries gave [1, 1, 1, 1, 25, 25, 1, 1, 1, 43]).
    # Given the proportions pi, a client's count of a label is n pi_k rounded up or down: a Bernoulli
    # variance <= 1/4 around n pi_k, whose own variance is n^2 Var(pi_k) = 4 * 0.1 * 0.9 / 1001 < 4e-4. The
    # 50 labels are independent: Var(size) <= 50 * (0.25 + 4e-4) < 12.6, so the mean over 100 seeds has sd
    # <= 0.355 and a sum of 5000 independent terms is close to normal; 5 sd (1.8) leaves each of the 10
    # clients a chance below 1e-6 of failing by chance, and is a fifth of the old error.
    labels = torch.arange(100) % 50
    sizes = torch.stack(
        [torch.bincount(partition.dirichlet(labels, 10, alpha=100, seed=s), minlength=10) for s in range(100)]
    )
    mean = sizes.double().mean(0)
    assert (mean - 10).abs().max() < 5 * math.sqrt(50 * (0.25 + 4e-4) / 100), mean


def test_dirichlet_splits_each_label_in_its_proportions_rounded_without_bias(monkeypatch):
    # With the proportions fixed at (0.2, 0.3, 0.5), each label of 2 points gives client 2 exactly one
    # point, and client 0 the other with probability 0.4, client 1 with probability 0.6: never fewer than
    # floor(n pi_k) nor more than ceil(n pi_k), and n pi_k on average. Client 0's size over 50 labels is
    # Binomial(50, 0.4), sd sqrt(12) = 3.46; the mean over 40 seeds has sd 0.548; 5 sd is 2.74.
    proportions = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    monkeypatch.setattr(torch, "_sample_dirichlet", lambda concentration, generator: proportions)
    labels = torch.arange(100) % 50
    counts = torch.stack(
        [
            torch.stack([torch.bincount(clients[labels == c], minlength=3) for c in range(50)])
            for clients in (partition.dirichlet(labels, 3, alpha=1.0, seed=s) for s in range(40))
        ]
    )  # [seed, label, client]
    assert (counts[..., 2] == 1).all()
    assert ((counts[..., 0] + counts[..., 1]) == 1).all()
    sizes = counts.sum(1).double().mean(0)
    assert abs(sizes[0] - 20) < 5 * math.sqrt(50 * 0.4 * 0.6 / 40), sizes
    assert abs(sizes[1] - 30) < 5 * math.sqrt(50 * 0.4 * 0.6 / 40), sizes


@pytest.mark.parametrize(
    "labels",
    [
        torch.randn(100, generator=torch.Generator().manual_seed(0)),
        torch.randn(100, generator=torch.Generator().manual_seed(0)).numpy(),
        [0.5, 1.5, 2.5, 0.5],
        torch.tensor([0.0, 1.0, 0.25, 1.0], dtype=torch.float16),
    ],
    ids=["tensor", "numpy", "list", "float16"],
)
@pytest.mark.parametrize("function", ["dirichlet", "shards"])
def test_a_continuous_y_is_refused(labels, function):
    split = {
        "dirichlet": lambda: partition.dirichlet(labels, 2, alpha=1.0),
        "shards": lambda: partition.shards(labels, 4),
    }
    with pytest.raises(
        ValueError,
        match=rf"labels must be class labels .* non-integer values such as .*"
        rf"{function} splits each label's points.* Bin it first .*by_group",
    ):
        split[function]()


def test_labels_with_nan_are_refused():
    with pytest.raises(ValueError, match=r"labels holds NaN \(1 of its values\).* Drop those points"):
        partition.dirichlet(torch.tensor([0.0, float("nan"), 1.0]), 2, alpha=1.0)


def test_integral_labels_of_any_type_are_labels():
    expected = partition.dirichlet(torch.tensor([0, 1, 1, 0, 1, 0]), 2, alpha=1.0, seed=1)
    for labels in (
        torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
        torch.tensor([False, True, True, False, True, False]),
        np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.0]),
        np.array([0, 1, 1, 0, 1, 0]),
        [0, 1, 1, 0, 1, 0],
    ):
        assert torch.equal(partition.dirichlet(labels, 2, alpha=1.0, seed=1), expected)


def test_counts_and_seeds_of_any_integer_type():
    expected = partition.iid(16, 4, seed=3)
    for num_data, num_clients, seed in (
        (np.int64(16), np.int32(4), np.int16(3)),
        (torch.tensor(16), torch.tensor(4, dtype=torch.int32), torch.tensor(3)),
    ):
        assert torch.equal(partition.iid(num_data, num_clients, seed=seed), expected)
    labels = torch.arange(16) % 4
    assert torch.equal(partition.dirichlet(labels, np.int64(4), 0.5), partition.dirichlet(labels, 4, 0.5))
    assert torch.equal(partition.shards(labels, np.int64(8)), partition.shards(labels, 8))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: partition.iid(60, 2.5), r"num_clients must be an integer .*; got 2\.5, of type float"),
        (
            lambda: partition.iid(6e1, 3),
            r"num_data must be an integer .*; got 60\.0, of type float\. Pass int",
        ),
        (lambda: partition.iid(True, 1), r"num_data must be an integer .*; got True, a bool"),
        (lambda: partition.iid(10, np.float64(2.0)), r"num_clients must be an integer .*; got np\.float64"),
        (
            lambda: partition.iid(10, torch.tensor(2.0)),
            r"num_clients must be an integer .*; got tensor\(2\.\)",
        ),
        (lambda: partition.iid(10, 2, seed=0.5), r"seed must be an integer .*; got 0\.5"),
        (lambda: partition.dirichlet(LABELS, 2.0, alpha=1.0), r"num_clients must be an integer .*; got 2\.0"),
        (lambda: partition.dirichlet(LABELS, 10, alpha="1"), r"alpha must be > 0, got 1"),
        (lambda: partition.shards(LABELS, 10, major=True), r"major must be in \[0, 1\], got True"),
    ],
)
def test_numbers_of_the_wrong_type_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "clients, match",
    [
        (True, r"clients=True: give a whole number of clients \(e\.g\. 10, for an i\.i\.d\. split\)"),
        (2.5, r"clients=2\.5: give a whole number of clients"),
        (np.float32(3.0), r"clients=np\.float32\(3\.0\): give a whole number of clients"),
        (torch.tensor(3.0), r"clients=tensor\(3\.\): give a whole number of clients"),
    ],
)
def test_clients_not_a_whole_number_is_refused_by_name(clients, match):
    with pytest.raises(ValueError, match=match):
        partition.to_index_lists(clients, num_data=10)
    # by a kernel when it is built, before any data is seen
    from pyro_fed import FaldKernel

    with pytest.raises(ValueError, match=match):
        FaldKernel(lambda: None, clients)


def test_a_number_of_clients_of_any_integer_type():
    expected = [t.tolist() for t in partition.to_index_lists(3, num_data=10)]
    for clients in (np.int64(3), torch.tensor(3)):
        assert [t.tolist() for t in partition.to_index_lists(clients, num_data=10)] == expected
