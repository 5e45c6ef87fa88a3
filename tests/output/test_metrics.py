"""The evaluation metrics against hand-computed cases, exact Gaussian potentials and real Pyro models."""

import math

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr

from pyro_fed.model.potential import FederatedPotential
from pyro_fed.output.metrics import (
    _as_draw_matrix,
    accuracy,
    agreement,
    brier_score,
    draw_potentials,
    expected_calibration_error,
    hpd_level,
    negative_log_likelihood,
    predictive_probabilities,
    relative_hpd_error,
    total_variation,
    wasserstein2,
)

from ..models import gaussian_regression, regression_data


def test_hpd_level_is_the_empirical_quantile():
    potentials = torch.arange(1.0, 101.0)  # 1, 2, ..., 100
    # the 0.95 quantile with linear interpolation: position 0.95 * 99 = 94.05 -> 95 + 0.05
    assert hpd_level(potentials, alpha=0.05) == pytest.approx(95.05)
    assert hpd_level(potentials, alpha=0.5) == pytest.approx(50.5)
    assert relative_hpd_error(105.0, 100.0) == pytest.approx(0.05)
    assert relative_hpd_error(-95.0, -100.0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        hpd_level(potentials, alpha=1.0)


def test_draw_potentials_are_the_models_full_potential():
    # the conjugate regression: U(w) = |w|^2 / 2 + sum_j (y_j - x_j w)^2 / (2 s^2) + constants
    x, y = regression_data(30)
    pot = FederatedPotential(gaussian_regression(0.5), (x, y), clients=3, gradient_mode="eager")
    w = torch.randn(6, 3)
    constant = 0.5 * 3 * torch.log(torch.tensor(2 * torch.pi)) + 30 * torch.log(
        torch.tensor(0.5 * (2 * torch.pi) ** 0.5)
    )
    expected = w.square().sum(-1) / 2 + (y - w @ x.T).square().sum(-1) / (2 * 0.25) + constant
    torch.testing.assert_close(draw_potentials(pot, {"w": w}), expected)
    # ArviZ data: 2 chains x 3 draws, stacked chain-major back into the 6 draws
    idata = az.from_dict(posterior={"w": w.reshape(2, 3, 3).numpy()})
    torch.testing.assert_close(draw_potentials(pot, idata), expected)


# --- predictive metrics on 3 points, 3 classes -------------------------------------------------------------
PROBS = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.4]])  # argmax 0, 1, 2
LABELS = torch.tensor([0, 2, 2])
REFERENCE = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.2, 0.5, 0.3]])  # argmax 0, 2, 1


def test_accuracy_and_agreement_by_hand():
    assert accuracy(PROBS, LABELS) == pytest.approx(2 / 3)  # right, wrong (1 != 2), right
    assert agreement(PROBS, REFERENCE) == pytest.approx(1 / 3)  # 0 = 0; 1 != 2; 2 != 1
    assert agreement(PROBS, PROBS) == 1.0
    # binary labels as bool or float 0/1
    binary = torch.tensor([[0.2, 0.8], [0.9, 0.1]])
    assert accuracy(binary, torch.tensor([True, True])) == 0.5
    assert accuracy(binary, torch.tensor([1.0, 0.0])) == 1.0


def test_total_variation_by_hand():
    # 1/2 sum_c |p - q| per point: (0.1 + 0.1 + 0) / 2 = 0.1; (0.1 + 0.3 + 0.2) / 2 = 0.3;
    # (0.1 + 0.2 + 0.1) / 2 = 0.2; mean 0.2
    assert total_variation(PROBS, REFERENCE) == pytest.approx(0.2)
    assert total_variation(PROBS, PROBS) == 0.0


def test_brier_and_nll_by_hand():
    # sum_c (p_c - 1[c = y])^2: (0.3^2 + 0.2^2 + 0.1^2) = 0.14; (0.1^2 + 0.5^2 + 0.6^2) = 0.62;
    # (0.3^2 + 0.3^2 + 0.6^2) = 0.54; mean 1.30 / 3
    assert brier_score(PROBS, LABELS) == pytest.approx(1.30 / 3)
    assert brier_score(torch.eye(3), torch.arange(3)) == 0.0  # certain and right
    # -log p_y: p_y = 0.7, 0.4, 0.4
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(-(math.log(0.7) + 2 * math.log(0.4)) / 3)
    # no clamping: a label of probability 0 costs inf
    assert negative_log_likelihood(torch.tensor([[1.0, 0.0]]), torch.tensor([1])) == math.inf


