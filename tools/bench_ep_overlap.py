"""Expert-parallel overlap on CPU: a training step with and without ``parallel.ep_overlap=
halves``, each all-to-all slowed by a known wire, the share of the communication time the
schedule hides, and what ``moetrain plan``'s model of the schedule predicts.

    python tools/bench_ep_overlap.py                        # ep 2 and 4, both wires
    python tools/bench_ep_overlap.py --ep 2 --latency-ms 5 10 --mbps --steps 4

gloo runs collectives on threads of its own, so what a schedule overlaps really overlaps
here. Each rank replaces ``torch.distributed.all_to_all_single`` (in this configuration only
the expert-parallel dispatch issues it) with the real collective plus a delay (``Wire``): a
transfer issued at time t completes no earlier than t + its delay, however many others are
in flight. Two wires: a fixed latency per transfer (``--latency-ms``: the halves schedule
sends twice as many messages, each as slow), and a bandwidth (``--mbps``: each transfer
takes its bytes at that rate, so a half's transfer takes half a whole one's). The hook lives
in this file: nothing in moetrain changes.

The model is configs/tiny.yaml's layers (dim 192, 4 MoE layers of 8 experts, top-2,
capacity 1.5, 128 tokens a sequence), one micro-batch of 8 sequences a rank (halves of 4),
token groups of 4, one compute thread per rank, every token routed by its position
(``moe.force_load_balancing``: each rank computes as much as the others, so a rank waits for
the wire rather than for a busier peer; what imbalance costs is the received-rows scalar's
subject, docs/dashboards.md). Per (ep, wire, schedule), medians over
``--steps`` training steps after a warm-up step:

    step      the step's wall time
    exposed   the seconds a rank waits for its all-to-alls (the mean over ranks): the
              communication the schedule did not hide, measured where it happens
    plan      the exposed seconds ``moetrain.plan.estimate`` predicts from the transfers'
              time on the wire and the phases' compute time (``PhaseClock``, measured with
              no delay): 4 exposed transfers per MoE block without the schedule, the halves
              schedule's timeline (``halves_exposed``) with it
    hidden    1 - exposed(halves) / exposed(plain); "of the step time": the same from the
              step times' growth over the wire without delay

Written to docs/data/ep_overlap.json (``--out``), quoted by docs/expert_parallel.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import queue as queue_module
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
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
    "moe.force_load_balancing=true", "train.benchmark=true",
]  # fmt: skip
SCHEDULES = {"plain": "parallel.ep_overlap=none", "halves": "parallel.ep_overlap=halves"}


@dataclass(frozen=True)
class WireSpec:
    """How slow the wire is: ``latency`` seconds per transfer, or ``mbps`` megabytes a
    second (0: no delay)."""

    latency: float = 0.0
    mbps: float = 0.0

    @property
    def label(self) -> str:
        if self.mbps:
            return f"{self.mbps:g} MB/s"
        return f"{self.latency * 1e3:g} ms" if self.latency else "no delay"

    def delay(self, nbytes: int) -> float:
        return self.latency + (nbytes / (self.mbps * 1e6) if self.mbps else 0.0)


class Wire:
    """This process's ``dist.all_to_all_single`` while installed (in this configuration only
    the expert-parallel dispatch issues it): each call completes no earlier than its delay
    (``WireSpec``: of the larger of its send and receive buffers) after it is issued,
    however many others are in flight. It counts the calls (``calls``), the longest delay
    (``longest``: a row transfer's; the counts are smaller) and the seconds the caller
    waits for them (``blocked``): the exposed communication time."""

    def __init__(self, spec: WireSpec) -> None:
        self.spec, self.calls, self.longest, self.blocked = spec, 0, 0.0, 0.0
        self.real = dist.all_to_all_single

    def install(self) -> Wire:
        dist.all_to_all_single = self._call
        return self

    def uninstall(self) -> None:
        dist.all_to_all_single = self.real

    def reset(self) -> None:
        self.calls, self.longest, self.blocked = 0, 0.0, 0.0

    def _call(self, output, input, output_split_sizes=None, input_split_sizes=None,
              group=None, async_op=False):  # fmt: skip
        self.calls += 1
        delay = self.spec.delay(max(output.nbytes, input.nbytes))
        self.longest = max(self.longest, delay)
        done_at = time.perf_counter() + delay
        work = self.real(output, input, output_split_sizes, input_split_sizes, group=group,
                         async_op=True)  # fmt: skip
        delayed = DelayedWork(self, work, done_at)
        if async_op:
            return delayed
        delayed.wait()
        return None


class DelayedWork:
    """A collective's work that completes no earlier than ``done_at`` (perf_counter)."""

    def __init__(self, wire: Wire, work, done_at: float) -> None:
        self.wire, self.work, self.done_at = wire, work, done_at

    def wait(self, *args) -> bool:
        start = time.perf_counter()
        self.work.wait()
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.wire.blocked += time.perf_counter() - start
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.done_at


class PhaseClock:
    """The forward phases of ``parallel.ep_overlap=halves`` as they run: the MoE layer's
    ``begin`` / ``exchange`` / ``end`` wrapped (this process's classes, while installed)
    to time, per half, its attention (from the block's start or the previous phase to the
    end of ``begin``), its experts (``exchange``) and its combine (``end``):
    ``moetrain.plan.estimate.HalfPhases``, the plan's model's input."""

    def __init__(self) -> None:
        from moetrain.model.moe import MoELayer
        from moetrain.model.transformer import TransformerBlock

        self.samples: dict[str, list[float]] = {"attention": [], "experts": [], "combine": []}
        self.last = 0.0
        self.saved = [(cls, name, getattr(cls, name)) for cls, name in (
            (TransformerBlock, "_forward_halves"), (MoELayer, "begin"), (MoELayer, "exchange"),
            (MoELayer, "end"))]  # fmt: skip
        for cls, name, fn in self.saved:
            setattr(cls, name, self._timed(name, fn))

    def _timed(self, name: str, fn):
        phase = {"begin": "attention", "exchange": "experts", "end": "combine"}.get(name)

        def timed(module, *args, **kwargs):
            if phase is None:  # the block starts: the first half's attention starts
                self.last = time.perf_counter()
                return fn(module, *args, **kwargs)
            start = time.perf_counter()
            out = fn(module, *args, **kwargs)
            now = time.perf_counter()
            self.samples[phase].append(now - (self.last if phase == "attention" else start))
            self.last = now
            return out

        return timed

    def phases(self):
        from moetrain.plan.estimate import HalfPhases

        return HalfPhases(**{k: statistics.median(v) for k, v in self.samples.items()})

    def uninstall(self) -> None:
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)


