"""moetrain ablate: a two-point sweep on the micro config, its table read back against each
run's own event files, resuming, parallel runs, and sweep-file errors."""

from __future__ import annotations

import csv
import logging
import shutil
import statistics
from pathlib import Path

import pytest
import yaml
from conftest import MICRO, write_sweep
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from threads import one_thread

from moetrain.ablation import load_sweep, run_sweep
from moetrain.config import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"


def event_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """The run's scalars straight from its event files: tag -> {step: value}, last write wins."""
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time):
            out.setdefault(tag, {})[e.step] = e.value
    return out


def expected_row(run_dir: Path) -> dict[str, float]:
    """The documented figures, computed independently of moetrain.train.metrics."""
    s = event_scalars(run_dir)
    last = max(s["train/loss"])
    out = {"eval_loss": s["eval/loss"][max(s["eval/loss"])], "steps": last}
    for name in ("max_over_mean", "cv", "dropped_fraction", "router_entropy", "dead_experts"):
        per_layer = [
            statistics.fmean(v for step, v in s[f"moe/layer{layer}/{name}"].items()
                             if step > last // 2)
            for layer in (0, 1)
        ]
        out[name] = statistics.fmean(per_layer)
    for name in ("max_over_mean", "dropped_fraction"):  # the worst step of the worst layer
        out[f"peak_{name}"] = max(max(s[f"moe/layer{layer}/{name}"].values())
                                  for layer in (0, 1))
    out["tokens_per_s"] = statistics.median(v for st, v in s["perf/tokens_per_s"].items() if st > 1)
    return out


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def test_sweep_table_matches_each_runs_event_files(sweep_dir: Path) -> None:
    rows = read_csv(sweep_dir / "results.csv")
    assert list(rows) == ["top_k=1", "top_k=2"]
    configs = {}
    for name, row in rows.items():
        run_dir = sweep_dir / "runs" / name
        configs[name] = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert int(row["moe.top_k"]) == configs[name]["moe"]["top_k"]
        want = expected_row(run_dir)
        # eval_loss is the trainer's float64 figure; the event file holds it as float32.
        assert float(row["eval_loss"]) == pytest.approx(want["eval_loss"], rel=1e-6)
        for key in ("max_over_mean", "cv", "dropped_fraction", "router_entropy",
                    "dead_experts", "peak_max_over_mean", "peak_dropped_fraction",
                    "tokens_per_s"):
            assert float(row[key]) == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
        assert int(row["steps"]) == want["steps"] == MICRO["train.steps"]

    # Same data order and seeds: the configs differ only in the swept key and output_dir.
    a, b = configs["top_k=1"], configs["top_k=2"]
    for cfg in (a, b):
        cfg["train"].pop("output_dir")
        cfg["moe"].pop("top_k")
    assert a == b

    md = (sweep_dir / "results.md").read_text()
    for name, row in rows.items():
        assert f"| {name} | {name.split('=')[1]} |" in md
        assert f"{float(row['eval_loss']):.4f}" in md
    for png in ("results.png", "curves.png"):
        assert (sweep_dir / png).read_bytes().startswith(PNG)


def test_resume_skips_finished_runs_and_finishes_interrupted_ones(
    sweep_dir: Path, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "out"
    shutil.copytree(sweep_dir, out)
    before = read_csv(out / "results.csv")
    # Interrupt top_k=2 after step 2: its row and its last checkpoint are gone.
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(before["top_k=1"]))
        w.writeheader()
        w.writerow(before["top_k=1"])
    shutil.rmtree(out / "runs" / "top_k=2" / "checkpoints" / "step_00000003")
    events_1 = sorted((out / "runs" / "top_k=1" / "tb").iterdir())
    events_2 = sorted((out / "runs" / "top_k=2" / "tb").iterdir())

    sweep = load_sweep(write_sweep(tmp_path / "sweep.yaml"), out_dir=out)
    # On the threads the fixture's runs took: their eval loss is compared exactly below.
    with caplog.at_level(logging.INFO, logger="moetrain"), one_thread():
        rows = run_sweep(sweep)
    assert "2 runs, 1 finished, 1 to run" in caplog.text
    assert "resumed from" in caplog.text and "at step 2" in caplog.text
    assert sorted((out / "runs" / "top_k=1" / "tb").iterdir()) == events_1  # not rerun
    assert len(list((out / "runs" / "top_k=2" / "tb").iterdir())) == len(events_2) + 1
    after = read_csv(out / "results.csv")
    assert list(after) == ["top_k=1", "top_k=2"] and after["top_k=1"] == before["top_k=1"]
    # The trainer resumes exactly: the finished run's eval loss is the uninterrupted one.
    assert rows["top_k=2"]["eval_loss"] == before["top_k=2"]["eval_loss"]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moetrain"):
        run_sweep(sweep)  # everything finished: nothing runs
    assert "2 finished, 0 to run" in caplog.text and "sweep: run " not in caplog.text


@pytest.mark.timeout(240)
def test_parallel_runs_in_subprocesses_match_the_serial_sweep(sweep_dir: Path,
                                                              tmp_path: Path) -> None:
    sweep = load_sweep(write_sweep(tmp_path / "sweep.yaml"), out_dir=tmp_path / "out")
    rows = run_sweep(sweep, parallel=2)
    serial = read_csv(sweep_dir / "results.csv")
    for name in ("top_k=1", "top_k=2"):
        assert (tmp_path / "out" / "runs" / name / "result.json").exists()
        # Same data order and seeds in another process: the same training, up to the sums
        # a CPU matmul orders differently with another thread count (1 here, 2 serially).
        assert rows[name]["steps"] == serial[name]["steps"] == "3"
        assert float(rows[name]["eval_loss"]) == pytest.approx(float(serial[name]["eval_loss"]),
                                                               rel=1e-4)


def test_sweep_file_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.seed is set by the sweep runner"):
        load_sweep(write_sweep(tmp_path / "a.yaml", variants=[{"train.seed": 1}]))
    with pytest.raises(ConfigError, match=r"sweep run 'top_k=5'.*moe.top_k"):
        load_sweep(write_sweep(tmp_path / "b.yaml", grid={"moe.top_k": [1, 5]}))
    with pytest.raises(ConfigError, match="sweep.grid.moe.top_k: expected a non-empty list"):
        load_sweep(write_sweep(tmp_path / "c.yaml", grid={"moe.top_k": 2}))
    with pytest.raises(ConfigError, match="sweep.color: unknown key"):
        load_sweep(write_sweep(tmp_path / "d.yaml", color="red"))
    with pytest.raises(ConfigError, match=r"sweep.seeds: \[1, 1\] repeats a seed"):
        load_sweep(write_sweep(tmp_path / "d.yaml", seeds=[1, 1]))
    with pytest.raises(ConfigError, match="sweep.seeds: expected a non-empty list"):
        load_sweep(write_sweep(tmp_path / "d.yaml", seeds=[]))
    with pytest.raises(ConfigError, match="sweep.baseline: 'nope' is not a variant"):
        load_sweep(write_sweep(tmp_path / "d.yaml", baseline="nope"))
    with pytest.raises(ConfigError, match="runs train different numbers of tokens.*equal tokens"):
        load_sweep(write_sweep(tmp_path / "d.yaml",
                               variants=[{"name": "longer", "train.steps": 6}]))
    named = load_sweep(write_sweep(tmp_path / "e.yaml", grid={},
                                   variants=[{"name": "dropless", "moe.capacity_factor": None}]))
    assert [r.name for r in named.runs] == ["dropless"]
    assert named.runs[0].cfg.moe.capacity_factor is None


def test_the_shipped_smoke_sweep_is_the_one_tested(tmp_path: Path) -> None:
    smoke = load_sweep(Path(__file__).parents[2] / "configs" / "sweeps" / "smoke.yaml",
                       out_dir=tmp_path)
    tested = load_sweep(write_sweep(tmp_path / "sweep.yaml"), out_dir=tmp_path)
    assert [r.name for r in smoke.runs] == [r.name for r in tested.runs]
    for a, b in zip(smoke.runs, tested.runs, strict=True):
        assert a.cfg.to_dict() == b.cfg.to_dict()
