"""The figures of one training run, from its event files and its log: what the docs quote.

    moetrain --config configs/tiny.yaml train.output_dir=RUN log.progress_bar=false > RUN.log 2>&1
    python tools/run_figures.py RUN --log RUN.log -o docs/data/default_run.json
    python tools/run_figures.py --table docs/data/default_run.json  # the table docs/moe.md shows

The JSON holds how the run was made (command, hardware, torch, commit) and its figures: the
eval loss at every evaluation, the unigram entropy, each MoE layer's dropped fraction and
load imbalance (max/mean) at the steps asked for (per-step values, ``moe/layer{L}/*``), the
routing stability of the first evaluation, the median throughput, and the warnings of the log
by kind (first lines and summarised repeats, with their steps). ``render_table`` turns it
into the markdown table docs/moe.md shows; tests/test_docs.py fails when the page's table is
not that.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
STEPS = (10, 20, 100, 250, 500)

_FIRST = re.compile(r"WARNING moe layer \d+: load imbalance max/mean \S+ passed .* at step "
                    r"(?P<step>\d+)$")
_REPEAT = re.compile(r"WARNING moe layer \d+: load imbalance past [^:]*: (?P<n>\d+) more times? "
                     r"\((?P<steps>[^)]*)\)")  # fmt: skip


def _log_warnings(text: str) -> dict[str, Any]:
    """Warnings of a run's log by kind: imbalance first lines (steps), summarised repeats
    (count and the last step), router collapse, one expert per batch, dead experts."""
    first = [int(m["step"]) for line in text.splitlines() if (m := _FIRST.search(line))]
    repeats, last = 0, None
    for line in text.splitlines():
        if m := _REPEAT.search(line):
            repeats += int(m["n"])
            steps = [int(s) for s in re.findall(r"\d+", m["steps"])]
            last = max([last or 0, *steps])
    return {
        "imbalance_first_steps": first,
        "imbalance_repeats": repeats,
        "imbalance_last_step": max([last or 0, *first]) if first else None,
        "router_collapse": text.count("router collapse in moe layer"),
        "one_expert_per_batch": text.count("routes each batch to one expert"),
        "dead_experts": len(re.findall(r"expert \d+ is dead", text)),
    }


def figures(run: Path, log_text: str, steps: tuple[int, ...] = STEPS) -> dict[str, Any]:
    from moetrain.train.metrics import read_scalars

    scalars = read_scalars(run)
    layers = sorted({int(m[1]) for k in scalars if (m := re.match(r"moe/layer(\d+)/", k))})

    def at(tag: str, step: int) -> float:
        return dict(scalars[tag])[step]

    evals = dict(scalars["eval/loss"])
    first_eval = min(evals)
    return {
        "steps": max(s for s, _ in scalars["train/loss"]),
        "eval_loss": {str(s): round(v, 4) for s, v in sorted(evals.items())},
        "unigram_entropy": round(scalars["data/unigram_entropy"][0][1], 3),
        "dropped_fraction": {str(s): round(statistics.fmean(
            at(f"moe/layer{L}/dropped_fraction", s) for L in layers), 4) for s in steps},
        "dropped_fraction_max": max(
            (round(statistics.fmean(dict(scalars[f"moe/layer{L}/dropped_fraction"])[s]
                                    for L in layers), 4), s)
            for s, _ in scalars["train/loss"]),
        "max_over_mean": {str(s): round(max(at(f"moe/layer{L}/max_over_mean", s)
                                            for L in layers), 2) for s in steps},
        "routing_stability": {"from_step": first_eval, "per_layer": [
            round(at(f"moe/layer{L}/routing_stability", first_eval), 3) for L in layers]},
        "median_tokens_per_s": round(statistics.median(
            v for s, v in scalars["perf/tokens_per_s"] if s > 1)),
        "warnings": _log_warnings(log_text),
    }  # fmt: skip


def render_table(data: dict[str, Any]) -> str:
    """The markdown table of a run's figures (docs/moe.md, "The default, 500 steps")."""
    f = data["figures"]
    w = f["warnings"]
    steps = list(f["dropped_fraction"])
    collapse = w["router_collapse"] + w["one_expert_per_batch"]
    imbalance = "none"
    if w["imbalance_first_steps"]:
        imbalance = (f"{len(w['imbalance_first_steps'])} first lines (steps "
                     f"{', '.join(map(str, w['imbalance_first_steps']))}) and "
                     f"{w['imbalance_repeats']} summarised repeats; none after step "
                     f"{w['imbalance_last_step']}")  # fmt: skip
    peak, peak_step = f["dropped_fraction_max"]
    evals = list(f["eval_loss"].items())
    stab = f["routing_stability"]
    rows = [
        ("router-collapse or one-expert-per-batch warnings", "none" if not collapse else
         str(collapse)),
        ("imbalance warnings (per-step max/mean > 3)", imbalance),
        (f"dropped fraction at step {' / '.join(steps)} (mean over the MoE layers)",
         " / ".join(f"{100 * v:.1f}%" for v in f["dropped_fraction"].values())
         + f" (highest {100 * peak:.1f}% at step {peak_step})"),
        ("max/mean at the same steps (worst MoE layer)",
         " / ".join(f"{v:.2f}" for v in f["max_over_mean"].values())),
        (f"eval loss at steps {' / '.join(s for s, _ in evals)}",
         " / ".join(f"{v:.4f}" if i < len(evals) - 1 else f"**{v:.4f}**"
                    for i, (_, v) in enumerate(evals))
         + f" (unigram entropy {f['unigram_entropy']:.3f})"),
        (f"routing stability (top-1 at step {stab['from_step']} = top-1 at step {f['steps']})",
         f"layers 0-{len(stab['per_layer']) - 1}: "
         + ", ".join(f"{100 * v:.1f}%" for v in stab["per_layer"])),
        ("median throughput", f"{f['median_tokens_per_s']:,} tokens/s ({data['hardware']})"),
    ]  # fmt: skip
    return "| | |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="the run's train.output_dir")
    parser.add_argument("--log", help="the run's console output (for its warnings)")
    parser.add_argument("-o", "--out", help="JSON file to write (default: print it)")
    parser.add_argument("--command", default="", help="the command that made the run")
    parser.add_argument("--hardware", help="what it ran on, in words", default=(
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads"))  # fmt: skip
    parser.add_argument("--commit", help="the commit it ran at (default: this checkout's)")
    parser.add_argument("--table", metavar="JSON", help="print the markdown table of a JSON")
    args = parser.parse_args(argv)
    if args.table:
        print(render_table(json.loads(Path(args.table).read_text())), end="")
        return 0
    if not args.run:
        parser.error("a run directory (or --table JSON)")
    commit = args.commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    log_text = Path(args.log).read_text() if args.log else ""
    data = {
        "command": args.command, "hardware": args.hardware, "commit": commit,
        "torch": torch.__version__, "figures": figures(Path(args.run), log_text),
    }  # fmt: skip
    text = json.dumps(data, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
