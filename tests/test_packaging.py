"""The wheel a user gets from ``pip install .`` (not the editable install the tests run from)
holds every module of the package and its package data: a subpackage missing from
pyproject.toml's ``packages`` list imports fine in an editable checkout and is absent from
the wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each source folder lands in the wheel (pyproject.toml's package-dir).
SOURCES = {"moetrain": "moetrain", "kernels": "moetrain/kernels"}


def wanted_files() -> set[str]:
    """Every Python module and data file of the package, as its path inside the wheel."""
    out = set()
    for src, dest in SOURCES.items():
        for path in (ROOT / src).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                out.add(f"{dest}/{path.relative_to(ROOT / src).as_posix()}")
    return out


def missing(wheel_files: set[str]) -> list[str]:
    return sorted(wanted_files() - wheel_files)


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *SOURCES):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name,
            src / name,
            **(
                {"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}
            ),  # fmt: skip
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("moetrain-*.whl")
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
    assert not missing(files), f"not in the wheel (pyproject.toml packages): {missing(files)}"
    # The check can fail: a wheel without one subpackage is reported.
    dropped = {f for f in files if not f.startswith("moetrain/plan/")}
    assert "moetrain/plan/__init__.py" in missing(dropped)
