"""The documentation's quick start runs as written: its code blocks, in order, in one namespace (a newcomer
copies them one after another), with the chains shortened to a smoke size as the tutorials are in CI."""

import re
from pathlib import Path

import arviz as az
import matplotlib
import pytest
import torch

QUICK_START = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


@pytest.mark.slow
def test_quick_start_runs():
    matplotlib.use("Agg")  # the page draws a posterior predictive check
    blocks = re.findall(r"```python\n(.*?)```", QUICK_START.read_text(), flags=re.S)
    assert len(blocks) >= 4, "the quick start lost its code blocks"
    code = "\n".join(blocks)
    assert code.count("num_samples=2000, warmup_steps=200") == 2, "the smoke size no longer applies"
    # the draws are thinned automatically (up to 100 iterations each): 30 draws are thousands of iterations
    code = code.replace("num_samples=2000, warmup_steps=200", "num_samples=30, warmup_steps=20")
    namespace: dict = {}
    exec(compile(code, str(QUICK_START), "exec"), namespace)  # noqa: S102 - our own docs
    assert isinstance(namespace["idata"], az.InferenceData)
    assert namespace["idata"].posterior["w"].shape == (4, 30, 4)
    probs = namespace["probs"]
    assert probs.shape == (441, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(441, dtype=probs.dtype))
