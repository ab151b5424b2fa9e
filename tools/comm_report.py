"""Memory and communication of one training step under a layout, beside the analytic figures.

    python tools/comm_report.py --nproc 4 --config configs/tiny.yaml parallel.zero_stage=3 \
        train.micro_batch_size=4 moe.token_group_seqs=4
    torchrun --nproc-per-node 8 tools/comm_report.py --config configs/tiny_3d.yaml

``--nproc N`` spawns N CPU processes itself (gloo); under torchrun it uses the launch. The
config and its layout are checked for that world size before any process starts. Each rank
takes one warm-up step, then one measured step (``moetrain.parallel.accounting``); rank 0
prints, per rank: model-state bytes and their ratio to the ZeRO formula, bytes sent per
collective kind, and the analytic volume of each axis (``docs/parallel.md``) with its ratio.
The data-parallel formulas assume one micro-batch per rank (FSDP gathers per micro-batch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# What every measured run sets: two steps (a warm-up, then the measured one), no output.
FIXED_OVERRIDES = [
    "train.steps=2",
    "log.tensorboard=false",
    "log.progress_bar=false",
    "train.eval_every=0",
    "train.checkpoint_every=0",
]


def _measure(cfg_path: str | None, overrides: list[str]) -> dict:
    import torch.distributed as dist

    from moetrain.config import load_config
    from moetrain.parallel.accounting import (
        analytic_expert_flops,
        analytic_sent,
        layer_counts,
        measure_step,
        zero_bytes_per_param,
    )
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(cfg_path, [*overrides, f"train.output_dir={out}", *FIXED_OVERRIDES])
        trainer = Trainer(cfg)
        trainer.train_step()
        report = measure_step(trainer)
        d = trainer.dims
        zero = cfg.parallel.zero_stage if d.dp > 1 else 0
        row = {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "params": report.params_per_rank,
            "memory": report.peak.total,
            "formula": zero_bytes_per_param(zero, d.dp_shard) * report.params_per_rank,
            "sent": report.sent,
            "analytic": analytic_sent(
                cfg, d, report.params_per_rank, layer_counts(trainer.engine.parts)
            ),
            "expert_flops": report.expert_flops,
            "expert_flops_analytic": analytic_expert_flops(
                cfg, d, layer_counts(trainer.engine.parts)["moe"]
            ),
            "layout": f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x "
            f"tp {d.tp}, zero {zero}, sp {cfg.parallel.sequence_parallel}, "
            f"{d.microbatches(cfg)} micro-batches of {d.micro_batch_size(cfg)}",
        }
        trainer.close()
    if dist.is_initialized():
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return {"rows": rows}
    return {"rows": [row]}


def _print(rows: list[dict]) -> None:
    print(f"layout: {rows[0]['layout']}")
    print("model state per rank (peak of after-forward / after-backward / after-step):")
    for r in rows:
        print(
            f"  rank {r['rank']}: {r['memory'] / 1e6:9.3f} MB for {r['params']:,} params "
            f"= {r['memory'] / r['formula']:.4f} x the ZeRO formula"
        )
    print("bytes sent in one step (ring conventions):")
    kinds = sorted({k for r in rows for k in r["sent"]})
    for r in rows:
        parts = ", ".join(f"{k} {r['sent'].get(k, 0) / 1e6:.4f} MB" for k in kinds)
        print(f"  rank {r['rank']}: {parts}")
    a = rows[0]["analytic"]
    s0 = rows[0]["sent"]
    if "dp" in a:
        total = sum(s0.values())
        print(
            f"data parallel: analytic {a['dp'] / 1e6:.4f} MB per rank, rank 0 sent "
            f"{total / 1e6:.4f} MB in all = {total / a['dp']:.4f}"
        )
    if "tp" in a:
        tp = s0.get("all_gather", 0) + s0.get("reduce_scatter", 0)
        if "dp" not in a:
            print(
                f"tensor parallel: analytic {a['tp'] / 1e6:.4f} MB, rank 0's all-gathers + "
                f"reduce-scatters {tp / 1e6:.4f} MB = {tp / a['tp']:.4f}"
            )
        else:
            print(
                f"tensor parallel: analytic {a['tp'] / 1e6:.4f} MB per rank (mixed with dp "
                "traffic above)"
            )
    if rows[0]["expert_flops_analytic"]:
        print(
            "routed-expert forward FLOPs per rank (measured from the rows each rank's experts "
            "received; analytic: every assignment computed once, over dp ranks and, with "
            "parallel.expert_tp, tp ranks):"
        )
        for r in rows:
            print(
                f"  rank {r['rank']}: {r['expert_flops'] / 1e6:.3f} MFLOP = "
                f"{r['expert_flops'] / r['expert_flops_analytic']:.4f} x analytic "
                f"{r['expert_flops_analytic'] / 1e6:.3f} MFLOP"
            )
    if "pp_all_ranks" in a:
        sends = sum(r["sent"].get("send", 0) for r in rows)
        print(
            f"pipeline: analytic {a['pp_all_ranks'] / 1e6:.4f} MB over all ranks, sent "
            f"{sends / 1e6:.4f} MB = {sends / a['pp_all_ranks']:.4f}"
        )


def _spawned(
    rank: int, world: int, rendezvous: str, cfg_path: str | None, overrides: list[str]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        out = _measure(cfg_path, overrides)
        if rank == 0:
            _print(out["rows"])
    finally:
        dist.destroy_process_group()


def check_args(args: argparse.Namespace, world_size: int | None = None) -> None:
    """Load the config and check its layout for the job's world size (``--nproc``, else
    ``world_size``, else torchrun's ``WORLD_SIZE``) without starting anything; raises
    ConfigError naming the key."""
    from moetrain.config import load_config
    from moetrain.parallel.dims import ParallelDims

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    world = args.nproc if args.nproc > 1 else world_size
    cfg = load_config(args.config, [*args.overrides, *FIXED_OVERRIDES])
    ParallelDims.from_config(cfg.parallel, world).validate(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML experiment file")
    parser.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="spawn this many CPU processes (default: torchrun's, or 1)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moetrain.config import ConfigError

    try:
        check_args(args)
    except ConfigError as exc:
        print(f"comm_report: config error: {exc}", file=sys.stderr)
        return 2
    if args.nproc > 1:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(
                _spawned,
                args=(args.nproc, str(Path(tmp) / "rdzv"), args.config, args.overrides),
                nprocs=args.nproc,
                join=True,
            )
        return 0
    import torch.distributed as dist

    out = _measure(args.config, args.overrides)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _print(out["rows"])
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
