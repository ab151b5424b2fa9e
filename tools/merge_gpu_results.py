"""Merge the GPU suite's results.csv into docs/data/benchmarks.csv, then regenerate the page.

    python tools/merge_gpu_results.py RESULTS.csv [MORE.csv ...] [--commit HASH]
                                      [--csv docs/data/benchmarks.csv] [--include-cpu] [--no-report]

RESULTS.csv is what tools/gpu_suite.sh wrote under $OUT (it may sit in a read-only folder:
it is only read). Rows are validated against the schema (tools/bench_common.CSV_FIELDS; an
older file's missing columns stay blank), CPU rows are dropped unless --include-cpu (dry
runs are not figures), a commit the suite could not know ("unknown": a copy of the tree
without .git) is filled from --commit, and rows are deduplicated by their identity
(bench_common.ROW_KEY: run timestamp, device, benchmark, case, routing, dtype, op, impl),
a merged row replacing an older one with the same key. Merging the same file twice leaves
docs/data/benchmarks.csv byte for byte unchanged. Then tools/bench_report.py regenerates
docs/benchmarks.md and docs/img/benchmarks.png (unless --no-report).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import bench_report  # noqa: E402


def key(row: dict) -> tuple[str, ...]:
    return tuple(row[k] for k in bc.ROW_KEY)


def merge(existing: list[dict], new: list[dict]) -> tuple[list[dict], int, int]:
    """existing + new, a new row replacing an existing one with the same key in place.
    Returns (rows, added, replaced)."""
    index = {key(r): i for i, r in enumerate(existing)}
    rows = list(existing)
    added = replaced = 0
    for r in new:
        k = key(r)
        if k in index:
            if rows[index[k]] != r:
                replaced += 1
            rows[index[k]] = r
        else:
            index[k] = len(rows)
            rows.append(r)
            added += 1
    return rows, added, replaced


def write_csv(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bc.CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.csv files from the GPU suite")
    parser.add_argument("--csv", default=bc.DEFAULT_CSV, help="the repository's results file")
    parser.add_argument("--commit", default=None, help="fills the rows whose commit is unknown")
    parser.add_argument("--include-cpu", action="store_true", help="keep CPU (dry-run) rows")
    parser.add_argument("--no-report", action="store_true", help="do not regenerate the page")
    parser.add_argument("--md", default=os.path.join(bc.REPO, "docs", "benchmarks.md"))
    parser.add_argument("--png", default=os.path.join(bc.REPO, "docs", "img", "benchmarks.png"))
    args = parser.parse_args(argv)

    new: list[dict] = []
    skipped_cpu = unknown = 0
    for path in args.results:
        for r in bc.read_rows(path):  # raises on a file that is not a results CSV
            if bench_report.is_cpu(r) and not args.include_cpu:
                skipped_cpu += 1
                continue
            if r["commit"] in ("", "unknown"):
                if args.commit:
                    r["commit"] = args.commit
                else:
                    unknown += 1
            new.append(r)
    rows, added, replaced = merge(bc.read_rows(args.csv), new)
    write_csv(args.csv, rows)
    hint = "" if args.include_cpu else " (--include-cpu keeps them)"
    print(f"{args.csv}: {added} rows added, {replaced} replaced, {len(rows)} in all; "
          f"{skipped_cpu} CPU rows left out{hint}")  # fmt: skip
    if unknown:
        print(f"WARNING: {unknown} rows have no commit: pass --commit <hash of the run's tree>")
    if not args.no_report:
        png = args.png
        bench_report.main(["--csv", args.csv, "--md", args.md, "--png", png]
                          + (["--include-cpu"] if args.include_cpu else []))  # fmt: skip
    return {"added": added, "replaced": replaced, "total": len(rows), "cpu_skipped": skipped_cpu}


if __name__ == "__main__":
    main()
