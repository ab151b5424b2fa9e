"""Offline router ablation on a checkpoint: how much each expert and each layer's routing
matter to the eval loss.

    python tools/offline_ablation.py outputs/tiny --out-dir ablation/
    python tools/offline_ablation.py outputs/tiny --trace trace_100.pt   # replay another routing

On the run's eval batches (fp32, as ``tools/routing_trace.py``), against the unablated loss:

- ``zero_expert``: one expert of one layer outputs zero (its combine weight is 0; its tokens
  keep their capacity slots, so no other expert sees a different token);
- ``top1``: one layer (or ``layer = all``: every layer) keeps only each token's first choice;
- ``replay``: every layer routes by a recorded trace instead of its router. Without
  ``--trace`` the baseline's own routing is replayed: a self-check that must give delta 0.

Writes ``ablation.json`` (everything), ``ablation.csv`` (kind, layer, expert, tokens,
eval_loss, delta), ``ablation.md`` and ``ablation.png`` (the layer x expert delta heatmap
and the top-1 deltas). Routing changes go through the eval-only
``Router.routing_override``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_trace import (  # noqa: E402
    eval_batches,
    evaluate,
    load_run,
    load_trace,
    record_trace,
)

from moetrain.model import Transformer  # noqa: E402
from moetrain.model.moe import RoutingOverride  # noqa: E402


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def ablate(model: Transformer, batches: list[dict[str, torch.Tensor]],
           trace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every ablation; return the baseline, per-row results and each expert's token count.

    Rows: {"kind", "layer", "expert", "eval_loss", "delta"} (layer "all" for whole-model
    rows, expert None where it does not apply)."""
    if trace is not None and (
        trace["layers"] != sorted(model.moe_layers())
        or not torch.equal(trace["input_ids"], torch.stack([b["input_ids"] for b in batches]))
    ):
        raise ValueError("the trace was recorded on other eval batches or another model "
                         "(layers or input_ids differ); record it with the same run config "
                         "and --batches")
    base_trace = record_trace(model, batches)
    baseline = float(base_trace["losses"].mean())
    layers = base_trace["layers"]
    E = base_trace["num_experts"]
    tokens = {layer: torch.bincount(base_trace["ids"][layer].long().flatten(),
                                    minlength=E).tolist() for layer in layers}
    rows: list[dict[str, Any]] = []

    def add(kind: str, layer: int | str, expert: int | None, override) -> None:
        loss = _mean(evaluate(model, batches, override))
        rows.append({"kind": kind, "layer": layer, "expert": expert, "eval_loss": loss,
                     "delta": loss - baseline})

    for layer in layers:
        for e in range(E):
            ov = RoutingOverride(zero_experts=(e,))
            add("zero_expert", layer, e,
                lambda i, b, ov=ov, layer=layer: ov if i == layer else None)
    top1 = RoutingOverride(top1=True)
    for layer in layers:
        add("top1", layer, None, lambda i, b, layer=layer: top1 if i == layer else None)
    add("top1", "all", None, lambda i, b: top1)

    replay = trace if trace is not None else base_trace
    add("replay", "all", None,
        lambda i, b: RoutingOverride(replay_ids_TK=replay["ids"][i][b].long()))
    return {"baseline": baseline, "layers": layers, "num_experts": E, "tokens": tokens,
            "rows": rows, "replayed": str(replay.get("checkpoint", "")) if trace else "self"}


def delta_matrix(result: dict[str, Any]) -> np.ndarray:
    layers = result["layers"]
    out = np.zeros((len(layers), result["num_experts"]))
    for r in result["rows"]:
        if r["kind"] == "zero_expert":
            out[layers.index(r["layer"]), r["expert"]] = r["delta"]
    return out


def write_outputs(result: dict[str, Any], out_dir: Path, title: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ablation.json").write_text(json.dumps(result, indent=1))
    with (out_dir / "ablation.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "layer", "expert", "tokens", "eval_loss", "delta"])
        w.writerow(["baseline", "all", "", "", repr(result["baseline"]), "0.0"])
        for r in result["rows"]:
            n = result["tokens"][r["layer"]][r["expert"]] if r["expert"] is not None else ""
            w.writerow([r["kind"], r["layer"], "" if r["expert"] is None else r["expert"], n,
                        repr(r["eval_loss"]), repr(r["delta"])])

    layers, E = result["layers"], result["num_experts"]
    D = delta_matrix(result)
    lines = [f"# Offline ablation: {title}", "",
             f"Baseline eval loss {result['baseline']:.5f} nats/token. Delta = ablated - "
             "baseline (positive: the ablation hurts).", "",
             "## Zeroing one expert (delta; tokens routed to it in brackets)", "",
             "| layer | " + " | ".join(f"expert {e}" for e in range(E)) + " |",
             "|---|" + "---:|" * E]
    for i, layer in enumerate(layers):
        lines.append(f"| {layer} | " + " | ".join(
            f"{D[i, e]:+.5f} ({result['tokens'][layer][e]})" for e in range(E)) + " |")
    lines += ["", "## Routing", "", "| ablation | layer | eval loss | delta |",
              "|---|---|---:|---:|"]
    for r in result["rows"]:
        if r["kind"] != "zero_expert":
            what = "force top-1" if r["kind"] == "top1" else f"replay ({result['replayed']})"
            lines.append(f"| {what} | {r['layer']} | {r['eval_loss']:.5f} | {r['delta']:+.5f} |")
    (out_dir / "ablation.md").write_text("\n".join(lines) + "\n")

    fig = Figure(figsize=(11, 0.5 * len(layers) + 2.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    lim = max(float(np.abs(D).max()), 1e-9)
    im = ax.imshow(D, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(E))
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("expert zeroed")
    ax.set_ylabel("MoE layer")
    ax.set_title("eval-loss delta, one expert zeroed", fontsize=9)
    fig.colorbar(im, ax=ax)
    ax = fig.add_subplot(1, 2, 2)
    other = [r for r in result["rows"] if r["kind"] != "zero_expert"]
    ax.barh(range(len(other)), [r["delta"] for r in other], color="C1")
    ax.set_yticks(range(len(other)), [f"{r['kind']} layer {r['layer']}" for r in other],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_title("eval-loss delta, routing ablations", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "ablation.png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run directory (train.output_dir)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    parser.add_argument("--batches", type=int, help="eval micro-batches (default: "
                        "train.eval_batches)")
    parser.add_argument("--trace", help="routing trace to replay (tools/routing_trace.py)")
    parser.add_argument("--out-dir", default="offline_ablation")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    cfg, model, path, step = load_run(args.run, args.checkpoint, args.device)
    trace = load_trace(args.trace) if args.trace else None
    result = ablate(model, eval_batches(cfg, args.batches), trace)
    result.update(checkpoint=str(path), step=step)
    write_outputs(result, Path(args.out_dir), f"{path} (step {step})")
    print((Path(args.out_dir) / "ablation.md").read_text(), end="")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
