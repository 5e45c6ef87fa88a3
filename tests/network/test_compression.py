"""The QSGD quantiser: unbiased by exact enumeration, its variance bound, its bit cost's check values."""

import itertools
import math

import numpy as np
import pytest
import torch

from pyro_fed.network.compression import Compressor, StochasticQuantizer, compressor


def exact_law(quantizer, v):
    """Every outcome of Q_s(v) with its probability: each coordinate rounds to one of its two levels."""
    s, norm = quantizer.levels, v.norm()
    scaled = s * v.abs() / norm
    lower = scaled.floor()
    up = scaled - lower  # probability of the upper level
    outcomes = []
    for choice in itertools.product((0, 1), repeat=len(v)):
        pick = torch.tensor(choice, dtype=v.dtype)
        prob = torch.where(pick.bool(), up, 1 - up).prod()
        # the same outcome from the quantiser, with uniforms that select it
        uniforms = torch.where(pick.bool(), torch.zeros_like(v), torch.ones_like(v) - 1e-12)
        outcomes.append((float(prob), quantizer.compress(v, uniforms)))
    return outcomes


@pytest.mark.parametrize("levels", [1, 2, 5, 2**4])
def test_quantizer_is_unbiased_with_bounded_variance_by_exact_enumeration(levels):
    quantizer = StochasticQuantizer(levels)
    v = torch.tensor([0.3, -1.7, 0.0, 2.2, -0.05])
    outcomes = exact_law(quantizer, v)
    assert sum(p for p, _ in outcomes) == pytest.approx(1.0, abs=1e-12)
    mean = sum(p * q for p, q in outcomes)
    torch.testing.assert_close(mean, v, rtol=0, atol=1e-12)
    variance = sum(p * (q - v).square().sum() for p, q in outcomes)
    assert variance <= quantizer.omega(len(v)) * v.square().sum() + 1e-12
    # every outcome is on the grid: |Q_j| = ||v|| * integer / s, with the sign of v_j
    for _, q in outcomes:
        levels_used = q.abs() * levels / v.norm()
        torch.testing.assert_close(levels_used, levels_used.round(), rtol=0, atol=1e-12)
        assert (q * v >= 0).all()


def test_zero_vector_and_batches():
    quantizer = StochasticQuantizer(4)
    v = torch.zeros(3, 5)
    v[1] = torch.arange(5.0)
    out = quantizer.compress(v, torch.rand(3, 5))
    assert torch.equal(out[0], torch.zeros(5)) and torch.equal(out[2], torch.zeros(5))
    assert torch.isfinite(out).all()


def test_bits_check_values():
    # the QLSD paper's values (natural logarithms in QSGD's bound), and 32 d uncompressed
    assert StochasticQuantizer(2**16).bits(50) == pytest.approx(613.7, abs=0.05)
    assert 1600 / StochasticQuantizer(2**16).bits(50) == pytest.approx(2.61, abs=0.005)
    for levels, bits in ((2**4, 3288.0), (2**8, 3736.2), (2**16, 8074.4)):
        assert StochasticQuantizer(levels).bits(784) == pytest.approx(bits, abs=0.05)
    # 2.8 d + 32 at s = sqrt(d), on the second branch
    assert StochasticQuantizer(10).bits(100) == pytest.approx((math.log(1 + 200 / 100) + 1) / 2 * 100 + 232)
    assert Compressor().bits(50) == 1600 and Compressor().omega(50) == 0
    assert StochasticQuantizer(4).omega(50) == pytest.approx(math.sqrt(50) / 4)


@pytest.mark.parametrize("levels", [16, np.int64(16), np.int32(16), np.uint8(16), torch.tensor(16)])
def test_levels_of_any_integer_type(levels):
    quantizer = compressor(levels)
    assert isinstance(quantizer, StochasticQuantizer)
    assert type(quantizer.levels) is int and quantizer.levels == 16
    assert quantizer.bits(50) == StochasticQuantizer(16).bits(50)


@pytest.mark.parametrize(
    "levels, hint",
    [
        (0, False),
        (-3, False),
        (np.int64(0), False),
        (2.5, True),
        (16.0, True),
        (np.float64(16.0), True),
        (torch.tensor(16.0), True),
        (torch.tensor([16]), True),
        (True, False),
        (np.bool_(True), False),
        ("16", False),
    ],
)
def test_bad_levels_are_refused_naming_the_value(levels, hint):
    with pytest.raises(ValueError, match="quantization_levels must be a positive integer") as error:
        compressor(levels)
    assert f"got {levels!r}." in str(error.value)
    # a number that is not an integer type: say how to pass it
    assert ("Pass int(quantization_levels)" in str(error.value)) == hint
