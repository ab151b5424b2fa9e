"""Expert-load report: one self-contained HTML page from the event files of one or more runs.

    python tools/expert_report.py outputs/tiny -o report.html
    python tools/expert_report.py outputs/sweeps/router -o router.html   # every run of a sweep
    python tools/expert_report.py runA runB --png-dir plots/              # also keep the PNGs

A run is a directory with a ``tb/`` folder (``train.output_dir``); a sweep directory stands
for its ``runs/*`` (``runs/*/seed_*`` for a multi-seed sweep). The page holds:

- for a ``moetrain ablate`` sweep with seeds: each variant's mean and 95% interval per
  figure (bars with error bars, each seed a dot) and its difference from the baseline with
  that difference's interval, "within noise" where it spans zero (the sweep's
  ``summary.csv``);
- a summary table (the figures of ``moetrain.train.metrics.run_summary``), loss curves,
  per-layer imbalance, drop, entropy, dead-expert and received-rows curves (the rows the
  busiest rank's experts received in one forward over the mean: expert parallelism's
  imbalance and the receive buffer it costs) with the runs overlaid, and per
  run and layer a heatmap of each expert's token share over the steps;
- expert specialization (``moetrain.train.specialization``, from the eval routing the
  trainer saved at each evaluation): per run its last evaluation's share of each data
  domain per expert and expert co-activation (images), the tokens each expert receives
  most often (tables, decoded with the run's tokenizer), and routing stability per layer
  over the evaluations.

Plots are PNGs embedded as base64 data URIs: the file can be mailed or attached as it is.
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

from moetrain.ablation.report import (
    CONFIDENCE,
    DIFF_FMTS,
    FIGURES,
    FMTS,
    HEADS,
    draw_bars,
    draw_differences,
)
from moetrain.ablation.stats import Interval
from moetrain.config import load_config
from moetrain.data import load_tokenizer
from moetrain.train.metrics import moe_layer_ids, read_scalars, run_summary
from moetrain.train.specialization import (
    load_eval_routing,
    render_specialization,
    stability_over_steps,
    token_label,
    trace_specialization,
)

Scalars = dict[str, list[tuple[int, float]]]

TABLE = (  # key, heading, format
    ("eval_loss", "final eval loss", "{:.4f}"),
    ("train_loss", "final train loss", "{:.4f}"),
    ("max_over_mean", "load max/mean", "{:.3f}"),
    ("cv", "load CV", "{:.3f}"),
    ("dropped_fraction", "dropped", "{:.3%}"),
    ("router_entropy", "router entropy", "{:.3f}"),
    ("dead_experts", "dead experts", "{:.2f}"),
    ("peak_max_over_mean", "peak max/mean", "{:.3f}"),
    ("peak_dropped_fraction", "peak dropped", "{:.2%}"),
    ("peak_recv_rows_max_over_mean", "peak rows received max/mean", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("steps", "steps", "{:.0f}"),
)
CURVES = (("max_over_mean", "load max/mean"), ("cv", "load CV"),
          ("dropped_fraction", "dropped fraction"), ("router_entropy", "router entropy"),
          ("dead_experts", "dead experts"),
          ("recv_rows_max_over_mean", "rows received per rank max/mean"))


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories (with a tb/ folder) named by ``paths``: runs, sweeps or parents."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "tb").is_dir():
            found = [p]
        else:
            found = sorted(d.parent for d in p.glob("runs/*/tb") if d.is_dir())
            found += sorted(d.parent for d in p.glob("runs/*/seed_*/tb") if d.is_dir())
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
            order = [row.get("run", "") + (f"/seed_{row['seed']}" if row.get("seed") else "")
                     for row in csv.DictReader(f)]

    def key(run: Path) -> tuple[int, str]:
        name = run.name if not run.name.startswith("seed_") else f"{run.parent.name}/{run.name}"
        return (order.index(name) if name in order else len(order), name)

    return key


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
    return f'<td data-value="{float(value)!r}">{text}</td>'


# ----------------------------------------------------------------------------- a sweep's seeds

SWEEP_PANELS = (("eval_loss", "final eval loss"), ("max_over_mean", "load max/mean"),
                ("dropped_fraction", "dropped fraction"), ("router_entropy", "router entropy"))


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _interval(row: dict[str, str], prefix: str) -> Interval:
    get = lambda k: float(row.get(f"{prefix}_{k}") or "nan")  # noqa: E731
    return Interval(int(row.get("n") or 0), get("mean"), get("std"), get("lo"), get("hi"),
                    row.get(f"{prefix}_kind", ""))


def sweep_section(sweep_dir: Path, index: int) -> tuple[str, dict[str, bytes]]:
    """A multi-seed sweep (its ``summary.csv``): bars of each variant's mean with its
    interval and each seed's value, the differences from the baseline with theirs, and the
    same as tables. Empty for a sweep without seeds."""
    summary = _read_csv(sweep_dir / "summary.csv")
    if not summary or all(r["n"] in ("", "0", "1") for r in summary):
        return "", {}
    per_seed: dict[str, list[dict[str, str]]] = {}
    for row in _read_csv(sweep_dir / "results.csv"):
        per_seed.setdefault(row["run"], []).append(row)
    names = [r["run"] for r in summary]
    baseline = next((r["run"] for r in summary if r.get("baseline") == "true"), names[0])
    fig = Figure(figsize=(12, 3.4 + 0.1 * max(len(n) for n in names)), dpi=100)
    for i, (key, title) in enumerate(SWEEP_PANELS):
        ax = fig.add_subplot(1, len(SWEEP_PANELS), i + 1)
        draw_bars(ax, [_interval(r, key) for r in summary],
                  [[float(x[key]) for x in per_seed.get(n, [])] for n in names], names)
        ax.set_title(f"{title}: mean, {CONFIDENCE:.0%} CI", fontsize=9)
    fig.tight_layout()
    pngs = {f"sweep_{index}.png": _png_plain(fig)}
    others = [r for r in summary if r["run"] != baseline]
    if others:
        fig = Figure(figsize=(12, 3.4 + 0.1 * max(len(n) for n in names)), dpi=100)
        for i, (key, title) in enumerate(SWEEP_PANELS):
            ax = fig.add_subplot(1, len(SWEEP_PANELS), i + 1)
            draw_differences(ax, [_interval(r, f"{key}_diff") for r in others],
                             [r["run"] for r in others])
            ax.set_title(f"{title}: minus baseline", fontsize=9)
        fig.tight_layout()
        pngs[f"sweep_{index}_diff.png"] = _png_plain(fig)

    def fmt(key: str, iv: Interval, diff: bool = False) -> str:
        f = (DIFF_FMTS if diff else FMTS)[key]
        if not math.isfinite(iv.mean):
            return "<td>n/a</td>"
        text = f.format(iv.mean)
        if math.isfinite(iv.lo):
            text += f" [{f.format(iv.lo)}, {f.format(iv.hi)}]"
        noise = diff and iv.within_noise
        return (f'<td data-mean="{iv.mean!r}" data-lo="{iv.lo!r}" data-hi="{iv.hi!r}">'
                f'{html.escape(text)}{" <em>within noise</em>" if noise else ""}</td>')

    heads = "".join(f"<th>{html.escape(HEADS[k])}</th>" for k in FIGURES)
    rows = "".join(f'<tr data-variant="{html.escape(r["run"])}"><th>{html.escape(r["run"])}'
                   f'</th><td>{r["n"]}</td>{"".join(fmt(k, _interval(r, k)) for k in FIGURES)}'
                   "</tr>" for r in summary)
    diffs = "".join(f'<tr data-variant="{html.escape(r["run"])}"><th>{html.escape(r["run"])}'
                    f'</th>{"".join(fmt(k, _interval(r, f"{k}_diff"), True) for k in FIGURES)}'
                    "</tr>" for r in others)
    kinds = {r.get(f"{k}_diff_kind") for r in others for k in FIGURES} - {None, ""}
    how = "paired by seed" if kinds == {"paired"} else "paired by seed where possible, else Welch"
    imgs = "".join(_img(png, name) for name, png in pngs.items())
    page = (f'<h2>Sweep {html.escape(sweep_dir.name)}: {len(summary)} variants over seeds</h2>'
            f'<p class="meta">Mean [{CONFIDENCE:.0%} t interval] over each variant\'s seeds; '
            f"differences from the baseline <b>{html.escape(baseline)}</b> {how}, "
            '"within noise" where the interval spans zero.</p>'
            f'<table class="sweep"><thead><tr><th>variant</th><th>seeds</th>{heads}</tr>'
            f"</thead><tbody>{rows}</tbody></table>"
            f'<table class="sweep-diff"><thead><tr><th>minus {html.escape(baseline)}</th>'
            f"{heads}</tr></thead><tbody>{diffs}</tbody></table>{imgs}")
    return page, pngs


# ----------------------------------------------------------------------------- specialization


def _png_plain(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _png_array(image: np.ndarray) -> bytes:
    from matplotlib.image import imsave

    buf = io.BytesIO()
    imsave(buf, image, format="png")
    return buf.getvalue()


def stability_figure(label: str, stab: dict[int, dict[int, float]]) -> bytes:
    fig = Figure(figsize=(5.2, 3.0), dpi=100)
    ax = fig.add_subplot()
    steps = sorted(stab)
    for j, layer in enumerate(sorted(stab[steps[-1]])):
        ax.plot(steps, [stab[s][layer] for s in steps], marker=".", color=f"C{j % 10}",
                label=f"layer {layer}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("step of the evaluation")
    ax.set_ylabel("top-1 = final top-1")
    ax.set_title(f"{label}: routing stability", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def specialization_section(label: str, run_dir: Path, index: int, top_n: int = 8
                           ) -> tuple[str, dict[str, bytes]]:
    """A run's last saved eval routing: domain shares and co-activation (image), the top
    tokens per expert (tables), and routing stability over the evaluations."""
    records = load_eval_routing(run_dir)
    if not records:
        return "", {}
    step = max(records)
    last = records[step]
    specs = trace_specialization(last, top_n)
    names = list(last.get("domain_names") or [])
    data = load_config(run_dir / "config.yaml").data
    decode = load_tokenizer(data.tokenizer, data.cache_dir).decode
    pngs = {f"specialization_{index}.png": _png_array(
        render_specialization(specs, names, f"{label}: eval routing at step {step}"))}
    stab = stability_over_steps(records)
    if len(stab) > 1:
        pngs[f"stability_{index}.png"] = stability_figure(label, stab)
    tables = []
    for layer, spec in specs.items():
        shares = spec.domain_shares()
        heads = "".join(f"<th>share of {html.escape(d)}</th>" for d in names)
        rows = []
        for e, top in enumerate(spec.top_tokens):
            cells = f"<td>{int(spec.assignments_E[e])}</td>"
            if shares is not None:
                cells += "".join(_cell(float(shares[e, d]), "{:.3f}") for d in range(len(names)))
            toks = ", ".join(f"<code>{html.escape(token_label(decode, t))}</code>&nbsp;{n}"
                             for t, n in top)
            rows.append(f'<tr data-expert="{e}"><th>{e}</th>{cells}'
                        f'<td class="tokens" style="text-align:left">{toks}</td></tr>')
        tables.append(f'<table class="spec" data-run="{html.escape(label)}" '
                      f'data-layer="{layer}"><caption>layer {layer}</caption><thead><tr>'
                      f"<th>expert</th><th>tokens</th>{heads}<th>most frequent tokens</th>"
                      f'</tr></thead><tbody>{"".join(rows)}</tbody></table>')
    imgs = "".join(_img(png, f"{name} of {label}") for name, png in pngs.items())
    experts = last["num_experts"]
    page = (f'<h3>{html.escape(label)}</h3><p class="meta">{last["input_ids"].numel()} eval '
            f"tokens at step {step}; uniform share 1/{experts}.</p>{imgs}"
            f'<details><summary>tokens per expert</summary>{"".join(tables)}</details>')
    return page, pngs


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

    sweeps, spec_pages = [], []
    for i, p in enumerate(Path(p) for p in paths):
        if (p / "summary.csv").is_file() and (p / "results.csv").is_file():
            page, more = sweep_section(p, i)
            sweeps.append(page)
            pngs.update(more)
    for i, (label, d) in enumerate(zip(labels, run_dirs, strict=True)):
        page, more = specialization_section(label, d, i)
        spec_pages.append(page)
        pngs.update(more)

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
{"".join(sweeps)}
<h2>Summary</h2>
<table id="summary"><thead><tr><th>run</th>{heads}</tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<h2>Loss</h2>{_img(pngs["loss.png"], "loss curves")}
{f'<h2>Load imbalance, drops, router entropy, dead experts per layer</h2>'
 f'{_img(pngs["curves.png"], "per-layer curves")}' if layers else ""}
{f'<h2>Token share per expert over steps</h2><div class="runs">{heatmaps}</div>'
 if layers else ""}
{'<h2>Expert specialization and routing stability (eval tokens)</h2>' + "".join(spec_pages)
 if any(spec_pages) else ""}
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
