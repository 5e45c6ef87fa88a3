"""The README's example runs as written (a newcomer copies it first), with the chains shortened to a smoke
size as the tutorials are in CI."""

import re
from pathlib import Path

import arviz as az

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    code = blocks[0]
    assert code.count("num_samples=2000, warmup_steps=200") == 2, "the smoke size no longer applies"
    # the draws are thinned automatically (up to 100 iterations each): 30 draws are thousands of iterations
    code = code.replace("num_samples=2000, warmup_steps=200", "num_samples=30, warmup_steps=20")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    idata = namespace["idata"]
    assert isinstance(idata, az.InferenceData)
    assert idata.posterior["w"].shape == (4, 30, 4)
    assert {"log_likelihood", "posterior_predictive", "sample_stats"} <= set(idata.groups())
