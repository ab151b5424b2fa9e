"""Muon's Newton-Schulz per rank, every holder gathering each matrix against one owner per
matrix (``optim.muon_distributed``), on the same model, layout and gradients.

    python tools/bench_muon.py                 # tiny, dp2 / dp4 ZeRO-3 and tp2, CPU (gloo)
    python tools/bench_muon.py --steps 5 --out docs/data/muon_owners.json

For each layout and each mode, the ranks (spawned, one thread each) build the trainer, take
one training step (the states exist), then time ``--steps`` more optimizer steps on fixed
gradients: per rank, the Newton-Schulz FLOPs and the bytes the step sends (the optimizer's
own ``step_costs``, which tests/plan/test_exact.py proves exact), the time inside
``newton_schulz`` and the time of the whole orthogonalization (its collectives included),
medians over the steps. The target: the owners' per-rank FLOPs on the matrices ranks split
are the gather's divided by the group size, up to the balance of the shares (``balance``:
the busiest rank's over the mean); the busiest rank's figures are shown (a step waits for
it). Matrices a rank holds whole (its experts under FSDP2's expert-dim shard) cost the same
in both modes. On a 2-core CPU the ranks share the cores, so times are the ranks' wall clocks
under contention: the FLOPs and bytes are the figures that carry to a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = {
    "dp2 ZeRO-3": (2, ["parallel.zero_stage=3"]),
    "dp4 ZeRO-3": (4, ["parallel.zero_stage=3", "train.micro_batch_size=4",
                       "moe.token_group_seqs=4"]),
    "tp2": (2, ["parallel.tp=2"]),
}
MODES = ("gather", "owners")
FIXED = ["optim.name=muon", "train.steps=100", "log.tensorboard=false", "log.progress_bar=false",
         "train.eval_every=0", "train.checkpoint_every=0"]  # fmt: skip


def _timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out

    return wrapper


def _measure(config: str, overrides: list[str], steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from moetrain.config import load_config
    from moetrain.train import muon, muon_owners
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(config, [*overrides, *FIXED, f"train.output_dir={out}"])
        trainer = Trainer(cfg)
        trainer.train_step()
        opts = [o for o in trainer.engine.optimizers if hasattr(o, "step_costs")]
        ns, whole = [], []
        muon.newton_schulz = _timed(muon.newton_schulz, ns)
        for cls in (muon.WholeMatrices, muon_owners.OwnerMatrices):
            cls.__call__ = _timed(cls.__call__, whole)
        torch.manual_seed(dist.get_rank())
        grads = {p: torch.randn_like(p) * 0.01 for o in opts for g in o.param_groups
                 for p in g["params"]}  # fmt: skip
        per_step_ns, per_step_whole = [], []
        for _ in range(steps):
            ns.clear()
            whole.clear()
            for p, g in grads.items():
                p.grad = g
            dist.barrier()
            for o in opts:
                o.step()
            per_step_ns.append(sum(ns))
            per_step_whole.append(sum(whole))
        costs = [o.step_costs() for o in opts]
        row = {
            "rank": dist.get_rank(),
            "ns_flops": sum(c["ns_flops"] for c in costs),
            "ns_flops_whole": sum(_whole_already(o) for o in opts),
            "sent": sum(c["sent"] for c in costs),
            "ns_ms": 1e3 * statistics.median(per_step_ns),
            "orthogonalize_ms": 1e3 * statistics.median(per_step_whole),
            "threads": torch.get_num_threads(),
        }
        trainer.close()
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {"rows": rows}


def _whole_already(opt) -> int:
    """Newton-Schulz FLOPs of the matrices this rank holds whole (a rank's experts under
    FSDP2's expert-dim shard, an unsplit matrix): the same in both modes."""
    from moetrain.train.muon import NS_DTYPES
    from moetrain.train.muon_owners import OwnerMatrices

    owners = OwnerMatrices(opt.whole.layouts)
    out = 0
    for g in opt.param_groups:
        if g.get("muon") and g["params"]:
            _, here = owners.plan(g["params"], g["ns_steps"])
            dtype = NS_DTYPES[g["ns_dtype"]]
            out += owners.costs([g["params"][i] for i in here], g["ns_steps"], dtype)[1]
    return out


def _spawned(rank: int, world: int, rendezvous: str, config: str, overrides: list[str],
             steps: int, result: str) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    try:
        out = _measure(config, overrides, steps)
        if rank == 0:
            Path(result).write_text(json.dumps(out["rows"]))
    finally:
        dist.destroy_process_group()
    # The figures are written; leave without the interpreter's teardown, where a thread the
    # trainer or gloo left joinable aborts the process now and then ("terminate called
    # without an active exception"), which mp.spawn reports as a failed run.
    sys.stdout.flush()
    os._exit(0)


def run_layout(config: str, world: int, overrides: list[str], steps: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "rows.json")
        mp.spawn(_spawned, args=(world, str(Path(tmp) / "rdzv"), config, overrides, steps, result),
                 nprocs=world, join=True)  # fmt: skip
        return json.loads(Path(result).read_text())


def summary(rows: list[dict]) -> dict:
    """The busiest rank's figures (a step waits for it) and the balance of the FLOPs."""
    flops = [r["ns_flops"] for r in rows]
    split = [r["ns_flops"] - r["ns_flops_whole"] for r in rows]
    return {
        "ns_gflop_max": max(flops) / 1e9,
        "split_gflop_max": max(split) / 1e9,
        "balance": max(split) / statistics.mean(split),
        "sent_mb_max": max(r["sent"] for r in rows) / 1e6,
        "ns_ms_max": max(r["ns_ms"] for r in rows),
        "orthogonalize_ms_max": max(r["orthogonalize_ms"] for r in rows),
    }


def table(data: dict) -> str:
    """The page's table: per layout, both modes' busiest rank, and owners / gather."""
    lines = ["| layout | mode | NS GFLOP / rank | of split matrices | balance | MB sent / rank "
             "| NS ms | orthogonalize ms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for layout, modes in data["layouts"].items():
        for mode in MODES:
            s = summary(modes[mode])
            lines.append(f"| {layout} | {mode} | {s['ns_gflop_max']:.3f} | "
                         f"{s['split_gflop_max']:.3f} | {s['balance']:.2f} "
                         f"| {s['sent_mb_max']:.2f} | {s['ns_ms_max']:.0f} | "
                         f"{s['orthogonalize_ms_max']:.0f} |")  # fmt: skip
        g, o = summary(modes["gather"]), summary(modes["owners"])
        lines.append(f"| {layout} | owners / gather | {o['ns_gflop_max'] / g['ns_gflop_max']:.2f}x "
                     f"| {o['split_gflop_max'] / g['split_gflop_max']:.2f}x | "
                     f"| {o['sent_mb_max'] / g['sent_mb_max']:.2f}x | "
                     f"{o['ns_ms_max'] / g['ns_ms_max']:.2f}x | "
                     f"{o['orthogonalize_ms_max'] / g['orthogonalize_ms_max']:.2f}x |")  # fmt: skip
    return "\n".join(lines) + f"\n\n{data['machine']}, {data['config']}, {data['steps']} steps.\n"


def _cpu() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (median)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    import torch

    data = {
        "machine": f"{_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
        "one thread a rank",
        "config": os.path.relpath(args.config, REPO),
        "steps": args.steps,
        "layouts": {},
    }
    for name in args.layouts:
        world, overrides = LAYOUTS[name]
        data["layouts"][name] = {
            mode: run_layout(args.config, world, [*overrides, f"optim.muon_distributed={mode}"],
                             args.steps)  # fmt: skip
            for mode in MODES
        }
    print(table(data))
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
