"""Smoke test of benchmarks/nuts_models.py: a model written for NUTS runs under every kernel, by its rows."""

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_run_writes_a_row_per_sampler(tmp_path):
    spec = importlib.util.spec_from_file_location("nuts_models", BENCHMARKS / "nuts_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--quick", "--models", "optional obs (Poisson)", "--out", str(tmp_path)])
    assert [row["sampler"] for row in rows] == ["NUTS", *module.KERNELS]
    for row in rows[1:]:
        assert row["by_rows"] and row["ess"] > 0 and row["sd_ratio"] > 0
    written = json.loads((tmp_path / "nuts_models_quick.json").read_text())
    assert len(written["rows"]) == 4
    assert "| optional obs (Poisson) | FALD |" in (tmp_path / "nuts_models_quick.md").read_text()
