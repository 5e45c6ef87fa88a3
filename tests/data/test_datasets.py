import pytest
import torch

from pyro_fed.data import datasets

# Dawson (1995), written as in the published table: counts in class order 1st, 2nd, 3rd, crew.
TABLE = {
    ("no", "child", "male"): (0, 0, 35, 0),
    ("no", "child", "female"): (0, 0, 17, 0),
    ("no", "adult", "male"): (118, 154, 387, 670),
    ("no", "adult", "female"): (4, 13, 89, 3),
    ("yes", "child", "male"): (5, 11, 13, 0),
    ("yes", "child", "female"): (1, 13, 14, 0),
    ("yes", "adult", "male"): (57, 14, 75, 192),
    ("yes", "adult", "female"): (140, 80, 76, 20),
}


def decode(x, y):
    """Recovers the raw codes from the standardised columns, which are monotone in them."""
    codes = [torch.unique(x[:, j], return_inverse=True)[1] for j in (1, 2, 3)]
    return codes[0], codes[1], codes[2], y.long()  # class 0..3, male, adult, survived


def cell_counts(x, y):
    class_, male, adult, survived = decode(x, y)
    counts = {}
    for outcome, age, sex in TABLE:
        mask = (survived == (outcome == "yes")) & (adult == (age == "adult")) & (male == (sex == "male"))
        counts[outcome, age, sex] = tuple(int((mask & (class_ == k)).sum()) for k in range(4))
    return counts


def test_titanic_shapes_and_totals():
    x, y = datasets.titanic()
    assert x.shape == (2201, 4) and y.shape == (2201,)
    assert x.dtype == y.dtype == torch.float64
    assert y.sum() == 711 and set(y.tolist()) == {0.0, 1.0}
    assert torch.equal(x[:, 0], torch.ones(2201, dtype=torch.float64))
    assert len(datasets.feature_names) == 4 and datasets.feature_names[0] == "intercept"


def test_titanic_encoding():
    x, y = datasets.titanic()
    torch.testing.assert_close(x[:, 1:].mean(0), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(x[:, 1:].std(0, correction=0), torch.ones(3, dtype=torch.float64))
    class_, male, adult, _ = decode(x, y)
    # Known margins of the table: people per class, 1731 males, 2092 adults.
    assert torch.bincount(class_).tolist() == [325, 285, 706, 885]
    assert male.sum() == 1731 and adult.sum() == 2092


def test_titanic_recovers_every_cell():
    x, y = datasets.titanic()
    assert cell_counts(x, y) == TABLE
    class_, male, adult, survived = decode(x, y)
    assert int(((class_ == 0) & (male == 0) & (adult == 1) & (survived == 1)).sum()) == 140


def test_titanic_deterministic_and_dtype():
    x, y = datasets.titanic()
    x2, y2 = datasets.titanic()
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x32, y32 = datasets.titanic(dtype=torch.float32)
    assert x32.dtype == y32.dtype == torch.float32
    torch.testing.assert_close(x32, x.float())
    # Rows expand the table in order: first come the 35 3rd-class male children who did not survive.
    first = decode(x, y)
    assert [int(t[0]) for t in first] == [2, 1, 0, 0]
    assert all(torch.all(t[:35] == t[0]) for t in first)
    assert not all(torch.all(t[:36] == t[0]) for t in first)


def test_titanic_split():
    x_train, y_train, x_test, y_test = datasets.titanic_split()
    assert x_train.shape == (1760, 4) and y_train.shape == (1760,)
    assert x_test.shape == (441, 4) and y_test.shape == (441,)
    # Together the two sets are exactly the table.
    assert cell_counts(torch.cat([x_train, x_test]), torch.cat([y_train, y_test])) == TABLE
    again = datasets.titanic_split()
    assert all(torch.equal(a, b) for a, b in zip(again, (x_train, y_train, x_test, y_test), strict=True))
    assert not torch.equal(datasets.titanic_split(seed=1)[1], y_train)
    assert datasets.titanic_split(test_size=100)[2].shape == (100, 4)


def test_titanic_split_leaves_global_rng_untouched():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    datasets.titanic_split(seed=3)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("test_size", [0, 2201, -5])
def test_titanic_split_rejects_bad_test_size(test_size):
    with pytest.raises(ValueError, match=rf"test_size must be in 1\.\.2200, got {test_size}"):
        datasets.titanic_split(test_size=test_size)


def test_titanic_follows_the_default_device():
    # built on the host, placed on the default device like any new tensor ("meta" stands in for a GPU)
    with torch.device("meta"):
        x, y = datasets.titanic()
        x_train, _, x_test, _ = datasets.titanic_split()
    assert x.device.type == "meta" and x.shape == (2201, 4) and y.shape == (2201,)
    assert x_train.device.type == "meta" and x_test.shape == (441, 4)
