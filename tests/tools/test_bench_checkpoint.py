"""tools/bench_checkpoint.py: docs/checkpoints.md says what docs/data/bench_checkpoint.json
holds, and the tool runs (a micro model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_tool

bench = load_tool("bench_checkpoint")


def test_the_page_says_what_the_json_holds() -> None:
    run = json.loads(bench.JSON.read_text())
    assert run["figures"][0]["state_bytes"] >= 1e9  # the size: at least 1 GB of state
    assert bench.page_block(bench.PAGE.read_text()) == bench.render(run), (
        "docs/checkpoints.md is stale: python tools/bench_checkpoint.py --render"
    )


@pytest.mark.timeout(300)
def test_a_quick_run_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--warmup", "1", "--steps", "2", "--out", str(out),
                       "--no-page"]) == 0  # fmt: skip
    figures = json.loads(out.read_text())["figures"][-1]
    assert figures["staging_bytes"] > 0 and figures["checkpoint_bytes"] > 0
    assert len(figures["normal_steps_s"]) == 2 * 2 and figures["async_steps_s"]  # before, after
    assert figures["sync_step_s"] > 0 and figures["async_save_s"] > 0
