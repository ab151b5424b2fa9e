"""The pipeline bubble of every schedule, computed from torch's own action list for it, beside
the analytic figure (tools/pipeline_bubble.py; ``docs/pipeline_bubbles.md`` is written from
what this file computes, ``MOETRAIN_UPDATE_DOCS=1``, and the test fails when it is stale).

The action lists are run on an ideal machine (forward = input gradient = weight gradient
time, free communication). The textbook schedules must land exactly on their formulas:
GPipe and 1F1B (p - 1)/m, interleaved 1F1B and breadth-first (p - 1)/(v m), interleaved
zero-bubble (ZB-H1 per chunk) (p - 1)/(3 v m). ZB-V's published figure is 0 (it leaves out
the warm-up, which no synchronous schedule avoids): its action list must reach the warm-up
bound (p - 1)/(3 v m) -- the last rank's first forward waits for p - 1 chunk forwards --
once it has m >= 2 p - 1 micro-batches. DualPipe-V's must not exceed DualPipe's published
(PP/2 - 1)(F&B + B - 3W) for PP = 2 p stages (it reaches the warm-up bound too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moetrain.parallel.pipeline import (
    analytic_bubble,
    schedule_actions,
    simulate_schedule,
    stage_ids,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "pipeline_bubbles.md"
sys.path.insert(0, str(ROOT / "tools"))
import pipeline_bubble  # noqa: E402

TEXTBOOK = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return pipeline_bubble.bubble_rows([2, 4, 8], None, list(pipeline_bubble.SCHEDULE_ORDER), 2)


def test_textbook_schedules_land_on_their_formulas(rows) -> None:
    checked = 0
    for r in rows:
        if r["schedule"] in TEXTBOOK:
            assert r["actions"] == pytest.approx(r["analytic"], abs=1e-12), r
            checked += 1
    assert checked >= 5 * 9


def test_no_schedule_beats_the_warm_up_and_the_v_schedules_reach_it(rows) -> None:
    for r in rows:
        warm_up = (r["pp"] - 1) / (3 * r["v"] * r["m"])
        assert r["actions"] >= warm_up - 1e-12, r
        if r["schedule"] in ("zbv", "dualpipev") and r["m"] >= 2 * r["pp"] - 1:
            assert r["actions"] == pytest.approx(warm_up, abs=1e-12), r
        if r["schedule"] == "dualpipev":
            assert r["actions"] <= r["analytic"] + 1e-12, r
    # ZB-V with fewer than 2 pp - 1 micro-batches cannot fill its warm-up: worse than that.
    short = [r for r in rows if r["schedule"] == "zbv" and r["m"] < 2 * r["pp"] - 1]
    assert short and all(r["actions"] > (r["pp"] - 1) / (3 * r["v"] * r["m"]) for r in short)


def test_the_zero_bubble_schedules_beat_interleaved_1f1b_at_the_same_shape(rows) -> None:
    by = {(r["schedule"], r["pp"], r["m"]): r["actions"] for r in rows}
    for (name, p, m), bubble in by.items():
        if name in ("zero_bubble", "zbv", "dualpipev") and ("interleaved_1f1b", p, m) in by:
            if m >= 2 * p:
                assert bubble < by[("interleaved_1f1b", p, m)], (name, p, m)


def test_the_simulator_sees_a_dependency_broken_list() -> None:
    """A list that runs a backward before its forward cannot run: the simulator refuses it
    (it is not a clock that merely counts actions)."""
    order = schedule_actions("1f1b", 2, 1, 2)
    last = order[1]
    first_f = next(
        i for i, a in enumerate(last) if a is not None and a.computation_type.value == "F"
    )
    first_b = next(
        i for i, a in enumerate(last) if a is not None and a.computation_type.value == "B"
    )
    last[first_f], last[first_b] = last[first_b], last[first_f]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_schedule(order, 2)


def test_v_placement_puts_two_stages_per_rank_in_a_v() -> None:
    assert [stage_ids(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids(r, 4, 2, "looped_bfs") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="2 stages per rank"):
        stage_ids(0, 4, 3, "dualpipev")
    assert analytic_bubble("1f1b", 4, 1, 8) == 3 / 8


def test_bubble_page_is_current(rows) -> None:
    page = "\n".join(
        [
            "# Pipeline bubbles: the schedules' action lists against the formulas",
            "",
            "Written by `tests/parallel/test_pipeline_bubble.py` (the same table as",
            "`python tools/pipeline_bubble.py`); the test fails when a figure here is not what",
            "it computes. To rewrite it: `MOETRAIN_UPDATE_DOCS=1 python -m pytest",
            "tests/parallel/test_pipeline_bubble.py`.",
            "",
            "Each schedule's compute actions are torch's own (`pipeline_order`, torch 2.13),",
            "run on an ideal machine: every rank in list order, an action waits for its",
            "inputs, forward = input-gradient = weight-gradient time per chunk, communication",
            "free. Bubble = idle time / useful time of a rank, the unit of (p - 1)/m. Analytic:",
            "GPipe, 1F1B (p - 1)/m; interleaved 1F1B, breadth-first (p - 1)/(v m);",
            "interleaved zero-bubble (ZB-H1 per chunk) (p - 1)/(3 v m); ZB-V 0 as published",
            "(the warm-up left out: the action list reaches the warm-up bound (p - 1)/(3 v m)",
            "from m = 2 p - 1); DualPipe-V: DualPipe's (PP/2 - 1)(F&B + B - 3W) with",
            "PP = 2 p stages and F&B = F + B (nothing to overlap on an ideal machine),",
            "= (p - 1)/(3 m); its action list does better, at the warm-up bound.",
            "[parallel.md](parallel.md) says when to choose which.",
            "",
            pipeline_bubble.render(rows),
            "",
        ]
    )
    if os.environ.get("MOETRAIN_UPDATE_DOCS") == "1":
        PAGE.write_text(page)
    current = PAGE.read_text() if PAGE.exists() else ""
    assert current == page, (
        f"{PAGE} does not hold the figures computed now; rewrite it with "
        "MOETRAIN_UPDATE_DOCS=1 python -m pytest tests/parallel/test_pipeline_bubble.py"
    )


def test_unequal_stages_cost_their_own_time_and_the_busiest_sets_the_pace() -> None:
    """``stage_cost`` (uneven stages, ``parallel.pp_stage_layers``): every action costs its
    unit times its stage's cost; equal costs scale the makespan, a heavy stage's rank is the
    busiest and the others wait for it."""

    def run(cost=None):
        return simulate_schedule(schedule_actions("1f1b", 2, 1, 4), 2, cost)

    equal = run()
    assert run([1.0, 1.0]) == equal
    assert run([3.0, 3.0])["makespan"] == 3 * equal["makespan"]
    heavy = run([3.0, 1.0])  # 3 + 1 layers
    # F + B = 3 units a micro-batch, 4 micro-batches, times the stage's cost
    assert heavy["busy_by_rank"] == {0: 36.0, 1: 12.0} and heavy["busy"] == 36.0
    assert heavy["makespan"] >= 36.0
    assert run([2.0, 2.0])["makespan"] < heavy["makespan"]  # 2 + 2 layers: shorter
