"""Tests run in float64 (DESIGN.md: float64 in tests, float32 allowed in benchmarks and on GPU)."""

import pytest
import torch

torch.set_default_dtype(torch.float64)


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
