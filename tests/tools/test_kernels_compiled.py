"""Every Triton kernel compiled ahead of time for Hopper (sm_90) and Blackwell (sm_100), no GPU
needed (tools/kernels_compiled.py): what the kernels compile to matches the committed table
(docs/data/kernels_compiled.csv, shown in docs/kernels_compiled.md) and breaks none of its
rules (shared memory within the target, no spills, the grouped-GEMM tiles on the target's
tensor-core MMA), and each of those checks catches the fault it guards against.

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
    with open(ROOT / "docs" / "data" / "kernels_compiled.csv") as f:
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


# ---------------------------------------------------------------------------------------------
# Every supported Triton: tl.dot's minimum shapes, and the record of the oldest one's compile
# ---------------------------------------------------------------------------------------------

RECORD = ROOT / "docs" / "data" / "kernels_compiled_oldest.csv"


@pytest.fixture(scope="module")
def kc():
    from conftest import load_tool

    return load_tool("kernels_compiled")


def _check_record(tmp_path: Path, csv_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    return _tool(tmp_path, "--check-record", "--csv", str(csv_path), timeout=900)


def test_every_tile_meets_every_supported_tritons_dot_minimum_and_the_oldest_compiles(tmp_path):
    """Triton 3.6 (what torch 2.11 brings) refuses a tl.dot under K=16 for 16- and 32-bit
    operands, which 3.9 allows for fp32: the fp32 tiles once had K=8 and every fp32 Triton
    GEMM died on the H100 (2026-11-27). Every tile the launchers launch (each autotune
    configuration, both targets) meets every supported Triton's minimum; and
    docs/data/kernels_compiled_oldest.csv, compiled under Triton 3.6.0 by `python
    tools/kernels_compiled.py --oldest`, holds exactly today's launches from today's kernel
    source, every one compiled for sm_90 and sm_100 without a problem."""
    proc, result = _check_record(tmp_path, RECORD)
    assert not result["problems"], "\n".join(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tiles = result["tiles"]
    # Not vacuous: the fp32 (32-bit, FMA) and bf16 tiles of forward, dgrad and wgrad.
    assert {(t["bits"], t["target"]) for t in tiles} == {(b, f"sm_{cc}") for b in (16, 32)
                                                        for cc in (90, 100)}  # fmt: skip
    phases = {p for t in tiles if t["bits"] == 32 for p in t["phase"].split(", ")}
    assert {"fwd", "dgrad", "wgrad", "gather fwd", "gather wgrad"} <= phases
    with open(RECORD) as f:
        rows = list(csv.DictReader(f))
    assert {r["target"] for r in rows} == {"sm_90", "sm_100"}
    assert all(r["compiler"].startswith("Triton 3.6.0,") for r in rows)
    with open(ROOT / "docs" / "data" / "kernels_compiled.csv") as f:
        newest = {tuple(r[k] for k in ("kernel", "phase", "target", "dtype", "config"))
                  for r in csv.DictReader(f)}  # fmt: skip
    assert {tuple(r[k] for k in ("kernel", "phase", "target", "dtype", "config"))
            for r in rows} == newest  # the same launches under both Tritons  # fmt: skip


def test_a_kernel_is_named_by_its_op_stem(kc):
    """The records name a kernel by its op's stem under kernels/ and its function, not by the
    file of the stem that defines it: the kernels moved from kernels/<stem>.py to
    kernels/<stem>/triton_backend.py and both records stayed valid (same names, same source
    hashes; the compile checks above compare them)."""
    assert kc.op_stem("moetrain.kernels.grouped_gemm.triton_backend") == "grouped_gemm"
    assert kc.op_stem("moetrain.kernels.router") == "router"
    assert kc.op_stem("kernels_compiled_faults") == "kernels_compiled_faults"
    stems = {p.parent.name for p in (ROOT / "kernels").glob("*/triton_backend.py")}
    for record in (RECORD, kc.DEFAULT_CSV):
        with open(record) as f:
            assert {r["kernel"].split(".")[0] for r in csv.DictReader(f)} == stems, record


def test_the_record_check_catches_a_stale_record(tmp_path):
    """A record from another Triton, missing a launch, or from an older kernel source does
    not vouch for the kernels."""
    with open(RECORD) as f:
        rows = list(csv.DictReader(f))
    fields = list(rows[0])
    doctored = [dict(r) for r in rows[1:]]  # one launch gone
    for r in doctored:
        if r["kernel"] == "router._route_fwd_kernel":
            r["source"] = "0" * 12  # compiled from another source
        if r["kernel"] == "permutation._invert_kernel":
            r["compiler"] = "Triton 3.9.0, ptxas 13.4"
    path = tmp_path / "record.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(doctored)
    proc, result = _check_record(tmp_path, path)
    found = "\n".join(result["problems"])
    assert proc.returncode == 1
    assert "not Triton 3.6.0" in found and "not in the record" in found, found
    assert "router._route_fwd_kernel: its source changed" in found, found


def test_the_dot_check_knows_each_tritons_minimums(kc):
    """DOT_MIN_K's row for the installed Triton is what its compiler enforces
    (triton.backends.nvidia.compiler.min_dot_size; the oldest's row is checked by the record,
    compiled under it), and the check names the Tritons an 8-deep fp32 tile fails."""
    import types

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import min_dot_size

    version = ".".join(triton.__version__.split(".")[:2])
    assert version in kc.DOT_MIN_K, f"Triton {version}: add its tl.dot minimums to DOT_MIN_K"
    for cc in (90, 100):
        check = min_dot_size(GPUTarget("cuda", cc, 32))
        for bits, k in kc.DOT_MIN_K[version].items():
            t = types.SimpleNamespace(scalar=types.SimpleNamespace(primitive_bitwidth=bits))
            assert check(t, t)[2] == k, (cc, bits)
    assert kc.DOT_MIN_K[kc.OLDEST_TRITON.rsplit(".", 1)[0]] == {8: 32, 16: 16, 32: 16}
    tile = {"kernel": "grouped_gemm._grouped_mm_kernel", "phase": "fwd", "target": "sm_90",
            "dtype": "fp32", "config": "BLOCK_K=8", "bits": 32, "k": 8}  # fmt: skip
    (problem,) = kc.dot_problems([tile])
    assert "K >= 16 of Triton 3.6" in problem and "3.9" not in problem
    assert kc.dot_problems([{**tile, "k": 16}]) == []
    assert kc.dot_problems([{**tile, "bits": 8, "k": 16}])  # fp8 needs 32


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_oldest_triton_compiles_the_spot_check_when_its_venv_exists(tmp_path, kc):
    """Under Triton 3.6 itself, where its virtual environment has been built (`python
    tools/kernels_compiled.py --oldest` builds it: CI holds the record instead, see above):
    one configuration of every kernel and phase compiles and matches the record."""
    venv = Path(kc.OLDEST_VENV)
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no Triton {kc.OLDEST_TRITON} environment at {venv}: `python "
                    "tools/kernels_compiled.py --oldest` builds it")  # fmt: skip
    proc, result = _tool(tmp_path, "--oldest", "--spot", timeout=1100)
    assert result["versions"].startswith(f"Triton {kc.OLDEST_TRITON},"), result["versions"]
    assert not result["diffs"], "\n".join(result["diffs"])
    assert not result["problems"], "\n".join(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
