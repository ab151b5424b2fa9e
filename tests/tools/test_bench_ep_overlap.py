"""tools/bench_ep_overlap.py: what it counts and what it compares with the plan.

The benchmark's figures live in docs/data/ep_overlap.json and docs/expert_parallel.md (no
timing is asserted here); this checks the tool's parts on a short real run: the wire's
delays, the transfers each schedule makes, the phases the plan's model takes and that the
prediction it prints is the plan's own function of them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    """The tool as a module its spawned ranks can import too (they inherit sys.path)."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    return importlib.import_module("bench_ep_overlap")


def test_a_wire_delays_by_latency_or_by_bytes() -> None:
    tool = _tool()
    assert tool.WireSpec(latency=0.005).delay(10**9) == 0.005
    assert tool.WireSpec(mbps=500).delay(5 * 10**6) == pytest.approx(0.01)
    assert tool.WireSpec().delay(10**9) == 0.0
    assert [w.label for w in (tool.WireSpec(), tool.WireSpec(latency=0.002),
                              tool.WireSpec(mbps=250))] == ["no delay", "2 ms", "250 MB/s"]


def test_the_prediction_is_the_plans_model() -> None:
    """Without the schedule: 4 exposed transfers per MoE block and micro-batch; with it, the
    plan's timeline (``halves_exposed``) of the measured phases."""
    from moetrain.plan.estimate import HalfPhases, halves_exposed

    tool = _tool()
    phases = {"attention": 0.006, "experts": 0.005, "combine": 0.002}
    assert tool.predicted(0.01, "plain", 4, phases) == pytest.approx(0.16)
    assert tool.predicted(0.01, "halves", 4, phases) == pytest.approx(
        4 * halves_exposed(0.01, HalfPhases(**phases)))


def test_a_short_run_counts_transfers_phases_and_waits() -> None:
    """ep=2, one step per case: every MoE block of tiny (4, one micro-batch a rank) makes 5
    all-to-alls a micro-batch without the schedule (the counts beside the rows, the outputs,
    the two gradients) and twice that with it; each row transfer took the wire's delay; the
    halves' phases were measured; a rank waited at least the delay of its last combine."""
    tool = _tool()
    wires = [tool.WireSpec(), tool.WireSpec(latency=0.004), tool.WireSpec(mbps=500)]
    rows = tool.measure(2, wires, 1, [])
    assert [r["wire"] for r in rows] == ["no delay", "4 ms", "500 MB/s"]
    for r in rows:
        assert r["transfers_plain"] == 20 and r["transfers_halves"] == 40
        assert set(r["phases"]) == {"attention", "experts", "combine"}
        assert all(v > 0 for v in r["phases"].values())
    latency, bandwidth = rows[1], rows[2]
    assert latency["transfer_plain_s"] == latency["transfer_halves_s"] == pytest.approx(0.004)
    # a half's rows are half the bytes: half the time on a bandwidth wire
    assert bandwidth["transfer_halves_s"] == pytest.approx(bandwidth["transfer_plain_s"] / 2,
                                                           rel=0.05)  # fmt: skip
    assert latency["exposed_plain_s"] >= 0.004
    assert latency["predicted_plain_s"] == pytest.approx(16 * 0.004)