def moe_blocks(cfg, world: int) -> int:
    """The MoE blocks a rank runs per step, once per micro-batch."""
    from moetrain.model.transformer import is_moe_layer
    from moetrain.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world).validate(cfg)
    layers = sum(is_moe_layer(i, cfg.moe) for i in range(cfg.model.n_layers))
    return layers * dims.microbatches(cfg)


def _rank(rank: int, world: int, port: int, cases: list, steps: int, extra: list[str],
          queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = []
    for spec, schedule in cases:
        wire = Wire(spec).install()
        clock = PhaseClock() if schedule == "halves" and spec == WireSpec() else None
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(REPO / "configs/tiny.yaml", [
                *OVERRIDES, f"train.global_batch_size={8 * world}", *extra,
                f"parallel.ep={world}", SCHEDULES[schedule],
                f"train.output_dir={tmp}"])  # fmt: skip
            trainer = Trainer(cfg)
            trainer.train_step()  # warm-up
            times, blocked, longest = [], [], []
            calls = 0
            for _ in range(steps):
                dist.barrier()
                wire.reset()
                start = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - start)
                blocked.append(wire.blocked)
                longest.append(wire.longest)
                calls += wire.calls
            trainer.close()
        wire.uninstall()
        phases = None
        if clock is not None:
            phases = dataclasses.asdict(clock.phases())
            clock.uninstall()
        out.append({"wire": spec, "schedule": schedule, "step_s": statistics.median(times),
                    "blocked_s": statistics.median(blocked), "transfer_s": max(longest),
                    "transfers": calls / steps, "moe_blocks": moe_blocks(cfg, world),
                    "phases": phases})  # fmt: skip
    dist.destroy_process_group()
    queue.put((rank, out))


def predicted(transfer_s: float, schedule: str, moe_blocks: int, phases: dict) -> float:
    """The plan's exposed expert all-to-all seconds of a step (``moetrain.plan.estimate``)
    with this benchmark's rates: each row transfer takes ``transfer_s`` on the wire (the
    delay it was given), a half's phases as ``PhaseClock`` measured them with no delay.
    Without the schedule each MoE block makes 4 transfers per micro-batch, none hidden (the
    counts travel beside the rows)."""
    from moetrain.plan.estimate import HalfPhases, halves_exposed

    if schedule == "plain":
        return moe_blocks * 4 * transfer_s
    return moe_blocks * halves_exposed(transfer_s, HalfPhases(**phases))


