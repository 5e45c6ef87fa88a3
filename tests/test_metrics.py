"""The HPD level against hand-computed cases and an exact Gaussian potential."""

import pytest
import torch

from pyro_fed.metrics import draw_potentials, hpd_level, relative_hpd_error
from pyro_fed.potential import FederatedPotential

from .models import gaussian_regression, regression_data


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
    w = torch.randn(5, 3)
    constant = 0.5 * 3 * torch.log(torch.tensor(2 * torch.pi)) + 30 * torch.log(
        torch.tensor(0.5 * (2 * torch.pi) ** 0.5)
    )
    expected = w.square().sum(-1) / 2 + (y - w @ x.T).square().sum(-1) / (2 * 0.25) + constant
    torch.testing.assert_close(draw_potentials(pot, {"w": w}), expected)
