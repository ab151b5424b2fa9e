"""The pipeline bubble of each schedule, from the schedule's own action list, beside the
analytic figure.

    python tools/pipeline_bubble.py                         # pp 2, 4, 8 x m = pp, 2 pp, 4 pp
    python tools/pipeline_bubble.py --pp 4 --microbatches 8 16 --schedules zbv dualpipev

For each schedule torch's class lays out its compute actions (``pipeline_order``: which
stage runs which forward / backward / weight-gradient of which micro-batch, per rank;
built without processes by ``moetrain.parallel.pipeline.schedule_actions``); the actions are
then run on an ideal machine (``simulate_schedule``: each rank in list order, an action
waits for its inputs, forward = input-gradient = weight-gradient time, free communication)
and the bubble is the idle time over the useful time of a rank. The analytic figure
(``analytic_bubble``) is the published one in the same units. Interleaved and breadth-first
schedules use ``--virtual-stages`` chunks per rank (default 2); ZB-V and DualPipe-V always 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULE_ORDER = (
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"
)  # fmt: skip


def bubble_rows(
    pps: list[int], microbatches: list[int] | None, schedules: list[str], virtual_stages: int
) -> list[dict]:
    """One row per (schedule, pp, m): the action-list bubble and the analytic one."""
    from moetrain.config import V_SCHEDULES
    from moetrain.parallel.pipeline import (
        SINGLE_STAGE,
        analytic_bubble,
        schedule_actions,
        simulate_schedule,
    )

    rows = []
    for name in schedules:
        v = 1 if name in SINGLE_STAGE else (2 if name in V_SCHEDULES else virtual_stages)
        for p in pps:
            for m in microbatches or (p, 2 * p, 4 * p):
                if name == "dualpipev" and m < 2 * p:
                    continue  # DualPipe-V needs at least as many micro-batches as stages
                if name in ("interleaved_1f1b", "zero_bubble") and m % p:
                    continue
                sim = simulate_schedule(schedule_actions(name, p, v, m), p * v)
                rows.append(
                    {
                        "schedule": name,
                        "pp": p,
                        "v": v,
                        "m": m,
                        "actions": sim["bubble"],
                        "analytic": analytic_bubble(name, p, v, m),
                    }
                )
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| schedule | pp | chunks per rank | micro-batches | bubble from the action list | "
        "analytic |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['schedule']} | {r['pp']} | {r['v']} | {r['m']} | {r['actions']:.4f} | "
        f"{r['analytic']:.4f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=None,
        help="micro-batches per pass (default: pp, 2 pp, 4 pp)",
    )
    parser.add_argument(
        "--schedules", nargs="+", default=list(SCHEDULE_ORDER), choices=SCHEDULE_ORDER
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="chunks per rank of interleaved_1f1b, looped_bfs, zero_bubble",
    )
    args = parser.parse_args(argv)
    print(render(bubble_rows(args.pp, args.microbatches, args.schedules, args.virtual_stages)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
