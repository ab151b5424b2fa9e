"""moetrain ablate with seeds: the shipped two-variant x three-seed sweep on the tiny config
(configs/sweeps/tiny_seeds.yaml), its summary recomputed from the runs' own event files
(means, sample standard deviations, t intervals, paired differences), the data order
shared by every run, and an interrupted multi-seed sweep resumed without redoing finished
runs."""

from __future__ import annotations

import csv
import logging
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest
import yaml
from test_ablate import event_scalars
from threads import one_thread

from moetrain.ablation import load_sweep, run_sweep

SWEEP = Path(__file__).parents[2] / "configs" / "sweeps" / "tiny_seeds.yaml"
VARIANTS = ("switch-aux", "global-aux")
SEEDS = (0, 1, 2)
T_975_DF2 = 4.302652729749464
"""Student's t 0.975 quantile with 2 degrees of freedom (tables: 4.303)."""
FIGS = ("eval_loss", "max_over_mean", "cv", "dropped_fraction", "router_entropy",
        "dead_experts", "peak_max_over_mean", "peak_dropped_fraction", "tokens_per_s")  # fmt: skip


@pytest.fixture(scope="module")
def seeds_dir(tmp_path_factory) -> Path:
    """The shipped sweep, trained on ``one_thread()``: the resumed run below is compared with
    it exactly, on the same threads (tests/threads.py)."""
    from moetrain.cli import main

    out = tmp_path_factory.mktemp("seeds") / "out"
    with one_thread():
        assert main(["ablate", str(SWEEP), "--out", str(out)]) == 0
    return out


