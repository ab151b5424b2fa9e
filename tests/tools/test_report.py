"""tools/expert_report.py on the sweep's event files: one self-contained HTML page whose
numbers are the event files' and whose plots are embedded PNGs."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import load_tool
from test_ablate import event_scalars, expected_row

PNG = b"\x89PNG\r\n\x1a\n"
FORMATS = {"eval_loss": "{:.4f}", "max_over_mean": "{:.3f}", "cv": "{:.3f}",
           "dropped_fraction": "{:.3%}", "dead_experts": "{:.2f}", "tokens_per_s": "{:,.0f}",
           "steps": "{:.0f}"}


def test_report_embeds_pngs_and_prints_the_event_files_numbers(sweep_dir: Path,
                                                                tmp_path: Path) -> None:
    report = load_tool("expert_report")
    out = tmp_path / "report.html"
    result = report.main([str(sweep_dir), "-o", str(out), "--png-dir", str(tmp_path / "png")])
    page = out.read_text()

    # Self-contained: every image is a data URI holding a PNG; nothing is fetched.
    srcs = re.findall(r'<img[^>]* src="([^"]+)"', page)
    # loss, per-layer curves, and per run a heatmap, its specialization and its stability
    assert len(srcs) == 2 + 2 * 3
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert not re.search(r'(src|href)="(https?:|file:|/)', page)
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "curves.png", "heatmap_0.png", "heatmap_1.png", "loss.png", "specialization_0.png",
        "specialization_1.png", "stability_0.png", "stability_1.png"]

    # The summary table: one row per run, each cell the event files' figure.
    rows = dict(re.findall(r'<tr data-run="([^"]+)">(.*?)</tr>', page))
    assert sorted(rows) == ["top_k=1", "top_k=2"]
    keys = [k for k, _, _ in report.TABLE]
    for name, row in rows.items():
        cells = re.findall(r'<td data-value="([^"]+)">([^<]*)</td>', row)
        assert len(cells) == len(keys)
        want = expected_row(sweep_dir / "runs" / name)
        for key, (value, text) in zip(keys, cells, strict=True):
            if key in FORMATS:
                assert float(value) == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
                assert text == FORMATS[key].format(want[key]), key
        assert result["summaries"][name]["eval_loss"] == pytest.approx(want["eval_loss"])


def test_heatmap_matrix_is_the_token_share_scalars(sweep_dir: Path) -> None:
    report = load_tool("expert_report")
    run_dir = sweep_dir / "runs" / "top_k=2"
    s = event_scalars(run_dir)
    steps, share = report.share_matrix(report.read_scalars(run_dir), 1)
    assert steps == [1, 2, 3] and share.shape == (4, 3)
    for e in range(4):
        assert share[e].tolist() == [s[f"moe/layer1/tokens/expert{e}"][st] for st in steps]
    np.testing.assert_allclose(share.sum(0), 1.0, atol=1e-6)


def test_report_refuses_a_directory_without_runs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run here"):
        load_tool("expert_report").build_report([tmp_path])
