"""Memory and communication of one training step under a layout, beside the analytic figures.

    python tools/comm_report.py --nproc 4 --config configs/tiny.yaml parallel.zero_stage=3 \
        train.micro_batch_size=4 moe.token_group_seqs=4
    torchrun --nproc-per-node 8 tools/comm_report.py --config configs/tiny_3d.yaml

``--nproc N`` spawns N CPU processes itself (gloo); under torchrun it uses the launch. The
config and its layout are checked for that world size before any process starts. Each rank
takes one warm-up step, then one measured step (``moetrain.parallel.accounting``); rank 0
prints, per rank: model-state bytes and their ratio to the ZeRO formula, bytes sent per
collective kind, and the analytic volume of each axis (``docs/parallel.md``) with its ratio;
with a pipeline, the schedule's bubble from its own action list beside the analytic one;
the activation bytes per rank, and with context parallelism (``parallel.cp``) the cp
group's bytes against their volume and the activations against (A_1 - KV_1)/cp + KV_cp,
A_1 measured by a second run without cp on the same world and per-rank micro-batch.
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
    from moetrain.parallel.accounting import measure_step, step_figures
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(cfg_path, [*overrides, f"train.output_dir={out}", *FIXED_OVERRIDES])
        trainer = Trainer(cfg)
        trainer.train_step()
        report = measure_step(trainer)
        d = trainer.dims
        figures = step_figures(trainer, report)
        zero = figures["zero"]
        row = {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            **figures,
            "bubble": _bubble(cfg, d),
            "layout": f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x "
            f"cp {d.cp} x tp {d.tp}, zero {zero}, sp {cfg.parallel.sequence_parallel}, "
            f"{d.microbatches(cfg)} micro-batches of {d.micro_batch_size(cfg)}"
            + (f", schedule {cfg.parallel.pp_schedule}" if d.pp > 1 else ""),
        }
        trainer.close()
        if d.cp > 1:  # the cp = 1 baseline: the same micro-batch of whole sequences per rank
            row.update(_cp1_baseline(cfg_path, overrides, cfg, d))
    if dist.is_initialized():
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return {"rows": rows}
    return {"rows": [row]}


def _bubble(cfg, dims) -> dict | None:
    """The schedule's bubble from its own action list beside the analytic figure."""
    if dims.pp == 1:
        return None
    from moetrain.parallel.pipeline import analytic_bubble, schedule_actions, simulate_schedule

    name, p, v, m = cfg.parallel.pp_schedule, dims.pp, dims.virtual_stages, dims.breadth_first(cfg)
    sim = simulate_schedule(schedule_actions(name, p, v, m), p * v)
    return {"actions": sim["bubble"], "analytic": analytic_bubble(name, p, v, m), "m": m}


def _cp1_baseline(cfg_path: str | None, overrides: list[str], cfg, dims) -> dict:
    """Activation bytes of the same layout without context parallelism on the same world
    (cp folded into dp_shard) and the same per-rank micro-batch of whole sequences (the
    global batch x cp): A_1 and KV_1 of the analytic (A_1 - KV_1)/cp + KV_cp."""
    from moetrain.config import load_config
    from moetrain.parallel.accounting import measure_step, step_figures
    from moetrain.train.trainer import Trainer

    p = cfg.parallel
    extra = ["parallel.cp=1", f"train.global_batch_size={cfg.train.global_batch_size * dims.cp}"]
    if p.dp_shard != -1:
        extra.append(f"parallel.dp_shard={p.dp_shard * dims.cp}")
    with tempfile.TemporaryDirectory() as out:
        base_cfg = load_config(
            cfg_path, [*overrides, *extra, f"train.output_dir={out}", *FIXED_OVERRIDES]
        )
        trainer = Trainer(base_cfg)
        trainer.train_step()
        report = measure_step(trainer)
        kv = step_figures(trainer, report)["kv"]
        trainer.close()
    return {"activations_cp1": report.activations, "kv_cp1": kv}


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
        # Context parallelism's own gathers are priced below, on their own.
        cp_kinds = ("all_gather", "reduce_scatter")
        total = sum(s0.values()) - sum(rows[0]["sent_cp"].get(k, 0) for k in cp_kinds)
        print(
            f"data parallel: analytic {a['dp'] / 1e6:.4f} MB per rank, rank 0 sent "
            f"{total / 1e6:.4f} MB in all{' but the cp gathers' if 'cp' in a else ''} = "
            f"{total / a['dp']:.4f}"
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
    b = rows[0]["bubble"]
    if b is not None:
        print(
            f"pipeline bubble (idle / useful time per rank, {b['m']} micro-batches per pass): "
            f"{b['actions']:.4f} from the schedule's action list, {b['analytic']:.4f} analytic "
            "(tools/pipeline_bubble.py)"
        )
    if "cp" in a:
        from moetrain.parallel.accounting import analytic_cp_activations

        cp_sent = sum(rows[0]["sent_cp"].get(k, 0) for k in ("all_gather", "reduce_scatter"))
        print(
            f"context parallel: analytic {a['cp'] / 1e6:.4f} MB per rank (K/V gathers and "
            f"their gradients, MoE routing), rank 0's all-gathers + reduce-scatters on the cp "
            f"group {cp_sent / 1e6:.4f} MB = {cp_sent / a['cp']:.4f}"
        )
        print("activations per rank (peak saved for backward) against (A_1 - KV_1)/cp + KV_cp:")
        for r in rows:
            analytic = analytic_cp_activations(r["activations_cp1"], r["kv_cp1"], r["cp"], r["kv"])
            print(
                f"  rank {r['rank']}: {r['activations'] / 1e6:.3f} MB = "
                f"{r['activations'] / analytic:.4f} x analytic {analytic / 1e6:.3f} MB "
                f"(cp = 1: {r['activations_cp1'] / 1e6:.3f} MB)"
            )
    else:
        acts = ", ".join(f"rank {r['rank']} {r['activations'] / 1e6:.3f} MB" for r in rows)
        print(f"activations per rank (peak saved for backward): {acts}")


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