def measure(ep: int, wires: list[WireSpec], steps: int, extra: list[str]) -> list[dict]:
    """Rows of ``record["rows"]`` for one ep: every wire (the first without delay: the
    baseline of the step times' growth) under both schedules."""
    cases = [(w, s) for w in wires for s in SCHEDULES]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000 + ep
    procs = [ctx.Process(target=_rank, args=(r, ep, port, cases, steps, extra, queue))
             for r in range(ep)]  # fmt: skip
    for p in procs:
        p.start()
    per_rank: dict[int, list[dict]] = {}
    while len(per_rank) < ep:
        try:
            rank, out = queue.get(timeout=5)
            per_rank[rank] = out
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                sys.exit(f"a rank failed (exit code {failed[0]}): its error is above")
    for p in procs:
        p.join()
    runs = {(c["wire"], c["schedule"]): c for c in per_rank[0]}
    for i, run in enumerate(per_rank[0]):  # every rank's wait, on average
        run["blocked_s"] = statistics.mean(per_rank[r][i]["blocked_s"] for r in per_rank)
    phases = runs[(wires[0], "halves")]["phases"]
    rows = []
    for w in wires:
        row: dict = {"ep": ep, "wire": w.label, "latency_ms": w.latency * 1e3, "mbps": w.mbps}
        for s in SCHEDULES:
            run, base = runs[(w, s)], runs[(wires[0], s)]
            row[f"{s}_s"] = run["step_s"]
            row[f"added_{s}_s"] = run["step_s"] - base["step_s"]
            row[f"exposed_{s}_s"] = run["blocked_s"]
            row[f"transfer_{s}_s"] = run["transfer_s"]
            row[f"predicted_{s}_s"] = predicted(run["transfer_s"], s, run["moe_blocks"], phases)
            row[f"transfers_{s}"] = run["transfers"]
        delayed = w != wires[0]
        plain, step = row["exposed_plain_s"], row["added_plain_s"]
        row["hidden"] = 1 - row["exposed_halves_s"] / plain if delayed and plain > 0 else None
        row["hidden_step"] = (1 - row["added_halves_s"] / step
                              if delayed and step > 0 else None)  # fmt: skip
        row["phases"] = phases
        rows.append(row)
    return rows


def table(record: dict) -> str:
    """The record as the markdown table docs/expert_parallel.md quotes, with its source line."""
    lines = ["| ep | wire | a transfer, plain / halves | step, plain | step, halves | "
             "exposed, plain (plan) | exposed, halves (plan) | hidden | hidden of the step "
             "time |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in record["rows"]:

        def ms(key: str, r: dict = r) -> str:
            return f"{r[key] * 1e3:.{1 if r[key] < 0.01 else 0}f} ms"

        def pct(key: str, r: dict = r) -> str:
            return f"{r[key]:.0%}" if r[key] is not None else "-"

        lines.append(f"| {r['ep']} | {r['wire']} | {ms('transfer_plain_s')} / "
                     f"{ms('transfer_halves_s')} | {ms('plain_s')} | {ms('halves_s')} | "
                     f"{ms('exposed_plain_s')} ({ms('predicted_plain_s')}) | "
                     f"{ms('exposed_halves_s')} ({ms('predicted_halves_s')}) | {pct('hidden')} | "
                     f"{pct('hidden_step')} |")  # fmt: skip
    lines += ["", f"Median of {record['steps']} steps, {record['machine']}, {record['when']}."]
    return "\n".join(lines) + "\n"


def own_wait(record: dict, ep: int = 2) -> float:
    """Seconds a row transfer of the plain schedule waits with no delay (gloo's own time and
    the ranks' skew, which the plan does not price): the no-delay waits over its row
    transfers, 4 of every 5 all-to-alls (the fifth carries the counts beside them)."""
    base = next(r for r in record["rows"] if r["ep"] == ep and r["wire"] == "no delay")
    return base["exposed_plain_s"] / base["transfers_plain"] * 5 / 4


def plan_errors(record: dict, ep: int = 2) -> dict[tuple[str, str], float]:
    """|plan - measured| / measured exposed time, per (wire, schedule) of ``ep``'s rows
    whose plain transfer takes at least twice what a transfer waits with no delay
    (``own_wait``): where the wire sets the transfers' time, as on a GPU's network."""
    rows = [r for r in record["rows"] if r["ep"] == ep]
    own = own_wait(record, ep)
    return {(r["wire"], s): abs(r[f"predicted_{s}_s"] - r[f"exposed_{s}_s"]) / r[f"exposed_{s}_s"]
            for r in rows if r["transfer_plain_s"] >= 2 * own for s in SCHEDULES}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--latency-ms", type=float, nargs="*", default=[1.0, 2.0, 5.0, 10.0],
                        help="wires of a fixed latency per transfer")
    parser.add_argument("--mbps", type=float, nargs="*", default=[2000.0, 1000.0, 500.0, 250.0],
                        help="wires of a bandwidth (megabytes a second)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "docs/data/ep_overlap.json"))
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides, after the "
                        "defaults above (e.g. train.micro_batch_size=8)")
    args = parser.parse_args(argv)
    if any(v <= 0 for v in [*args.latency_ms, *args.mbps]):
        parser.error("--latency-ms, --mbps: positive values (the wire without delay is "
                     "always measured)")
    wires = [WireSpec(), *(WireSpec(latency=ms / 1e3) for ms in args.latency_ms),
             *(WireSpec(mbps=mbps) for mbps in args.mbps)]  # fmt: skip
    rows = [row for ep in args.ep for row in measure(ep, wires, args.steps, args.overrides)]
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
    errors = plan_errors(record) if 2 in args.ep else {}
    if errors:
        print(f"plan vs measured exposed time at ep=2 where the wire sets it: at most "
              f"{max(errors.values()):.0%} off ({len(errors)} rows)")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
