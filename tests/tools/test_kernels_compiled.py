"""Every Triton kernel compiled ahead of time for Hopper (sm_90) and Blackwell (sm_100), no GPU
needed (tools/kernels_compiled.py): what the kernels compile to matches the committed table
docs/kernels_compiled.{csv,md} and breaks none of its rules (shared memory within the
target, no spills, the grouped-GEMM tiles on the target's tensor-core MMA), and each of those
checks catches the fault it guards against.

The tool runs in a subprocess: it needs the Triton interpreter off, which this process keeps
on for the kernel tests. The full table is compiled once per test run; Triton's own cache
serves a repeat.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "kernels_compiled.py"
FAULTS = Path(__file__).with_name("kernels_compiled_faults.py")


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _tool(tmp_path: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "compiled.json"
    proc = _run([str(TOOL), *args, "--json", str(out)], timeout)
    assert out.exists(), f"the tool failed before writing its result:\n{proc.stdout}{proc.stderr}"
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="session")
def full_check(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    return _tool(tmp_path_factory.mktemp("compiled"), "--check", timeout=1700)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_committed_table_is_what_every_kernel_compiles_to(full_check):
    proc, result = full_check
    assert not result["diffs"], "\n".join(result["diffs"]) + "\n" + proc.stdout[-2000:]
    assert not result["problems"], "\n".join(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = result["rows"]
    assert {r["target"] for r in rows} == {"sm_90", "sm_100"}
    # Every grouped-GEMM configuration the autotuner may pick, per dtype and phase.
    gemm = [r for r in rows if r["kernel"] == "grouped_gemm._grouped_mm_kernel"
            and (r["target"], r["dtype"], r["phase"]) == ("sm_90", "bf16", "fwd")]  # fmt: skip
    assert len(gemm) == 8 and all(r["wgmma"] > 0 and r["mma"] == 0 for r in gemm)


def test_spot_check_matches_the_committed_table(tmp_path):
    """One configuration of every kernel and phase on sm_90: a quick look the default run
    takes (the full table is the slow test above)."""
    proc, result = _tool(tmp_path, "--spot", timeout=900)
    assert not result["diffs"], "\n".join(result["diffs"])
    assert not result["problems"], "\n".join(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(ROOT / "docs" / "kernels_compiled.csv") as f:
        every = {r["kernel"] for r in csv.DictReader(f)}
    assert {r["kernel"] for r in result["rows"]} == every  # every kernel, at one config
    assert {r["target"] for r in result["rows"]} == {"sm_90"}


def test_the_checks_catch_what_they_guard_against():
    proc = _run([str(FAULTS)], timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    caught = json.loads(proc.stdout.strip().splitlines()[-1])
    spill = caught["spill"]
    assert spill["row"]["spill_stores"] > 0 and spill["row"]["spills_in_loop"] > 0
    # The cubin-derived spill bytes are ptxas's own figures.
    assert spill["ptxas"] == [spill["row"]["spill_stores"], spill["row"]["spill_loads"]]
    assert any("spills" in p for p in spill["problems"]), spill
    outside = caught["spill_outside_loop"]
    assert outside["row"]["spill_stores"] > 0 and outside["row"]["spills_in_loop"] == 0
    assert outside["problems"] == [], outside
    assert caught["smem"]["shared"] > 227 * 1024
    assert any("shared memory" in p for p in caught["smem"]["problems"]), caught["smem"]
    assert caught["mma"]["wgmma"] == 0 and caught["mma"]["mma"] > 0
    assert any("expected wgmma" in p for p in caught["mma"]["problems"]), caught["mma"]
    assert len(caught["coverage"]) == 1 and "never launched" in caught["coverage"][0]
    assert any("registers" in d and "->" in d for d in caught["compare"]), caught["compare"]
    assert any(d.startswith("row gone") for d in caught["compare"]), caught["compare"]
    assert len(caught["compiler"]) == 1 and "this is Triton 0.0" in caught["compiler"][0]
