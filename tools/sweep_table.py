"""A sweep's table as the docs show it: each variant's mean [95% interval] and its difference
from the baseline for a few figures, with the collapse warnings of its runs.

    moetrain ablate configs/sweeps/balancing.yaml > balancing.log 2>&1
    cp outputs/sweeps/balancing/summary.csv docs/data/sweeps/balancing_summary.csv
    python tools/sweep_table.py docs/data/sweeps/balancing_summary.csv --log balancing.log \\
        --warnings-out docs/data/sweeps/balancing_warnings.json --bold aux-0.01+bias-0.01

``--log`` reads the sweep's console output (``sweep: run NAME/seed_S`` starts each run) and
counts, per variant over its seeds, the router-collapse and one-expert-per-batch warnings:
first lines plus summarised repeats, and the steps of the first lines; ``--warnings-out``
keeps them beside the summary, and ``--warnings`` reads them back. tests/test_docs.py
renders the table from the two files and fails when the page's table is not it.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

FIGURES = {
    # figure: (column header, scale, decimals)
    "eval_loss": ("eval loss", 1.0, 3),
    "max_over_mean": ("max/mean", 1.0, 2),
    "dropped_fraction": ("dropped %", 100.0, 1),
    "router_entropy": ("router entropy", 1.0, 3),
}
DEFAULT_FIGURES = ("eval_loss", "max_over_mean", "dropped_fraction")
_RUN = re.compile(r"sweep: run (?P<key>[^ ]+) ")
_FIRST = re.compile(r"WARNING (router collapse in moe layer|moe layer \d+ routes each batch)")
_REPEAT = re.compile(r"WARNING moe layer \d+: (?:router collapse|one expert per batch): "
                     r"(?P<n>\d+) more times?")  # fmt: skip


def collapse_warnings(log_text: str) -> dict[str, dict[str, list[int] | int]]:
    """Per variant (a run key without its ``/seed_S``): its runs' collapse warnings, first
    lines plus summarised repeats (``count``), and the steps of the first lines (``steps``)."""
    found: dict[str, dict[str, list[int] | int]] = {}
    variant = None
    for line in log_text.splitlines():
        if m := _RUN.search(line):
            variant = m["key"].split("/seed_")[0]
            found.setdefault(variant, {"count": 0, "steps": []})
        elif variant is not None:
            if _FIRST.search(line):
                found[variant]["count"] += 1
                found[variant]["steps"].append(int(re.findall(r"step (\d+)\)", line)[-1]))
            elif m := _REPEAT.search(line):
                found[variant]["count"] += int(m["n"])
    return found


def _cell(mean: float, lo: float, hi: float, scale: float, digits: int, sign: bool) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(scale * mean)} [{f.format(scale * lo)}, {f.format(scale * hi)}]"


def render(summary: Path, warnings: dict[str, dict] | None, bold: str | None = None,
           figures: tuple[str, ...] = DEFAULT_FIGURES) -> str:  # fmt: skip
    with open(summary, newline="") as f:
        rows = list(csv.DictReader(f))
    base = next(r["run"] for r in rows if r["baseline"] == "true")
    head = ["variant"]
    for fig in figures:
        head += [FIGURES[fig][0], f"minus {base}"]
    if warnings is not None:
        head.append("collapse warnings")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        name = f"**{r['run']}**" if r["run"] == bold else f"`{r['run']}`"
        cells = [name]
        for fig in figures:
            _, scale, digits = FIGURES[fig]
            cells.append(_cell(*(float(r[f"{fig}_{k}"]) for k in ("mean", "lo", "hi")),
                               scale, digits, sign=False))  # fmt: skip
            if r["run"] == base:
                cells.append("--")
            else:
                diff = _cell(*(float(r[f"{fig}_diff_{k}"]) for k in ("mean", "lo", "hi")),
                             scale, digits, sign=True)  # fmt: skip
                noise = r[f"{fig}_diff_within_noise"] == "true"
                cells.append(diff + (" within noise" if noise else ""))
        if warnings is not None:
            cells.append(str(warnings.get(r["run"], {"count": 0})["count"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="the sweep's summary.csv")
    parser.add_argument("--log", help="the sweep's console output, to count its warnings")
    parser.add_argument("--warnings-out", help="write the warning counts (JSON) here")
    parser.add_argument("--warnings", help="warning counts written by --warnings-out")
    parser.add_argument("--bold", help="the variant to show in bold (the one chosen)")
    parser.add_argument("--figures", nargs="+", choices=list(FIGURES),
                        default=list(DEFAULT_FIGURES),
                        help="the figures to show, in this order")  # fmt: skip
    args = parser.parse_args(argv)
    warnings = None
    if args.log:
        warnings = collapse_warnings(Path(args.log).read_text())
        if args.warnings_out:
            Path(args.warnings_out).write_text(json.dumps(warnings, indent=1) + "\n")
    elif args.warnings:
        warnings = json.loads(Path(args.warnings).read_text())
    print(render(Path(args.summary), warnings, args.bold, tuple(args.figures)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
