"""Smoke test of benchmarks/scale.py: every size in its own process, its rows and the fitted exponents."""

import importlib.util
import json
import math
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load():
    spec = importlib.util.spec_from_file_location("scale", BENCHMARKS / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_a_row_per_size_and_sampler_and_the_growth(tmp_path):
    module = load()
    rows = module.main(["--quick", "--axes", "clients", "--kernels", "FALD", "--out", str(tmp_path)])
    # FALD at both sizes, NUTS once: the pooled data do not depend on the clients
    assert [(r["size"], r["sampler"]) for r in rows] == [(2, "FALD"), (2, "NUTS"), (8, "FALD")]
    for row in rows:
        assert "failed" not in row, row
        assert row["ess"] > 0 and row["peak_rss_gb"] > 0 and row["to_1000_ess_s"] > row["wall_s"] * 0
    fald = [r for r in rows if r["sampler"] == "FALD"]
    for row in fald:
        assert 0 < row["warmup_share"] < 1 and row["seconds_per_iteration"] > 0
        assert row["warmup_line"].startswith("pyro_fed's warm-up for FaldKernel")
    written = json.loads((tmp_path / "scale_quick.json").read_text())
    (fit,) = [f for f in written["fits"] if f["sampler"] == "FALD"]
    # two sizes: the exponent is the slope of the line through them
    expected = math.log(fald[1]["seconds_per_iteration"] / fald[0]["seconds_per_iteration"]) / math.log(4)
    assert math.isclose(fit["per_iteration"], expected, rel_tol=1e-9)
    assert "| clients | 8 | 20 | 8 | 400 | FALD |" in (tmp_path / "scale_quick.md").read_text()


def test_the_network_of_the_dimension_axis_has_the_dimension_it_reports():
    module = load()
    spec = {"model": "mlp", "hidden": 3, "data": 50, "dim": 0, "seed": 0}
    model, x, y = module.problem(spec)
    import pyro

    trace = pyro.poutine.trace(model).get_trace(x, y)
    latent = sum(trace.nodes[name]["value"].numel() for name in ("w1", "b1", "w2", "b2"))
    assert latent == (module.INPUTS + 1) * 3 + (3 + 1) * module.CLASSES
