"""Tests run in float64 (float32 is for benchmarks and GPUs)."""

import pytest
import torch

torch.set_default_dtype(torch.float64)


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
