"""Expert-load report: one self-contained HTML page from the event files of one or more runs.

    python tools/expert_report.py outputs/tiny -o report.html
    python tools/expert_report.py outputs/sweeps/router -o router.html   # every run of a sweep
    python tools/expert_report.py runA runB --png-dir plots/              # also keep the PNGs

A run is a directory with a ``tb/`` folder (``train.output_dir``); a sweep directory stands
for its ``runs/*``. The page holds a summary table (the figures of
``moetrain.train.metrics.run_summary``), loss curves, per-layer imbalance, drop, entropy and
dead-expert curves with the runs overlaid, and per run and layer a heatmap of each expert's
token share over the steps, the runs side by side. Plots are PNGs embedded as base64 data
URIs: the file can be mailed or attached as it is.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moetrain.train.metrics import moe_layer_ids, read_scalars, run_summary

Scalars = dict[str, list[tuple[int, float]]]

TABLE = (  # key, heading, format
    ("eval_loss", "final eval loss", "{:.4f}"),
    ("train_loss", "final train loss", "{:.4f}"),
    ("max_over_mean", "load max/mean", "{:.3f}"),
    ("cv", "load CV", "{:.3f}"),
    ("dropped_fraction", "dropped", "{:.3%}"),
    ("router_entropy", "router entropy", "{:.3f}"),
    ("dead_experts", "dead experts", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("steps", "steps", "{:.0f}"),
)
CURVES = (("max_over_mean", "load max/mean"), ("cv", "load CV"),
          ("dropped_fraction", "dropped fraction"), ("router_entropy", "router entropy"),
          ("dead_experts", "dead experts"))


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories (with a tb/ folder) named by ``paths``: runs, sweeps or parents."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "tb").is_dir():
            found = [p]
        else:
            found = sorted(d.parent for d in p.glob("runs/*/tb") if d.is_dir())
            found = found or sorted(d.parent for d in p.glob("*/tb") if d.is_dir())
            found.sort(key=_sweep_order(p))
        if not found:
            raise FileNotFoundError(f"{p}: no run here (a run directory has a tb/ folder)")
        runs += [r for r in found if r not in runs]
    return runs


def _sweep_order(sweep_dir: Path):
    """Sort key: a sweep's runs in the order of its results.csv, the others after, by name."""
    order: list[str] = []
    if (sweep_dir / "results.csv").is_file():
        with (sweep_dir / "results.csv").open(newline="") as f:
            order = [row.get("run", "") for row in csv.DictReader(f)]
    return lambda run: (order.index(run.name) if run.name in order else len(order), run.name)


def run_labels(runs: list[Path]) -> list[str]:
    names = [r.name for r in runs]
    if len(set(names)) == len(names):
        return names
    return [f"{r.parent.name}/{r.name}" for r in runs]


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    for ax in fig.axes:
        if ax.get_label() != "<colorbar>":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _series(scalars: Scalars, tag: str) -> tuple[list[int], list[float]]:
    points = scalars.get(tag, [])
    return [s for s, _ in points], [v for _, v in points]


