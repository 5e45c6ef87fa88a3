"""The README's example runs as written (a newcomer copies it first)."""

import re
from pathlib import Path

import arviz as az

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102 - our own README
    idata = namespace["idata"]
    assert isinstance(idata, az.InferenceData)
    assert idata.posterior["w"].shape == (4, 2000, 4)
    assert {"log_likelihood", "posterior_predictive", "sample_stats"} <= set(idata.groups())
