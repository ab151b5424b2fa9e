"""The benchmark scripts run end to end (CPU smoke mode), and the report builds from a CSV."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from moetrain.kernels.common import interpreter_enabled

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
QUICK = ["--device", "cpu", "--quick", "--reps", "1"]


def _load(name: str):
    sys.path.insert(0, os.path.abspath(TOOLS))
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["bench_grouped_gemm", "bench_router", "bench_permutation"])
def test_benchmark_runs_on_cpu(script, tmp_path):
    csv_path = tmp_path / "bench.csv"
    rows = _load(script).main([*QUICK, "--csv", str(csv_path)])
    impls = {r["impl"] for r in rows}
    assert "torch" in impls or "torch_gmm" in impls
    assert ("triton" in impls) == interpreter_enabled()
    assert all(float(r["ms"]) >= 0 for r in rows)
    with open(csv_path) as f:
        assert sum(1 for _ in f) == len(rows) + 1  # header + one line per row

    report = _load("bench_report")
    md, png = tmp_path / "b.md", tmp_path / "b.png"
    text = report.main(["--csv", str(csv_path), "--md", str(md), "--png", str(png)])
    assert "have not been measured yet" in text  # CPU rows are not GPU figures
    text = report.main(["--csv", str(csv_path), "--md", str(md), "--png", str(png),
                        "--include-cpu"])  # fmt: skip
    assert rows[-1]["case"] in text and png.exists()


def test_benchmark_no_append_leaves_csv_alone(tmp_path):
    csv_path = tmp_path / "bench.csv"
    _load("bench_router").main([*QUICK, "--no-append", "--csv", str(csv_path)])
    assert not csv_path.exists()
