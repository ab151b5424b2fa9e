"""QK-clip on tiny at a learning rate where the attention logits grow (docs/optim.md, "QK-clip").

Four runs of tiny's model and data from the same seed: Muon and AdamW, each with the logits
only recorded (``optim.qk_clip=.inf``) and with QK-clip at ``--tau``. Per run: the largest
pre-softmax logit of every step (over every layer and head) and the final eval loss.
tests/train/test_qk_clip_training.py runs a short version of the same runs (``run``); this
tool writes the full ones to docs/data/qk_clip.json and prints the table docs/optim.md holds
(checked by tests/test_docs.py against the file).

    python tools/qk_clip_runs.py                   # writes docs/data/qk_clip.json
    python tools/qk_clip_runs.py --print           # the table from the file
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "data" / "qk_clip.json"

SHAPE = ["data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=8"]
"""tiny's model on shorter, fewer sequences than its own (64 tokens, 8 a step)."""
MUON = ["optim.muon_ns_dtype=fp32"]
"""Muon's Newton-Schulz in fp32: a CPU without bf16 matrix units runs bf16 matmuls ~5x
slower."""

RUNS = [("muon", "inf"), ("muon", "clip"), ("adamw", "inf"), ("adamw", "clip")]


def run(optimizer: str, lr: float, tau: float | None, steps: int, seed: int = 0,
        extra: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One run on tiny: ``tau`` None records the logits without clipping; ``extra``: more
    overrides. Returns the per-step largest logit, the per-step loss and the final eval
    loss."""
    from moetrain.config import load_config
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [
            *SHAPE, f"train.steps={steps}", f"train.seed={seed}", f"data.seed={seed}",
            "train.eval_every=0", "train.checkpoint_every=0", "train.eval_batches=4",
            "log.tensorboard=false", "log.progress_bar=false", "log.specialization=false",
            f"optim.warmup_steps={max(1, steps // 10)}", f"optim.name={optimizer}",
            f"optim.lr={lr}", f"optim.qk_clip={'.inf' if tau is None else tau}",
            f"train.output_dir={tmp}", *(MUON if optimizer == "muon" else []), *(extra or []),
        ])  # fmt: skip
        trainer = Trainer(cfg)
        max_logit, loss = [], []
        for _ in range(steps):
            res = trainer.train_step()
            max_logit.append(max(res.max_logits.values()))
            loss.append(res.loss)
        eval_loss = trainer.evaluate()
        trainer.close()
    return {"max_logit": max_logit, "loss": loss, "eval_loss": eval_loss}


def table(data: dict[str, Any]) -> str:
    """The markdown table of docs/optim.md from the file's contents."""
    tau = data["tau"]
    lines = ["| run | largest logit, whole run | largest logit, last 10 steps | eval loss |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for name, r in data["runs"].items():
        lines.append(f"| `{name}` | {max(r['max_logit']):.1f} | {max(r['max_logit'][-10:]):.1f} "
                     f"| {r['eval_loss']:.4f} |")  # fmt: skip
    lines.append(f"\ntau = {tau:g}; lr {data['lr']['muon']:g} (Muon), {data['lr']['adamw']:g} "
                 f"(AdamW); {data['steps']} steps of 8 sequences of 64 tokens, seed "
                 f"{data['seed']}.")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tau", type=float, default=10.0)
    ap.add_argument("--muon-lr", type=float, default=0.03)
    ap.add_argument("--adamw-lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print", action="store_true", help="print the table from the file")
    args = ap.parse_args()
    if args.print:
        print(table(json.loads(OUT.read_text())))
        return
    lrs = {"muon": args.muon_lr, "adamw": args.adamw_lr}
    runs = {}
    for optimizer, kind in RUNS:
        start = time.perf_counter()
        tau = args.tau if kind == "clip" else None
        runs[f"{optimizer}, {'QK-clip' if tau else 'no clip'}"] = run(
            optimizer, lrs[optimizer], tau, args.steps, args.seed)
        print(f"{optimizer} {kind}: {time.perf_counter() - start:.0f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    data = {"tau": args.tau, "lr": lrs, "steps": args.steps, "seed": args.seed,
            "commit": commit, "machine": platform.processor() or platform.machine(),
            "runs": runs}  # fmt: skip
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))


if __name__ == "__main__":
    main()
