"""Expert-parallel overlap on CPU: a training step with and without ``parallel.ep_overlap=
halves``, with a known latency added to every all-to-all, and the share of it hidden.

    python tools/bench_ep_overlap.py                        # ep 2 and 4, 0 to 10 ms
    python tools/bench_ep_overlap.py --ep 2 --latency-ms 0 10 --steps 4

gloo runs collectives on threads of its own, so what a schedule overlaps really overlaps
here. Each rank replaces ``torch.distributed.all_to_all_single`` (in this configuration only
the expert-parallel dispatch issues it) with the real collective plus a delay: a transfer
issued at time t completes no earlier than t + the latency, however many others are in
flight -- a network whose messages take that long to arrive (the bytes of tiny's layers
take microseconds on any link). The hook lives in this file: nothing in moetrain changes.

The model is configs/tiny.yaml's layers (dim 192, 4 MoE layers of 8 experts, top-2,
capacity 1.5, 128 tokens a sequence), one micro-batch of 8 sequences a rank (halves of 4),
token groups of 4, one compute thread per rank. Per (ep, latency, schedule): the median wall time of
``--steps`` training steps after a warm-up step. ``added`` is a schedule's step time minus
its own at latency 0; ``hidden`` = 1 - added(halves) / added(plain): the share of the
added communication time the halves schedule hides. Written to docs/data/ep_overlap.json
(``--out``), quoted by docs/expert_parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "moe.token_group_seqs=4", "train.micro_batch_size=8",
    "train.eval_every=0", "train.checkpoint_every=0", "log.progress_bar=false",
    "log.tensorboard=false", "train.memory_check=false", "moe.jitter_eps=0.0",
]  # fmt: skip
SCHEDULES = {"plain": "parallel.ep_overlap=none", "halves": "parallel.ep_overlap=halves"}


class DelayedWork:
    """A collective's work that completes no earlier than ``done_at`` (perf_counter)."""

    def __init__(self, work, done_at: float) -> None:
        self.work, self.done_at = work, done_at

    def wait(self, *args) -> bool:
        self.work.wait()
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.done_at


def add_latency(seconds: float) -> None:
    """Every later ``dist.all_to_all_single`` of this process completes no earlier than
    ``seconds`` after it is issued (module doc)."""
    real = dist.all_to_all_single

    def delayed(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):  # fmt: skip
        done_at = time.perf_counter() + seconds
        work = real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=True)  # fmt: skip
        delayed_work = DelayedWork(work, done_at)
        if async_op:
            return delayed_work
        delayed_work.wait()
        return None

    dist.all_to_all_single = delayed


def _rank(rank: int, world: int, port: int, cases: list, steps: int, extra: list[str],
          queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    real = dist.all_to_all_single
    out = []
    for latency_ms, schedule in cases:
        dist.all_to_all_single = real
        if latency_ms:
            add_latency(latency_ms / 1000)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(REPO / "configs/tiny.yaml", [
                *OVERRIDES, f"train.global_batch_size={8 * world}", *extra,
                f"parallel.ep={world}", SCHEDULES[schedule],
                f"train.output_dir={tmp}"])  # fmt: skip
            trainer = Trainer(cfg)
            trainer.train_step()  # warm-up
            times = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - start)
            trainer.close()
        out.append((latency_ms, schedule, statistics.median(times)))
    dist.all_to_all_single = real
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def measure(ep: int, latencies: list[float], steps: int, extra: list[str]) -> list[dict]:
    cases = [(lat, s) for lat in latencies for s in SCHEDULES]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000 + ep
    procs = [ctx.Process(target=_rank, args=(r, ep, port, cases, steps, extra, queue))
             for r in range(ep)]  # fmt: skip
    for p in procs:
        p.start()
    results = queue.get(timeout=3600)
    for p in procs:
        p.join()
    step = {(lat, s): t for lat, s, t in results}
    rows = []
    for lat in latencies:
        added = {s: step[(lat, s)] - step[(latencies[0], s)] for s in SCHEDULES}
        hidden = 1 - added["halves"] / added["plain"] if lat and added["plain"] > 0 else None
        rows.append({"ep": ep, "latency_ms": lat, "plain_s": step[(lat, "plain")],
                     "halves_s": step[(lat, "halves")], "added_plain_s": added["plain"],
                     "added_halves_s": added["halves"], "hidden": hidden})  # fmt: skip
    return rows


def table(record: dict) -> str:
    """The record as the markdown table docs/expert_parallel.md quotes, with its source line."""
    lines = ["| ep | latency per all-to-all | step, plain | step, halves | added, plain | "
             "added, halves | hidden |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in record["rows"]:
        hidden = f"{r['hidden']:.0%}" if r["hidden"] is not None else "-"
        lines.append(f"| {r['ep']} | {r['latency_ms']:g} ms | {r['plain_s'] * 1e3:.0f} ms | "
                     f"{r['halves_s'] * 1e3:.0f} ms | {r['added_plain_s'] * 1e3:+.0f} ms | "
                     f"{r['added_halves_s'] * 1e3:+.0f} ms | {hidden} |")
    lines += ["", f"Median of {record['steps']} steps, {record['machine']}, {record['when']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 1.0, 2.0, 5.0, 10.0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "docs/data/ep_overlap.json"))
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides, after the "
                        "defaults above (e.g. train.micro_batch_size=8)")
    args = parser.parse_args(argv)
    if args.latency_ms[0] != 0:
        parser.error("--latency-ms: the first latency must be 0 (the baseline of 'added')")
    rows = [row for ep in args.ep
            for row in measure(ep, args.latency_ms, args.steps, args.overrides)]  # fmt: skip
    record = {
        "tool": "tools/bench_ep_overlap.py",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"torch {torch.__version__}",
        "steps": args.steps,
        "overrides": [*OVERRIDES, *args.overrides],
        "rows": rows,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(record), end="")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
