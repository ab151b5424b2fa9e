"""Start-up memory of a multi-rank CPU job, measured: how much resident memory each rank's
``Trainer(cfg)`` adds at its peak, beside the model's size and the plan's start-up figure.
Appends rows to docs/data/startup_memory.csv (docs/plan.md's measured start-up quotes it).

    python tools/startup_memory.py                      # rows labelled "after"
    PYTHONPATH=<an older checkout> python tools/startup_memory.py --label before --commit C
    python tools/startup_memory.py --print              # the table of docs/plan.md

Each layout runs as a job of ``--world`` spawned CPU processes (gloo), as torchrun would
start them: a rank reads its resident memory (``VmRSS``), resets the kernel's peak
(``/proc/self/clear_refs``), builds ``Trainer(cfg)`` -- the model, the layout, the engine, the
optimizer, the data -- and reads the peak (``VmHWM``). The difference is the start-up's
peak, imports excluded. The tool uses the public API only (``Trainer``, ``moetrain.plan``),
so that it measures any version of moetrain on the path.

The model: configs/tiny.yaml made 111M parameters (445 MB in fp32) big; the last layout
makes it 4 MB, so that its rows show the part of the start-up that is not the model.
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "docs" / "data" / "startup_memory.csv"
FIELDS = ["label", "commit", "layout", "world", "rank", "model_mb", "rss_before_mb",
          "startup_peak_mb", "planned_start_up_mb", "cpus"]  # fmt: skip
MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
         "model.ffn_dim=1024", "moe.num_experts=16", "moe.expert_ffn_dim=512",
         "model.tie_embeddings=false", "train.device=cpu", "train.dtype=fp32",
         "train.memory_check=false", "log.tensorboard=false", "log.progress_bar=false",
         "train.micro_batch_size=1", "train.global_batch_size=4",
         "moe.token_group_seqs=1"]  # fmt: skip
LAYOUTS = {
    "ZeRO-3": ["parallel.zero_stage=3"],
    "ep=4 + ZeRO-3": ["parallel.ep=4", "parallel.zero_stage=3"],
    # A model of a few MB: what the trainer's start adds besides the model (the modules it
    # imports, the process group, the data, the tokenizer), which the plan does not count.
    "ZeRO-3, a 4 MB model": ["parallel.zero_stage=3", "model.dim=64", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
                             "moe.expert_ffn_dim=64"],
}  # fmt: skip


def _status(field: str) -> float:
    """A ``/proc/self/status`` figure in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, world: int, port: int, overrides: list[str], out: str, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    cfg = load_config(REPO / "configs" / "tiny.yaml", [*overrides, f"train.output_dir={out}"])
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory starts again from now
    trainer = Trainer(cfg)
    peak = _status("VmHWM")
    trainer.close()
    queue.put((rank, before, peak - before))
    dist.barrier()
    dist.destroy_process_group()


def measure(layout: str, world: int) -> list[tuple[int, float, float]]:
    """(rank, resident MB before, the start-up's peak MB) of every rank of one job."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        args = (world, port, [*MODEL, *LAYOUTS[layout]], out, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        rows = sorted(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{layout}: a rank failed")
    return rows


def planned(layout: str, world: int) -> tuple[float, list[float]]:
    """The model's fp32 MB and the plan's start-up MB of every rank."""
    import torch

    from moetrain.config import load_config
    from moetrain.model import Transformer
    from moetrain.plan.planner import plan
    from moetrain.train.engine import build_optimizers

    def config():
        return load_config(REPO / "configs" / "tiny.yaml", [*MODEL, *LAYOUTS[layout]])

    with torch.device("meta"):
        cfg = config()
        cfg.model.vocab_size = 4096
        model_mb = sum(p.numel() * 4 for p in Transformer(cfg.model, cfg.moe).parameters()) / 1e6
    out = []
    for rank in range(world):
        p = plan(config(), world, build_optimizers, device_type="cpu", ranks=[rank])
        per_rank = getattr(p, "start_up_of", None)  # versions before it: one figure for all
        out.append((per_rank(p.ranks[0]) if per_rank else p.start_up) / 1e6)
    return model_mb, out


def read_rows(path: Path = CSV) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def render(rows: list[dict[str, str]]) -> str:
    """docs/plan.md's table: per label and layout, the ranks' measured peaks and the plan's."""
    lines = ["| code | layout | ranks | model (fp32) | start-up peak per rank, measured | "
             "start-up per rank, planned |", "|---|---|---|---|---|---|"]  # fmt: skip
    groups: dict[tuple[str, str, str], list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["commit"], r["layout"]), []).append(r)
    for (label, commit, layout), rs in groups.items():
        measured = " / ".join(f"{float(r['startup_peak_mb']):.0f}" for r in rs)
        plan = " / ".join(f"{float(r['planned_start_up_mb']):.0f}" for r in rs)
        model = f"{float(rs[0]['model_mb']):.0f} MB"
        lines.append(f"| {label} ({commit}) | {layout} | {len(rs)} | {model} | {measured} MB | "
                     f"{plan} MB |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after", help="the rows' label (default: after)")
    parser.add_argument("--world", type=int, default=4, help="ranks per job (default: 4)")
    parser.add_argument("--layout", action="append", choices=list(LAYOUTS),
                        help="a layout to measure (default: all)")  # fmt: skip
    parser.add_argument("--csv", default=str(CSV), help="the file rows are appended to")
    parser.add_argument("--commit", help="the measured code's commit (default: git's)")
    parser.add_argument("--print", action="store_true", help="print the table and exit")
    args = parser.parse_args(argv)
    if args.print:
        print(render(read_rows(Path(args.csv))))
        return 0
    import moetrain

    code = Path(moetrain.__file__).resolve().parent.parent
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           cwd=code).stdout.strip()  # fmt: skip
    path = Path(args.csv)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for layout in args.layout or list(LAYOUTS):
            model_mb, plan_mb = planned(layout, args.world)
            for rank, before, peak in measure(layout, args.world):
                row = {"label": args.label, "commit": commit, "layout": layout,
                       "world": args.world, "rank": rank, "model_mb": f"{model_mb:.1f}",
                       "rss_before_mb": f"{before:.1f}", "startup_peak_mb": f"{peak:.1f}",
                       "planned_start_up_mb": f"{plan_mb[rank]:.1f}",
                       "cpus": os.cpu_count()}  # fmt: skip
                writer.writerow(row)
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
