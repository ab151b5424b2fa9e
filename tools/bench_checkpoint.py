"""What a checkpoint costs the steps around it: synchronous against asynchronous saves.

    python tools/bench_checkpoint.py                 # a model with >= 1 GB of state; the page
    python tools/bench_checkpoint.py --render        # docs/checkpoints.md from the JSON alone
    python tools/bench_checkpoint.py --quick --out X.json --no-page   # a small smoke run

Builds the trainer of ``configs/tiny.yaml`` with wider, deeper experts (``MODEL``: about 110 M
parameters, 1.3 GB of parameters and AdamW state in fp32), runs ``--warmup`` steps, then
``--steps`` normal steps, then one step followed by a synchronous save
(``train.checkpoint_async=false``: the step's time plus the save's, what training waits), then
one step followed by an asynchronous save and the steps that run while it is written, each timed
(the staging copy counts in the first of them), then ``--steps`` normal steps again: the normal
step is the median of the normal steps before and after, so that a drift of the machine's speed
during the run weighs on neither side. Reported: the normal
step, the synchronous save's step and its ratio, every step during the asynchronous save and
the largest ratio (target: at most 1.25), the save's own duration, the staging bytes and the
checkpoint's size on disk. Written to ``docs/data/bench_checkpoint.json`` with the hardware,
torch and commit, and rendered into docs/checkpoints.md between its markers
(tests/tools/test_bench_checkpoint.py checks that the page says what the JSON holds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JSON = REPO / "docs" / "data" / "bench_checkpoint.json"
PAGE = REPO / "docs" / "checkpoints.md"
BEGIN = "<!-- bench_checkpoint: written from docs/data/bench_checkpoint.json by tools/bench_checkpoint.py -->"  # noqa: E501
END = "<!-- /bench_checkpoint -->"

MODEL = ["model.dim=512", "model.n_heads=8", "model.n_layers=4", "moe.num_experts=16",
         "moe.expert_ffn_dim=1024", "data.seq_len=64", "train.global_batch_size=4",
         "train.micro_batch_size=4", "moe.token_group_seqs=4"]  # fmt: skip
QUICK = ["model.dim=32", "model.n_heads=2", "model.n_layers=2", "moe.num_experts=4",
         "moe.expert_ffn_dim=32", "data.seq_len=16", "train.global_batch_size=2",
         "train.micro_batch_size=2", "moe.token_group_seqs=2"]  # fmt: skip


def _trainer(out: Path, overrides: list[str], asynchronous: bool) -> Any:
    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
        *overrides, f"train.output_dir={out}", "train.eval_every=0", "log.progress_bar=false",
        "log.tensorboard=false", "train.memory_check=false", "train.steps=1000",
        f"train.checkpoint_async={str(asynchronous).lower()}", "train.keep_last=1"])  # fmt: skip
    return Trainer(cfg)


def _timed_step(trainer: Any) -> float:
    start = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - start


def measure(overrides: list[str], warmup: int, steps: int, threads: int) -> dict[str, Any]:
    """The figures of one run (see the module's docstring), training on ``threads`` intra-op
    threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(overrides, warmup, steps) | {"threads": threads}
    finally:
        torch.set_num_threads(before)


def _measure(overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(Path(tmp) / "run", overrides, asynchronous=True)
        state_bytes = sum(
            t.numel() * t.element_size()
            for sd in trainer.engine.app_state().values()
            for t in sd.values()
            if hasattr(t, "numel")
        )
        for _ in range(warmup):
            trainer.train_step()
        normal = [_timed_step(trainer) for _ in range(steps)]
        start = time.perf_counter()
        trainer.train_step()
        path = trainer.save_checkpoint()  # synchronous: training waits for all of it
        sync_step = time.perf_counter() - start
        disk = sum(f.stat().st_size for f in path.iterdir())
        trainer.save_checkpoint(asynchronous=True)  # the staging buffers, allocated once
        trainer.ckpt.wait()
        start = time.perf_counter()
        trainer.train_step()
        staged_at = time.perf_counter()
        trainer.save_checkpoint(asynchronous=True)
        saved_at = time.perf_counter()
        stage = saved_at - staged_at
        during = [saved_at - start]  # the step that staged it
        while trainer.ckpt.busy:
            during.append(_timed_step(trainer))
        trainer.ckpt.wait()
        async_save = time.perf_counter() - saved_at
        normal += [_timed_step(trainer) for _ in range(steps)]  # the machine's drift: both sides
        staging = trainer.ckpt.staging_bytes
        trainer.close()
    median = statistics.median(normal)
    return {
        "state_bytes": state_bytes,
        "checkpoint_bytes": disk,
        "staging_bytes": staging,
        "normal_step_s": median,
        "normal_steps_s": normal,
        "sync_step_s": sync_step,
        "sync_ratio": sync_step / median,
        "async_steps_s": during,
        "async_max_ratio": max(during) / median,
        "async_save_s": async_save,
        "stage_s": stage,
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(run: dict[str, Any]) -> str:
    """The page's results block for one run of the JSON (one table row per thread count)."""
    gb = 1e9
    rows = run["figures"]
    r0 = rows[0]
    lines = [
        f"Run {run['when']}, moetrain {run['commit']}, torch {run['torch']}: "
        f"{run['machine']}. State: {r0['state_bytes'] / gb:.2f} GB of parameters and "
        f"optimizer state; checkpoint on disk {r0['checkpoint_bytes'] / gb:.2f} GB; staging "
        f"buffers {r0['staging_bytes'] / gb:.2f} GB.",
        "",
        "| training threads | normal step s | step + synchronous save s (x) | steps during the "
        "asynchronous save s (largest x) | asynchronous save s | staging s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = ", ".join(f"{s:.2f}" for s in r["async_steps_s"])
        lines.append(
            f"| {r['threads']} | {r['normal_step_s']:.2f} | {r['sync_step_s']:.2f} "
            f"({r['sync_ratio']:.2f}x) | {steps} ({r['async_max_ratio']:.2f}x) | "
            f"{r['async_save_s']:.2f} | {r['stage_s']:.2f} |"
        )
    lines.append("")
    for r in rows:
        verdict = "met" if r["async_max_ratio"] <= 1.25 else "not met"
        lines.append(f"- {r['threads']} training thread(s): no step during the asynchronous "
                     f"save over 1.25x a normal step: {verdict} ({r['async_max_ratio']:.2f}x; "
                     f"the first step's time includes staging).")  # fmt: skip
    return "\n".join(lines)


def page_block(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write_page(run: dict[str, Any], page: Path = PAGE) -> None:
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:start] + "\n" + render(run) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a micro model (a smoke run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=JSON)
    parser.add_argument("--no-page", action="store_true", help="leave docs/checkpoints.md")
    parser.add_argument("--render", action="store_true", help="the page from the JSON only")
    args = parser.parse_args(argv)
    if args.render:
        write_page(json.loads(args.out.read_text()))
        return 0
    cores = os.cpu_count() or 1
    figures = [measure(QUICK if args.quick else MODEL, args.warmup, args.steps, threads)
               for threads in sorted({cores, max(1, cores - 1)}, reverse=True)]  # fmt: skip
    run = {
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": _commit(),
        "torch": __import__("torch").__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "model": QUICK if args.quick else MODEL,
        "figures": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run, indent=1) + "\n")
    print(render(run))
    if not args.no_page:
        write_page(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