def figures(run_dir: Path) -> dict[str, float]:
    """The documented per-run figures, straight from the run's event files."""
    s = event_scalars(run_dir)
    last = max(s["train/loss"])
    out = {"eval_loss": s["eval/loss"][max(s["eval/loss"])]}
    layers = sorted({int(m.group(1)) for t in s if (m := re.fullmatch(r"moe/layer(\d+)/cv", t))})
    for name in FIGS[1:-3]:
        out[name] = statistics.fmean(
            statistics.fmean(v for step, v in s[f"moe/layer{layer}/{name}"].items()
                             if step > last // 2)
            for layer in layers
        )  # fmt: skip
    for name in ("max_over_mean", "dropped_fraction"):  # the worst step of the worst layer
        out[f"peak_{name}"] = max(max(s[f"moe/layer{layer}/{name}"].values()) for layer in layers)
    out["tokens_per_s"] = statistics.median(v for st, v in s["perf/tokens_per_s"].items() if st > 1)
    return out


def interval(values: list[float]) -> tuple[float, float, float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values)
    half = T_975_DF2 * std / math.sqrt(len(values))
    return mean, std, mean - half, mean + half


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_summary_is_recomputed_from_the_event_files(seeds_dir: Path) -> None:
    runs = {(v, s): figures(seeds_dir / "runs" / v / f"seed_{s}") for v in VARIANTS for s in SEEDS}
    summary = {row["run"]: row for row in read(seeds_dir / "summary.csv")}
    assert list(summary) == list(VARIANTS)
    md = (seeds_dir / "results.md").read_text()
    for v in VARIANTS:
        row = summary[v]
        assert row["n"] == "3" and row["seeds"] == "0 1 2"
        for fig in FIGS:
            # eval_loss: the trainer's float64 figure; the event file holds it as float32.
            rel = 1e-6 if fig == "eval_loss" else 1e-9
            mean, std, lo, hi = interval([runs[v, s][fig] for s in SEEDS])
            for key, want in (("mean", mean), ("std", std), ("lo", lo), ("hi", hi)):
                assert float(row[f"{fig}_{key}"]) == pytest.approx(want, rel=rel, abs=1e-12), (
                    v, fig, key)
            # Paired by seed: the interval of each seed's difference from the baseline.
            d = [runs[v, s][fig] - runs[VARIANTS[0], s][fig] for s in SEEDS]
            if v == VARIANTS[0]:
                assert float(row[f"{fig}_diff_mean"]) == 0.0
                continue
            dmean, _, dlo, dhi = interval(d)
            assert row[f"{fig}_diff_kind"] == "paired"
            for key, want in (("mean", dmean), ("lo", dlo), ("hi", dhi)):
                assert float(row[f"{fig}_diff_{key}"]) == pytest.approx(
                    want, rel=1e-5 if fig == "eval_loss" else 1e-9, abs=1e-7), (v, fig, key)
            assert row[f"{fig}_diff_within_noise"] == str(not (dlo > 0 or dhi < 0)).lower()
        mean, _, lo, hi = interval([runs[v, s]["eval_loss"] for s in SEEDS])
        assert f"| {v} |" in md and f"{mean:.4f} [{lo:.4f}, {hi:.4f}]" in md
        # Cost columns: every run trains 3 steps x 4 sequences x 64 tokens.
        assert float(row["tokens"]) == 3 * 4 * 64
        assert float(row["active_params"]) > 0 and float(row["flops_per_token"]) > 0
    assert "## Difference from the baseline (switch-aux)" in md and "paired by seed" in md
    for png in ("results.png", "differences.png", "curves.png"):
        assert (seeds_dir / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_curves_are_the_train_losses_paired_by_seed(seeds_dir: Path) -> None:
    """curves.csv: at every logged step, each variant's mean train loss over the seeds and
    its difference from the baseline's, paired by seed, from the runs' event files."""
    loss = {(v, s): event_scalars(seeds_dir / "runs" / v / f"seed_{s}")["train/loss"]
            for v in VARIANTS for s in SEEDS}  # fmt: skip
    rows = read(seeds_dir / "curves.csv")
    steps = sorted(loss[VARIANTS[0], 0])
    assert [(r["run"], int(r["step"])) for r in rows] == [(v, t) for v in VARIANTS for t in steps]
    for r in rows:
        v, t = r["run"], int(r["step"])
        assert float(r["train_loss_mean"]) == pytest.approx(
            statistics.fmean(loss[v, s][t] for s in SEEDS), rel=1e-9)
        d = [loss[v, s][t] - loss[VARIANTS[0], s][t] for s in SEEDS]
        if v == VARIANTS[0]:
            assert float(r["train_loss_diff_mean"]) == 0.0
            continue
        mean, _, lo, hi = interval(d)
        assert r["train_loss_diff_kind"] == "paired"
        for key, want in (("mean", mean), ("lo", lo), ("hi", hi)):
            assert float(r[f"train_loss_diff_{key}"]) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.slow
def test_seeds_vary_init_and_jitter_but_not_the_data(seeds_dir: Path) -> None:
    configs = {}
    for v in VARIANTS:
        for s in SEEDS:
            cfg = yaml.safe_load((seeds_dir / "runs" / v / f"seed_{s}" / "config.yaml").read_text())
            assert cfg["train"]["seed"] == s
            configs[v, s] = cfg
    assert len({yaml.safe_dump(c["data"]) for c in configs.values()}) == 1
    first = {k: event_scalars(seeds_dir / "runs" / k[0] / f"seed_{k[1]}")["train/loss"][1]
             for k in configs}
    # Step 1's loss is the initial model's on the first batch (the balancing loss only adds
    # a gradient): equal across variants for a seed -- the pairing -- and different across
    # seeds (another init; the batch is the same).
    for s in SEEDS:
        assert first[VARIANTS[0], s] == first[VARIANTS[1], s]
    assert len({first[VARIANTS[0], s] for s in SEEDS}) == 3


@pytest.mark.slow
def test_an_interrupted_multi_seed_sweep_resumes_without_redoing_runs(
    seeds_dir: Path, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "out"
    shutil.copytree(seeds_dir, out)
    rows = read(out / "results.csv")
    kept = [r for r in rows if (r["run"], r["seed"]) != ("global-aux", "1")]
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(kept)
    victim = out / "runs" / "global-aux" / "seed_1"
    shutil.rmtree(victim / "checkpoints" / "step_00000003")
    events = {p: sorted((p / "tb").iterdir()) for p in (out / "runs").glob("*/seed_*")}

    sweep = load_sweep(SWEEP, out_dir=out)
    with caplog.at_level(logging.INFO, logger="moetrain"), one_thread():  # as seeds_dir's runs
        run_sweep(sweep)
    assert "6 runs, 5 finished, 1 to run" in caplog.text
    assert "sweep: run global-aux/seed_1" in caplog.text and "at step 2" in caplog.text
    for path, before in events.items():
        after = sorted((path / "tb").iterdir())
        assert after == before if path != victim else len(after) == len(before) + 1, path
    again = {(r["run"], r["seed"]): r for r in read(out / "results.csv")}
    assert list(again) == [(r["run"], r["seed"]) for r in rows]
    # Resumed exactly: the interrupted run ends with the uninterrupted run's eval loss.
    assert again["global-aux", "1"]["eval_loss"] == rows[4]["eval_loss"]
