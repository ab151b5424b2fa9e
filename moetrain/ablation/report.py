"""The tables and plots of a ``moetrain ablate`` sweep (``moetrain.ablation.runner`` runs it).

- ``results.csv``: one row per finished run (variant and seed): the varied keys, the
  figures of ``moetrain.train.metrics.run_summary`` (final eval loss; imbalance, drops,
  entropy, dead experts over the second half of training; the worst step's imbalance and
  drops; median tokens/s), active
  parameters, FLOPs per token, tokens, steps, seconds.
- ``summary.csv``: per variant and figure, over its seeds: n, mean, sample std, the 95%
  t interval, and the difference from the baseline variant with its 95% interval, paired
  by seed when both ran the same seeds (``moetrain.ablation.stats``), and whether that interval
  spans zero ("within noise").
- ``curves.csv``: per variant and logged step, the train loss (mean over seeds) and its
  difference from the baseline's at the same step with its 95% interval, paired by seed:
  how closely a variant's curve tracks the baseline's (FP8 against bf16, docs/fp8.md).
- ``results.md``: the same as markdown tables; ``results.png``: per figure the variants'
  means with their intervals as error bars and each seed as a dot; ``differences.png``: each
  variant's difference from the baseline with its interval (multi-seed sweeps);
  ``curves.png``: train loss, eval loss and max/mean over steps, mean over seeds (band:
  lowest to highest seed).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

from moetrain.ablation.spec import Sweep, fmt_value
from moetrain.ablation.stats import Interval, difference_interval, mean_interval

FIGURES = ("eval_loss", "max_over_mean", "cv", "dropped_fraction", "router_entropy",
           "dead_experts", "peak_max_over_mean", "peak_dropped_fraction",
           "tokens_per_s")  # fmt: skip
"""Result columns after the varied keys; see ``moetrain.train.metrics.run_summary``."""
COST = ("active_params", "flops_per_token", "tokens")
"""What each run computes: active parameters per token, training FLOPs per token
(``Transformer.flops_per_token``) and tokens trained."""
HEADS = {"eval_loss": "eval loss", "max_over_mean": "max/mean", "cv": "CV",
         "dropped_fraction": "dropped", "router_entropy": "router entropy",
         "dead_experts": "dead experts", "peak_max_over_mean": "peak max/mean",
         "peak_dropped_fraction": "peak dropped", "tokens_per_s": "tokens/s"}  # fmt: skip
FMTS = {"eval_loss": "{:.4f}", "max_over_mean": "{:.3f}", "cv": "{:.3f}",
        "dropped_fraction": "{:.2%}", "router_entropy": "{:.3f}", "dead_experts": "{:.2f}",
        "peak_max_over_mean": "{:.3f}", "peak_dropped_fraction": "{:.2%}",
        "tokens_per_s": "{:,.0f}"}  # fmt: skip
DIFF_FMTS = {k: f.replace("{:", "{:+", 1) for k, f in FMTS.items()}
"""The formats of differences from the baseline: the figure's format with a sign."""
CONFIDENCE = 0.95


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _float(row: dict[str, str], key: str) -> float:
    try:
        return float(row.get(key, "nan"))
    except ValueError:
        return math.nan


def _seed(row: dict[str, str]) -> int:
    return int(row["seed"]) if row.get("seed") else 0


