"""Accounting against the analytic figures (ANCHORS.md): model-state bytes per rank within
5% of the ZeRO formula, bytes sent within 2% of the analytic volume for DDP, ZeRO-1/2/3,
TP+SP and PP. Each layout takes one warm-up step (Adam states exist), then one measured
step; one micro-batch per data-parallel rank, as the formulas assume."""

from __future__ import annotations

import tempfile

import pytest
from multirank import micro_config, run_ranks

MEMORY_TOL = 0.05
BYTES_TOL = 0.02


def _measure_worker(rank: int, world_size: int, layouts: list[list[str]]) -> list[dict]:
    from moetrain.parallel.accounting import (
        analytic_sent,
        layer_counts,
        measure_step,
        zero_bytes_per_param,
    )
    from moetrain.train.trainer import Trainer

    out = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(micro_config(tmp, "train.steps=2", *overrides))
            trainer.train_step()
            report = measure_step(trainer)
            d, engine = trainer.dims, trainer.engine
            zero = trainer.cfg.parallel.zero_stage if d.dp > 1 else 0
            out.append(
                {
                    "memory": report.peak.total,
                    "formula": zero_bytes_per_param(zero, d.dp_shard) * report.params_per_rank,
                    "sent": report.sent,
                    "analytic": analytic_sent(
                        trainer.cfg, d, report.params_per_rank, layer_counts(engine.parts)
                    ),
                }
            )
            trainer.close()
    return out


def _ratio(a: float, b: float) -> float:
    return a / b


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_zero_memory_and_dp_bytes_match_the_formulas() -> None:
    layouts = [[f"parallel.zero_stage={z}", "train.global_batch_size=4"] for z in range(4)]
    results = run_ranks(_measure_worker, 2, layouts, timeout=280)
    lines = []
    for z, res in enumerate(results[0]):
        mem = _ratio(res["memory"], res["formula"])
        sent = sum(res["sent"].values())
        bytes_ratio = _ratio(sent, res["analytic"]["dp"])
        lines.append(
            f"zero {z}: memory / formula {mem:.4f}, bytes sent / analytic "
            f"{bytes_ratio:.4f} ({res['sent']})"
        )
        assert abs(mem - 1) <= MEMORY_TOL, lines[-1]
        assert abs(bytes_ratio - 1) <= BYTES_TOL, lines[-1]
    print("\n".join(lines))


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_tp_sp_and_pp_bytes_match_the_formulas() -> None:
    tp = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "moe.num_experts=0",
        "train.global_batch_size=2",
    ]
    pp = ["parallel.pp=2", "parallel.pp_schedule=1f1b"]
    results = run_ranks(_measure_worker, 2, [tp, pp], timeout=280)
    tp_res = results[0][0]
    tp_sent = tp_res["sent"].get("all_gather", 0) + tp_res["sent"].get("reduce_scatter", 0)
    tp_ratio = tp_sent / tp_res["analytic"]["tp"]
    pp_sent = sum(r[1]["sent"].get("send", 0) for r in results)
    pp_ratio = pp_sent / results[0][1]["analytic"]["pp_all_ranks"]
    print(
        f"TP+SP: all-gather + reduce-scatter / analytic {tp_ratio:.4f} ({tp_res['sent']}); "
        f"PP: sends over ranks / analytic {pp_ratio:.4f}"
    )
    assert abs(tp_ratio - 1) <= BYTES_TOL, (tp_ratio, tp_res)
    assert abs(pp_ratio - 1) <= BYTES_TOL, (pp_ratio, results[0][1], results[1][1])