def test_expected_calibration_error_right_closed_bins():
    # M = 4 bins (0, .25], (.25, .5], (.5, .75], (.75, 1]
    probs = torch.tensor(
        [
            [0.5, 0.3, 0.2],  # conf 0.5 (an edge: bin 2), predicts 0, label 1: wrong
            [0.2, 0.6, 0.2],  # conf 0.6: bin 3, right
            [0.05, 0.05, 0.9],  # conf 0.9: bin 4, right
            [0.75, 0.25, 0.0],  # conf 0.75 (an edge: bin 3), predicts 0, label 1: wrong
        ]
    )
    labels = torch.tensor([1, 1, 2, 1])
    # bin 2: 1/4 |0 - 0.5| = 0.125; bin 3: 2/4 |1/2 - (0.6 + 0.75)/2| = 0.0875; bin 4: 1/4 |1 - 0.9| = 0.025
    assert expected_calibration_error(probs, labels, bins=4) == pytest.approx(0.2375)
    # (left-closed bins would put 0.5 with 0.6 and 0.75 with 0.9: 0.025 + 0.1625 = 0.1875)
    # one bin: |accuracy - mean confidence| = |0.5 - 2.75 / 4|
    assert expected_calibration_error(probs, labels, bins=1) == pytest.approx(0.1875)
    assert expected_calibration_error(torch.eye(3), torch.arange(3)) == 0.0  # certain and right


def test_predictive_metric_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"probs must be a floating-point \[N, C\].*torch.stack"):
        accuracy(torch.tensor([0.2, 0.7]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"reference_probs must be .*shape \(3,\)"):
        agreement(PROBS, REFERENCE[:, 0])
    with pytest.raises(ValueError, match=r"same shape"):
        total_variation(PROBS, REFERENCE[:2])
    with pytest.raises(ValueError, match=r"labels must have shape \[N\] = \(3,\)"):
        brier_score(PROBS, LABELS[:, None])
    with pytest.raises(ValueError, match=r"labels must be in \{0, \.\.\., 2\}"):
        negative_log_likelihood(PROBS, torch.tensor([0, 3, 1]))
    with pytest.raises(ValueError, match="not integers"):
        accuracy(PROBS, torch.tensor([0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="bins must be a positive integer"):
        expected_calibration_error(PROBS, LABELS, bins=0)


# --- Wasserstein-2 ------------------------------------------------------------------------------------------
def test_wasserstein2_one_dimensional():
    # equal sizes: sorted 1, 2, 3 against 0, 1, 5: squared gaps 1, 1, 4, mean 2
    assert wasserstein2(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0.0, 5.0, 1.0])) == pytest.approx(2**0.5)
    # unequal sizes: {0, 1} (mass 1/2 each) against {0, 1, 2} (1/3 each); the quantile coupling moves
    # 1/6 from 0 to 1 and 1/3 from 1 to 2: W2^2 = 1/6 + 1/3 = 1/2
    x, y = torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0, 2.0])
    assert wasserstein2(x, y) == pytest.approx(0.5**0.5)
    assert wasserstein2(y[:, None], x[:, None]) == pytest.approx(0.5**0.5)  # [K, 1] and symmetric


def test_wasserstein2_optimal_permutation_and_shift():
    # identity pairing costs 2 per point; the swap costs 1: W2 = 1
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    assert wasserstein2(x, y) == pytest.approx(1.0)
    # a translation by v: the identity is optimal and every point moves by |v|
    cloud = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    v = torch.tensor([1.0, -2.0, 0.5])
    assert wasserstein2(cloud, cloud + v) == pytest.approx(float(v.norm()))


def test_wasserstein2_of_posterior_data():
    a, b = torch.randn(6, 2), torch.randn(6)
    # sites flattened and concatenated in sorted order of the names
    torch.testing.assert_close(_as_draw_matrix({"b": b, "a": a}), torch.cat([a, b[:, None]], 1))
    idata = az.from_dict(posterior={"b": b.reshape(2, 3).numpy(), "a": a.reshape(2, 3, 2).numpy()})
    torch.testing.assert_close(_as_draw_matrix(idata), torch.cat([a, b[:, None]], 1))
    # ArviZ 1.x gives an xarray DataTree with a posterior node
    tree = xr.DataTree.from_dict({"posterior": idata.posterior})
    torch.testing.assert_close(_as_draw_matrix(tree), torch.cat([a, b[:, None]], 1))
    shift = torch.tensor([0.3, -0.4, 1.2])
    assert wasserstein2(idata, _as_draw_matrix(idata) + shift) == pytest.approx(float(shift.norm()))