def loss_figure(runs: dict[str, Scalars]) -> bytes:
    fig = Figure(figsize=(11, 3.4), dpi=100)
    axes = [fig.add_subplot(1, 2, i + 1) for i in range(2)]
    for j, (label, scalars) in enumerate(runs.items()):
        axes[0].plot(*_series(scalars, "train/loss"), color=f"C{j % 10}", lw=1, label=label)
        axes[1].plot(*_series(scalars, "eval/loss"), color=f"C{j % 10}", marker=".",
                     label=label)
    for ax, title in zip(axes, ("train loss", "eval loss"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("nats/token")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def curves_figure(runs: dict[str, Scalars], layers: list[int]) -> bytes:
    """Rows: imbalance, CV, drops, entropy, dead experts; columns: MoE layers; runs overlaid."""
    fig = Figure(figsize=(3.4 * len(layers) + 1, 2.2 * len(CURVES)), dpi=100)
    for i, (name, title) in enumerate(CURVES):
        for c, layer in enumerate(layers):
            ax = fig.add_subplot(len(CURVES), len(layers), i * len(layers) + c + 1)
            for j, (label, scalars) in enumerate(runs.items()):
                ax.plot(*_series(scalars, f"moe/layer{layer}/{name}"), color=f"C{j % 10}",
                        lw=1, label=label)
            ax.set_title(f"layer {layer}: {title}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if i == 0 and c == len(layers) - 1:
                ax.legend(fontsize=6)
    fig.tight_layout()
    return _png(fig)


def share_matrix(scalars: Scalars, layer: int) -> tuple[list[int], np.ndarray]:
    """Steps and the (experts, steps) token-share matrix of one layer."""
    experts = sorted(int(t.rsplit("expert", 1)[1]) for t in scalars
                     if t.startswith(f"moe/layer{layer}/tokens/expert"))
    steps = sorted({s for e in experts for s, _ in scalars[f"moe/layer{layer}/tokens/expert{e}"]})
    col = {s: i for i, s in enumerate(steps)}
    share = np.full((len(experts), len(steps)), np.nan)
    for r, e in enumerate(experts):
        for s, v in scalars[f"moe/layer{layer}/tokens/expert{e}"]:
            share[r, col[s]] = v
    return steps, share


def heatmap_figure(label: str, scalars: Scalars, layers: list[int]) -> bytes:
    fig = Figure(figsize=(5.2, 1.9 * len(layers) + 0.6), dpi=100)
    axes = []
    for i, layer in enumerate(layers):
        ax = fig.add_subplot(len(layers), 1, i + 1)
        axes.append(ax)
        steps, share = share_matrix(scalars, layer)
        E = share.shape[0]
        if not steps:
            continue
        im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis",
                       vmin=0.0, vmax=max(float(np.nanmax(share)), 2.0 / max(E, 1)),
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5))
        ax.set_ylabel(f"layer {layer}\nexpert", fontsize=8)
        ax.set_yticks(range(E))
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, pad=0.02).ax.tick_params(labelsize=7)
    if axes:
        axes[0].set_title(f"{label}: token share per expert over steps", fontsize=9)
        axes[-1].set_xlabel("step", fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _img(png: bytes, alt: str) -> str:
    return (f'<img alt="{html.escape(alt)}" src="data:image/png;base64,'
            f'{base64.b64encode(png).decode()}">')


def _cell(value: float, fmt: str) -> str:
    text = fmt.format(value) if math.isfinite(value) else "n/a"
    return f'<td data-value="{value!r}">{text}</td>'


def build_report(paths: list[str | Path], title: str = "Expert-load report"
                 ) -> tuple[str, dict[str, bytes], dict[str, dict[str, float]]]:
    """The HTML page, its PNGs by name, and each run's summary figures by label."""
    run_dirs = find_runs(paths)
    labels = run_labels(run_dirs)
    runs = {label: read_scalars(d) for label, d in zip(labels, run_dirs, strict=True)}
    summaries = {label: run_summary(s) for label, s in runs.items()}
    layers = sorted({layer for s in runs.values() for layer in moe_layer_ids(s)})

    pngs = {"loss.png": loss_figure(runs)}
    if layers:
        pngs["curves.png"] = curves_figure(runs, layers)
        for i, (label, scalars) in enumerate(runs.items()):
            pngs[f"heatmap_{i}.png"] = heatmap_figure(label, scalars, moe_layer_ids(scalars))

    rows = []
    for label, d in zip(labels, run_dirs, strict=True):
        cells = "".join(_cell(summaries[label][k], fmt) for k, _, fmt in TABLE)
        rows.append(f'<tr data-run="{html.escape(label)}"><th title="{html.escape(str(d))}">'
                    f"{html.escape(label)}</th>{cells}</tr>")
    heads = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in TABLE)
    heatmaps = "".join(
        f'<figure>{_img(pngs[f"heatmap_{i}.png"], f"token share heatmap of {label}")}'
        f"<figcaption>{html.escape(label)}</figcaption></figure>"
        for i, label in enumerate(labels) if f"heatmap_{i}.png" in pngs)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1500px; }}
h1 {{ font-size: 22px; margin-bottom: 4px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
.meta {{ color: #666; font-size: 12px; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
th, td {{ border: 1px solid #ddd; padding: 4px 10px; text-align: right; }}
thead th {{ background: #f3f3f3; }} tbody th {{ text-align: left; }}
img {{ max-width: 100%; }}
.runs {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr));
         gap: 12px; }}
figure {{ margin: 0; }} figcaption {{ text-align: center; font-size: 12px; color: #555; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="meta">{len(run_dirs)} run(s), {len(layers)} MoE layer(s); generated {now}.
Imbalance, drops, entropy and dead experts: mean over MoE layers and the second half of
training; tokens/s: median over steps after the first.</div>
<h2>Summary</h2>
<table id="summary"><thead><tr><th>run</th>{heads}</tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<h2>Loss</h2>{_img(pngs["loss.png"], "loss curves")}
{f'<h2>Load imbalance, drops, router entropy, dead experts per layer</h2>'
 f'{_img(pngs["curves.png"], "per-layer curves")}' if layers else ""}
{f'<h2>Token share per expert over steps</h2><div class="runs">{heatmaps}</div>'
 if layers else ""}
</body></html>
"""
    return page, pngs, summaries


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (with tb/) or sweep dirs")
    parser.add_argument("-o", "--out", default="expert_report.html", help="HTML file to write")
    parser.add_argument("--png-dir", help="also write the PNGs here")
    parser.add_argument("--title", default="Expert-load report")
    args = parser.parse_args(argv)
    page, pngs, summaries = build_report(args.runs, args.title)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    if args.png_dir:
        png_dir = Path(args.png_dir)
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, data in pngs.items():
            (png_dir / name).write_bytes(data)
    print(f"wrote {out} ({len(summaries)} runs, {len(pngs)} plots)")
    return {"html": out, "pngs": pngs, "summaries": summaries}


if __name__ == "__main__":
    main(sys.argv[1:])
