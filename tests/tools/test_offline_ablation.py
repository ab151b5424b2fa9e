"""Routing trace and offline ablation on a checkpoint of the sweep: the trace round-trips,
replaying it reproduces the loss exactly, zeroing an expert that gets no tokens changes
nothing, and the reports carry the per-expert and per-layer deltas."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import load_tool
from test_ablate import event_scalars


@pytest.fixture(scope="module")
def run_dir(sweep_dir: Path) -> Path:
    return sweep_dir / "runs" / "top_k=2"


def test_routing_trace_round_trip(run_dir: Path, tmp_path: Path) -> None:
    rt = load_tool("routing_trace")
    path = tmp_path / "trace.pt"
    rt.main([str(run_dir), "-o", str(path)])
    trace = torch.load(path, weights_only=True)  # plain tensors and containers only
    assert trace["format"] == rt.FORMAT and trace["step"] == 3 and trace["layers"] == [0, 1]
    N, B, S = 2, 2, 32  # train.eval_batches micro-batches of micro_batch_size x seq_len
    assert trace["input_ids"].shape == (N, B, S)
    for layer in (0, 1):
        ids = trace["ids"][layer]
        assert ids.shape == (N, B * S, 2) and ids.dtype == torch.int16
        assert 0 <= int(ids.min()) and int(ids.max()) < 4
        assert (ids[..., 0] != ids[..., 1]).all()  # top-2 picks two distinct experts
    # The recorded batches are the trainer's eval batches: same loss as its last evaluation.
    final_eval = event_scalars(run_dir)["eval/loss"][3]
    assert trace["losses"].mean().item() == pytest.approx(final_eval, rel=1e-6)

    cfg, model, _, _ = rt.load_run(run_dir)
    again = rt.record_trace(model, rt.eval_batches(cfg))
    for layer in (0, 1):
        assert torch.equal(again["ids"][layer], trace["ids"][layer])
    assert torch.equal(again["losses"], trace["losses"])


def test_offline_ablation_reports_per_expert_and_per_layer_deltas(run_dir: Path,
                                                                  tmp_path: Path) -> None:
    rt, oa = load_tool("routing_trace"), load_tool("offline_ablation")
    trace_path = tmp_path / "trace.pt"
    trace = rt.main([str(run_dir), "-o", str(trace_path)])
    out = tmp_path / "ablation"
    result = oa.main([str(run_dir), "--trace", str(trace_path), "--out-dir", str(out)])

    assert result["baseline"] == trace["losses"].mean().item()
    rows = {(r["kind"], r["layer"], r["expert"]): r for r in result["rows"]}
    replay = rows[("replay", "all", None)]
    assert replay["delta"] == 0.0 and replay["eval_loss"] == result["baseline"]  # exactly
    zero = [r for r in result["rows"] if r["kind"] == "zero_expert"]
    assert sorted((r["layer"], r["expert"]) for r in zero) == [(l, e) for l in (0, 1)
                                                               for e in range(4)]
    for r in zero:
        assert r["delta"] == pytest.approx(r["eval_loss"] - result["baseline"], abs=0)
        if result["tokens"][r["layer"]][r["expert"]] > 0:
            assert r["delta"] != 0.0  # an expert that computes something matters
    for layer in (0, 1, "all"):
        assert ("top1", layer, None) in rows
    # Token counts are the trace's.
    for layer in (0, 1):
        assert result["tokens"][layer] == torch.bincount(
            trace["ids"][layer].long().flatten(), minlength=4).tolist()
        assert sum(result["tokens"][layer]) == 2 * 2 * 32 * 2

    # The files carry the same numbers.
    with (out / "ablation.csv").open(newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert float(csv_rows[0]["eval_loss"]) == result["baseline"]
    for c, r in zip(csv_rows[1:], result["rows"], strict=True):
        assert (c["kind"], c["layer"]) == (r["kind"], str(r["layer"]))
        assert float(c["delta"]) == r["delta"]
    saved = json.loads((out / "ablation.json").read_text())
    assert saved["baseline"] == result["baseline"] and len(saved["rows"]) == len(result["rows"])
    md = (out / "ablation.md").read_text()
    assert f"{result['baseline']:.5f}" in md and "force top-1" in md
    assert (out / "ablation.png").read_bytes().startswith(b"\x89PNG")


def test_zeroing_an_expert_that_gets_no_tokens_changes_nothing(run_dir: Path) -> None:
    rt, oa = load_tool("routing_trace"), load_tool("offline_ablation")
    cfg, model, _, _ = rt.load_run(run_dir)
    # Expert 2 of layer 0 is never selected: its selection bias (used since
    # moe.expert_bias_rate > 0) is far below any score.
    model.moe_layers()[0].router.expert_bias[2] = -100.0
    result = oa.ablate(model, rt.eval_batches(cfg))
    assert result["tokens"][0][2] == 0 and result["tokens"][0][3] > 0
    rows = {(r["kind"], r["layer"], r["expert"]): r for r in result["rows"]}
    assert rows[("zero_expert", 0, 2)]["eval_loss"] == result["baseline"]  # bit for bit
    assert rows[("zero_expert", 0, 3)]["delta"] != 0.0
    assert rows[("replay", "all", None)]["eval_loss"] == result["baseline"]


def test_replay_refuses_a_trace_of_other_batches(run_dir: Path) -> None:
    rt, oa = load_tool("routing_trace"), load_tool("offline_ablation")
    cfg, model, _, _ = rt.load_run(run_dir)
    batches = rt.eval_batches(cfg)
    trace = rt.record_trace(model, batches[:1])
    with pytest.raises(ValueError, match="other eval batches"):
        oa.ablate(model, batches, trace)