def test_wasserstein2_unequal_sizes_in_several_dimensions(monkeypatch):
    x, y = torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="same dimension d"):
        wasserstein2(x, y[:, :1])
    with pytest.raises(ValueError, match="same leading number of draws"):
        wasserstein2({"a": torch.zeros(3), "b": torch.zeros(4)}, x)
    monkeypatch.setitem(__import__("sys").modules, "ot", None)  # POT absent
    with pytest.raises(ImportError, match="pip install pot"):
        wasserstein2(x, y)


def test_wasserstein2_unequal_sizes_with_pot():
    pytest.importorskip("ot")
    # every point of x goes to the single y, at squared distance 1 each
    x, y = torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    assert wasserstein2(x, y) == pytest.approx(1.0)


# --- predictive probabilities of Pyro models ----------------------------------------------------------------
def logistic(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def logistic_to_event(x, y=None):  # no plate: an Independent wrapper around a masked Bernoulli
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    if w[0].item() > -100:  # data-dependent Python: vmap fails, the draws run one by one
        likelihood = dist.Bernoulli(logits=x @ w).mask(torch.ones(x.shape[0], dtype=torch.bool)).to_event(1)
        return pyro.sample("y", likelihood, obs=y)


X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
W = torch.tensor([[1.0, -1.0], [0.0, 2.0]])  # logits x @ w: [1, -1, 0] and [0, 2, 2]


@pytest.mark.parametrize("model", [logistic, logistic_to_event])
def test_predictive_probabilities_of_a_logistic_model(model):
    def s(t):
        return 1 / (1 + math.exp(-t))

    p1 = torch.tensor([s(1) + s(0), s(-1) + s(2), s(0) + s(2)]) / 2  # mean P(y = 1) of the two draws
    expected = torch.stack([1 - p1, p1], -1)
    torch.manual_seed(0)
    after_seed = torch.rand(1)
    torch.manual_seed(0)
    torch.testing.assert_close(predictive_probabilities(model, {"w": W}, X), expected)
    assert torch.rand(1) == after_seed  # the global RNG is left alone
    by_one = predictive_probabilities(model, {"w": W}, x=X, site="y", chunk_size=1)  # keyword input too
    torch.testing.assert_close(by_one, expected)
    # with the test labels given, the site is observed: same probabilities
    observed = predictive_probabilities(model, {"w": W}, X, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(observed, expected)


@pytest.mark.parametrize("likelihood", [dist.Categorical, dist.OneHotCategorical])
def test_predictive_probabilities_of_a_softmax_model(likelihood):
    def softmax(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("y", likelihood(logits=x @ w), obs=y)

    w = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(1))
    expected = torch.softmax(X @ w, -1).mean(0)  # [4, 3, 3] -> [3, 3]
    probs = predictive_probabilities(softmax, {"w": w}, X)
    torch.testing.assert_close(probs, expected)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    # ArviZ data: 2 chains x 2 draws
    idata = az.from_dict(posterior={"w": w.reshape(2, 2, 2, 3).numpy()})
    torch.testing.assert_close(predictive_probabilities(softmax, idata, X), probs)
    # float32 ArviZ draws are moved to the inputs' float64
    idata32 = az.from_dict(posterior={"w": w.reshape(2, 2, 2, 3).float().numpy()})
    torch.testing.assert_close(predictive_probabilities(softmax, idata32, X), probs, atol=1e-6, rtol=1e-6)


def test_predictive_probabilities_errors():
    def two_outputs(x, y=None, z=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
            pyro.sample("z", dist.Normal(x @ w, 1.0), obs=z)

    with pytest.raises(ValueError, match=r"exactly one sample site .* found \['y', 'z'\]"):
        predictive_probabilities(two_outputs, {"w": W}, X)
    named = predictive_probabilities(two_outputs, {"w": W}, X, site="y")
    torch.testing.assert_close(named, predictive_probabilities(logistic, {"w": W}, X))
    with pytest.raises(TypeError, match="'z' has a Normal distribution"):
        predictive_probabilities(two_outputs, {"w": W}, X, site="z")
    with pytest.raises(ValueError, match="'w' is a latent site"):
        predictive_probabilities(logistic, {"w": W}, X, site="w")
    with pytest.raises(ValueError, match="'v' is not a sample site"):
        predictive_probabilities(logistic, {"w": W}, X, site="v")
    with pytest.raises(TypeError, match="samples must be a dict"):
        predictive_probabilities(logistic, W, X)
