"""Smoke test of benchmarks/participation_cost.py: its quick run writes its table, at the sizes it says."""

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_run_writes_a_row_per_participation(tmp_path):
    spec = importlib.util.spec_from_file_location("participation_cost", BENCHMARKS / "participation_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path.remove(str(BENCHMARKS))  # the script puts its folder first, for its common module
    rows = module.main(["--quick", "--out", str(tmp_path)])
    assert [row["participation"] for row in rows] == list(module.PARTICIPATIONS)
    for row in rows:
        # 100 clients each active with probability p, over 2 chunks of 64 iterations: the mean count is
        # 100 p within a few binomial standard errors (sd sqrt(100 p (1 - p) / 128) <= 0.45)
        assert abs(row["mean_active_clients"] - 100 * row["participation"]) < 2.5
        assert row["ms_per_iteration"] > 0
    assert rows[0]["ratio_to_full"] == 1.0
    written = json.loads((tmp_path / "participation_cost_quick.json").read_text())
    assert written["clients"] == 100 and len(written["rows"]) == 3
    assert "| participation |" in (tmp_path / "participation_cost_quick.md").read_text()