def by_variant(sweep: Sweep, rows: dict[str, dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """Finished rows grouped by variant, in sweep order."""
    out: dict[str, list[dict[str, str]]] = {name: [] for name in sweep.variants}
    for run in sweep.runs:
        if run.key in rows:
            out[run.name].append(rows[run.key])
    return out


def summarize(sweep: Sweep, rows: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Per variant: its varied keys, seeds finished, cost, and per figure the interval over
    seeds (``<fig>``) and the difference from the baseline (``<fig>_diff``)."""
    groups = by_variant(sweep, rows)
    base = {_seed(r): r for r in groups.get(sweep.baseline, [])}
    out = []
    for name, runs in groups.items():
        if not runs:
            continue
        spec = next(r for r in sweep.runs if r.name == name)
        entry: dict[str, Any] = {"run": name, "varied": spec.varied, "n": len(runs),
                                 "seeds": sorted(_seed(r) for r in runs)}
        for key in COST:
            entry[key] = _float(runs[0], key)
        for fig in FIGURES:
            entry[fig] = mean_interval([_float(r, fig) for r in runs], CONFIDENCE)
            entry[f"{fig}_diff"] = difference_interval(
                {_seed(r): _float(r, fig) for r in runs},
                {s: _float(r, fig) for s, r in base.items()},
                CONFIDENCE,
            )
        out.append(entry)
    return out


def _summary_rows(sweep: Sweep, summary: list[dict[str, Any]]) -> tuple[list[str], list[dict]]:
    cols = ["run", *sweep.varied_keys, "baseline", "n", "seeds", *COST]
    for fig in FIGURES:
        cols += [f"{fig}_{k}" for k in ("mean", "std", "lo", "hi")]
        cols += [f"{fig}_diff_{k}" for k in ("mean", "lo", "hi", "kind", "within_noise")]
    out = []
    for e in summary:
        row: dict[str, Any] = {"run": e["run"], "n": e["n"],
                               "baseline": str(e["run"] == sweep.baseline).lower(),
                               "seeds": " ".join(map(str, e["seeds"]))}
        row.update({k: fmt_value(v) for k, v in e["varied"].items()})
        row.update({k: repr(e[k]) for k in COST})
        for fig in FIGURES:
            iv: Interval = e[fig]
            d: Interval = e[f"{fig}_diff"]
            row.update({f"{fig}_mean": repr(iv.mean), f"{fig}_std": repr(iv.std),
                        f"{fig}_lo": repr(iv.lo), f"{fig}_hi": repr(iv.hi),
                        f"{fig}_diff_mean": repr(d.mean), f"{fig}_diff_lo": repr(d.lo),
                        f"{fig}_diff_hi": repr(d.hi), f"{fig}_diff_kind": d.kind,
                        f"{fig}_diff_within_noise": str(d.within_noise).lower()})
        out.append(row)
    return cols, out


def _write_csv(path: Path, cols: list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def write_results(sweep: Sweep, rows: dict[str, dict[str, str]]) -> None:
    """results.csv (one row per finished run, in sweep order), summary.csv, results.md and
    the plots."""
    ordered = [rows[r.key] for r in sweep.runs if r.key in rows]
    cols = ["run", "seed", *sweep.varied_keys, *FIGURES, *COST, "steps", "seconds"]
    _write_csv(sweep.out_dir / "results.csv", cols, ordered)
    summary = summarize(sweep, rows)
    _write_csv(sweep.out_dir / "summary.csv", *_summary_rows(sweep, summary))
    write_atomic(sweep.out_dir / "results.md", markdown(sweep, ordered, summary))
    if ordered:
        curves = curve_differences(sweep, rows)
        _write_csv(sweep.out_dir / "curves.csv", list(CURVE_COLUMNS), curves)
        plot_results(sweep, summary, rows)


CURVE_COLUMNS = ("run", "step", "n", "train_loss_mean", "train_loss_diff_mean",
                 "train_loss_diff_lo", "train_loss_diff_hi", "train_loss_diff_kind")  # fmt: skip


def curve_differences(sweep: Sweep, rows: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """``curves.csv``: per variant and step that every one of its finished seeds logged, the
    train loss's mean over seeds and its difference from the baseline's at that step
    (``difference_interval``: paired by seed)."""
    from moetrain.train.metrics import read_scalars

    curves: dict[str, dict[int, dict[int, float]]] = {}  # variant -> seed -> step -> loss
    for run in sweep.runs:
        if run.key in rows:
            loss = dict(read_scalars(run.cfg.train.output_dir).get("train/loss", []))
            curves.setdefault(run.name, {})[run.seed or 0] = loss
    base = curves.get(sweep.baseline, {})
    out = []
    for name in sweep.variants:
        seeds = curves.get(name, {})
        if not seeds:
            continue
        for step in sorted(set.intersection(*(set(c) for c in seeds.values()))):
            mine = {s: c[step] for s, c in seeds.items()}
            theirs = {s: c[step] for s, c in base.items() if step in c}
            iv = mean_interval(list(mine.values()), CONFIDENCE)
            d = difference_interval(mine, theirs, CONFIDENCE)
            out.append({"run": name, "step": str(step), "n": str(iv.n),
                        "train_loss_mean": repr(iv.mean), "train_loss_diff_mean": repr(d.mean),
                        "train_loss_diff_lo": repr(d.lo), "train_loss_diff_hi": repr(d.hi),
                        "train_loss_diff_kind": d.kind})  # fmt: skip
    return out


# ----------------------------------------------------------------------------- markdown


def _cell(fig: str, value: float) -> str:
    return FMTS[fig].format(value) if math.isfinite(value) else "n/a"


def _interval_cell(fig: str, iv: Interval) -> str:
    if iv.n >= 2 and math.isfinite(iv.lo):
        return f"{_cell(fig, iv.mean)} [{_cell(fig, iv.lo)}, {_cell(fig, iv.hi)}]"
    return _cell(fig, iv.mean)


def _diff_cell(fig: str, d: Interval) -> str:
    if not math.isfinite(d.mean):
        return "n/a"
    text = DIFF_FMTS[fig].format(d.mean)
    if not math.isfinite(d.lo):
        return text
    text += f" [{DIFF_FMTS[fig].format(d.lo)}, {DIFF_FMTS[fig].format(d.hi)}]"
    return text + (" within noise" if d.within_noise else "")


def _si(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def markdown(sweep: Sweep, rows: list[dict[str, str]], summary: list[dict[str, Any]]) -> str:
    keys = sweep.varied_keys
    seeds = sweep.seeds
    tokens = _float(rows[0], "tokens") if rows else math.nan
    n_runs = len(sweep.runs)
    lines = [f"# Router ablation: {sweep.path.name}", "",
             f"{len(rows)} of {n_runs} runs finished"
             + (f", {len(sweep.variants)} variants x seeds {seeds}" if seeds else "")
             + f"; every run trains {_si(tokens)} tokens (variants are compared at equal "
             "tokens). Figures: final eval loss; imbalance, drops, entropy and dead experts "
             "averaged over the MoE layers and the second half of training; peak max/mean and "
             "peak dropped: the worst logged step of the worst MoE layer; median tokens/s.",
             ""]  # fmt: skip
    figs = [f for f in FIGURES]
    if seeds:
        first = sweep.runs[0].cfg
        lines += [
            f"## Mean and {CONFIDENCE:.0%} interval over seeds", "",
            f"Each seed sets train.seed (initialisation and router jitter); the data order "
            f"(data.seed={first.data.seed}) is the same for every run. Cells: mean [interval]"
            f", the interval mean +- t(n-1) x std / sqrt(n).", "",
            "| run | " + " | ".join([*keys, "seeds", "active params", "FLOPs/token",
                                      *(HEADS[f] for f in figs)]) + " |",
            "|" + "---|" * (1 + len(keys)) + "---:|" * (3 + len(figs)),
        ]  # fmt: skip
        for e in summary:
            cells = [e["run"], *(fmt_value(e["varied"].get(k, "")) for k in keys), str(e["n"]),
                     _si(e["active_params"]), _si(e["flops_per_token"])]
            cells += [_interval_cell(f, e[f]) for f in figs]
            lines.append("| " + " | ".join(cells) + " |")
        kinds = {e[f"{f}_diff"].kind for e in summary for f in figs} - {""}
        how = ("paired by seed: the mean and interval of each seed's difference"
               if kinds == {"paired"} else
               "paired by seed where both ran the same seeds, else Welch's unpaired interval")
        lines += [
            "", f"## Difference from the baseline ({sweep.baseline})", "",
            f"Variant minus baseline, {how}; \"within noise\" when the {CONFIDENCE:.0%} "
            "interval spans zero.", "",
            "| run | " + " | ".join(HEADS[f] for f in figs) + " |",
            "|---|" + "---:|" * len(figs),
        ]  # fmt: skip
        for e in summary:
            if e["run"] == sweep.baseline:
                continue
            cells = [e["run"], *(_diff_cell(f, e[f"{f}_diff"]) for f in figs)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "## Runs", ""]
    lines += [
        "| run | " + " | ".join([*(["seed"] if seeds else []), *keys, "active params",
                                  "FLOPs/token", *(HEADS[f] for f in figs)]) + " |",
        "|" + "---|" * (1 + len(keys) + (1 if seeds else 0)) + "---:|" * (2 + len(figs)),
    ]  # fmt: skip
    best = min((_float(r, "eval_loss") for r in rows), default=math.nan)
    for row in rows:
        cells = [row["run"], *([row.get("seed", "")] if seeds else []),
                 *(row.get(k, "") for k in keys), _si(_float(row, "active_params")),
                 _si(_float(row, "flops_per_token"))]  # fmt: skip
        for fig in figs:
            text = _cell(fig, _float(row, fig))
            bold = fig == "eval_loss" and _float(row, fig) == best and not seeds
            cells.append(f"**{text}**" if bold else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots

PANELS = (("eval_loss", "final eval loss (nats/token)"), ("max_over_mean", "load max/mean"),
          ("dropped_fraction", "dropped fraction"), ("tokens_per_s", "tokens/s"))  # fmt: skip


def plot_results(sweep: Sweep, summary: list[dict[str, Any]],
                 rows: dict[str, dict[str, str]]) -> None:  # fmt: skip
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [e["run"] for e in summary]
    groups = by_variant(sweep, rows)
    height = 3.2 + 0.12 * max(len(n) for n in names)
    fig = Figure(figsize=(12, height), dpi=110)
    FigureCanvasAgg(fig)
    for i, (key, title) in enumerate(PANELS):
        ax = fig.add_subplot(1, len(PANELS), i + 1)
        draw_bars(ax, [e[key] for e in summary], [[_float(r, key) for r in groups[n]]
                                                  for n in names], names)  # fmt: skip
        ax.set_title(title + (f" (mean, {CONFIDENCE:.0%} CI)" if sweep.seeds else ""),
                     fontsize=8)
    fig.tight_layout()
    fig.savefig(sweep.out_dir / "results.png")

    others = [e for e in summary if e["run"] != sweep.baseline]
    if sweep.seeds and others:
        fig = Figure(figsize=(12, height), dpi=110)
        FigureCanvasAgg(fig)
        for i, (key, title) in enumerate(PANELS):
            ax = fig.add_subplot(1, len(PANELS), i + 1)
            draw_differences(ax, [e[f"{key}_diff"] for e in others], [e["run"] for e in others])
            ax.set_title(f"{title}\nminus {sweep.baseline}", fontsize=8)
        fig.tight_layout()
        fig.savefig(sweep.out_dir / "differences.png")
    plot_curves(sweep, rows)


def draw_bars(ax: Any, intervals: list[Interval], points: list[list[float]],
              names: list[str]) -> None:  # fmt: skip
    """Means as bars, intervals as error bars, each seed's value as a dot."""
    x = list(range(len(intervals)))
    means = [iv.mean for iv in intervals]
    err = [[iv.mean - iv.lo if math.isfinite(iv.lo) else 0.0 for iv in intervals],
           [iv.hi - iv.mean if math.isfinite(iv.hi) else 0.0 for iv in intervals]]
    ax.bar(x, means, color=[f"C{j % 10}" for j in x], alpha=0.75)
    ax.errorbar(x, means, yerr=err, fmt="none", ecolor="black", capsize=4, lw=1)
    for j, values in enumerate(points):
        ax.plot([j] * len(values), values, "o", color="black", ms=2.5, alpha=0.6)
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    finite = [v for vs in points for v in vs if math.isfinite(v)]
    finite += [v for iv in intervals for v in (iv.lo, iv.hi) if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) < 1.5:
        lo, hi = min(finite), max(finite)  # a zoom: differences would not show from zero
        pad = max(hi - lo, 1e-3 * hi) * 0.4
        ax.set_ylim(lo - pad, hi + pad)


def draw_differences(ax: Any, diffs: list[Interval], names: list[str]) -> None:
    x = list(range(len(diffs)))
    means = [d.mean for d in diffs]
    err = [[d.mean - d.lo if math.isfinite(d.lo) else 0.0 for d in diffs],
           [d.hi - d.mean if math.isfinite(d.hi) else 0.0 for d in diffs]]
    colors = ["0.6" if d.within_noise else f"C{(j + 1) % 10}" for j, d in enumerate(diffs)]
    ax.axhline(0.0, color="black", lw=0.8)
    for j in x:
        ax.errorbar([j], [means[j]], yerr=[[err[0][j]], [err[1][j]]], fmt="o",
                    color=colors[j], capsize=4)
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(diffs) - 0.4)


def plot_curves(sweep: Sweep, rows: dict[str, dict[str, str]]) -> None:
    """Train loss, eval loss and layer-mean max/mean over steps: per variant the mean over
    its finished seeds, with the band from the lowest to the highest seed."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from moetrain.train.metrics import moe_layer_ids, read_scalars

    fig = Figure(figsize=(12, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, 3, i + 1) for i in range(3)]
    for j, name in enumerate(sweep.variants):
        series: list[list[dict[int, float]]] = [[], [], []]
        for run in (r for r in sweep.runs if r.name == name and r.key in rows):
            scalars = read_scalars(run.cfg.train.output_dir)
            series[0].append(dict(scalars.get("train/loss", [])))
            series[1].append(dict(scalars.get("eval/loss", [])))
            per_step: dict[int, list[float]] = {}
            for layer in moe_layer_ids(scalars):
                for s, v in scalars[f"moe/layer{layer}/max_over_mean"]:
                    per_step.setdefault(s, []).append(v)
            series[2].append({s: sum(v) / len(v) for s, v in per_step.items()})
        for ax, runs, marker in zip(axes, series, ("", ".", ""), strict=True):
            steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
            if not steps:
                continue
            values = np.array([[r[s] for s in steps] for r in runs])
            ax.plot(steps, values.mean(0), color=f"C{j % 10}", lw=1, marker=marker, label=name)
            if len(runs) > 1:
                ax.fill_between(steps, values.min(0), values.max(0), color=f"C{j % 10}",
                                alpha=0.2, lw=0)
    for ax, title in zip(axes, ("train loss", "eval loss", "load max/mean (layer mean)"),
                         strict=True):
        ax.set_title(title + (" (mean over seeds, band: min-max)" if sweep.seeds else ""),
                     fontsize=8)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(sweep.out_dir / "curves.png")
