"""kernels/measured.py is what tools/kernel_table.py writes from docs/data/benchmarks.csv, and a
changed measurement changes the choice."""

from __future__ import annotations

import csv
from pathlib import Path

from conftest import load_tool

REPO = Path(__file__).resolve().parents[2]


def test_committed_table_is_what_the_tool_writes(capsys):
    tool = load_tool("kernel_table")
    assert tool.main(["--check"]) == 0, capsys.readouterr().out


def _rows() -> list[dict]:
    with open(REPO / "docs" / "data" / "benchmarks.csv", newline="") as f:
        return list(csv.DictReader(f))


def _pick(tables: dict, op: str, case: str) -> dict:
    (found,) = [c for c in tables["CHOICES"] if c["op"] == op and c["case"] == case]
    return found


def test_a_new_measurement_changes_the_pick_and_the_check_fails(tmp_path, capsys):
    """Make the DeepSeek-V3 router's Triton fwd+bwd at 8,192 tokens fast in a newer run:
    the pick flips to Triton, and --check of the committed file fails against that CSV."""
    tool = load_tool("kernel_table")
    rows = _rows()
    before = _pick(tool.build(rows), "route", "deepseek-v3/T8192")
    assert before["pick"] == "torch" and before["speedup"] == 0.522
    newer = [dict(r, timestamp="2027-01-01T00:00:00+00:00") for r in rows
             if r["benchmark"] == "router" and r["case"] == "deepseek-v3/T8192"
             and r["op"] == "fwd+bwd"]  # fmt: skip
    for r in newer:
        if r["impl"] == "triton":
            r["ms"] = "0.5"
    after = _pick(tool.build(rows + newer), "route", "deepseek-v3/T8192")
    assert after["pick"] == "triton" and after["speedup"] == round(1.1560 / 0.5, 3)
    assert "2027-01-01" in after["rows"]
    path = tmp_path / "benchmarks.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows + newer)
    assert tool.main(["--check", "--csv", str(path)]) == 1
    assert "is not what tools/kernel_table.py writes" in capsys.readouterr().out


def test_rows_of_a_failed_run_and_unknown_devices_are_left_out(capsys):
    tool = load_tool("kernel_table")
    rows = [r for r in _rows() if r["benchmark"] == "permute"]
    broken = [dict(r, status="fail") for r in rows]
    assert tool.build(broken)["CHOICES"] == []
    odd = [dict(r, device="Some Accelerator 3000") for r in rows]
    assert tool.build(odd)["CHOICES"] == []
    assert "no architecture known for 'Some Accelerator 3000'" in capsys.readouterr().out
    assert tool.arch_of("NVIDIA H100 80GB HBM3") == "sm_90"
    assert tool.arch_of("NVIDIA GH200 480GB") == "sm_90"
    assert tool.arch_of("NVIDIA B200") == "sm_100"
