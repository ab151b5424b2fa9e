"""Train one config with moe.kernels=triton and with moe.kernels=torch; compare the losses.

    python tools/compare_kernel_paths.py                       # GPU: configs/tiny.yaml, 50 steps
    TRITON_INTERPRET=1 python tools/compare_kernel_paths.py --device cpu --quick --no-append

Both runs start from the same seed and see the same batches, so the two loss curves differ
only by the kernels' arithmetic. Every step must agree within the kernel tolerance table of
the run's compute dtype (docs/kernels.md, "Tolerances"): |loss_triton - loss_torch| <=
atol + rtol * |loss_torch|, bf16 on CUDA (autocast), fp32 on CPU. Rows: the largest
absolute and relative difference, the first step's difference, each path's tokens/s;
status "pass" or "fail". The two curves go to --log-dir as a CSV. Exit status 1 on a fail.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from moetrain.config import load_config  # noqa: E402
from moetrain.train.trainer import Trainer  # noqa: E402

# The kernel tolerance table (tests/kernels/kernel_testing.py, docs/kernels.md), per dtype.
LOSS_TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
}
# --quick: a model small enough for the Triton CPU interpreter (seconds per step).
QUICK_OVERRIDES = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=128", "model.max_seq_len=32", "moe.num_experts=4", "moe.top_k=2",
    "moe.expert_ffn_dim=64", "train.micro_batch_size=2", "train.global_batch_size=2",
    "moe.token_group_seqs=null", "data.seq_len=16",
]  # fmt: skip


def run_path(config: str | None, overrides: list[str], backend: str, device: str, steps: int,
             out_dir: str) -> tuple[list[float], float, torch.dtype]:  # fmt: skip
    """Losses of `steps` training steps with moe.kernels=backend, tokens/s, compute dtype."""
    cfg = load_config(config, [
        *overrides, f"moe.kernels={backend}", f"train.device={device}", f"train.steps={steps}",
        "train.eval_every=0", "log.tensorboard=false", "log.progress_bar=false",
        f"train.output_dir={os.path.join(out_dir, backend)}",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    losses, tokens, seconds = [], 0, 0.0
    for step in range(steps):
        res = trainer.train_step()
        losses.append(res.loss)
        if step >= min(3, steps - 1):  # the first steps compile and autotune
            tokens += res.tokens
            seconds += res.seconds
    dtype = trainer.dtype
    trainer.close()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return losses, tokens / max(seconds, 1e-9), dtype


def compare(losses: dict[str, list[float]], dtype: torch.dtype) -> dict[str, float | bool]:
    """Per-step comparison of the triton curve against the torch curve."""
    tol = LOSS_TOLERANCE[dtype]
    abs_d = [abs(a - b) for a, b in zip(losses["triton"], losses["torch"], strict=True)]
    rel_d = [d / max(abs(b), 1e-12) for d, b in zip(abs_d, losses["torch"], strict=True)]
    ok = all(
        math.isfinite(a) and d <= tol["atol"] + tol["rtol"] * abs(b)
        for a, d, b in zip(losses["triton"], abs_d, losses["torch"], strict=True)
    )
    worst = max(range(len(abs_d)), key=abs_d.__getitem__)
    return {"max_abs": max(abs_d), "max_rel": max(rel_d), "first": abs_d[0],
            "worst_step": worst + 1, "ok": ok}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(bc.REPO, "configs", "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="50, or 3 with --quick")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 steps (CPU)")
    parser.add_argument("--csv", default=bc.DEFAULT_CSV)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--log-dir", default=None, help="where the two loss curves go")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick)")
    steps = args.steps or (3 if args.quick else 50)
    overrides = (QUICK_OVERRIDES if args.quick else []) + args.overrides
    device = torch.device(args.device)
    backends = ["triton", "torch"]
    if not bc.triton_usable(device):
        raise SystemExit("triton needs CUDA, or TRITON_INTERPRET=1 on CPU")

    losses, tok_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            losses[backend], tok_s[backend], dtype = run_path(
                args.config, overrides, backend, args.device, steps, tmp
            )
    c = compare(losses, dtype)
    res = bc.Results("kernel_paths", device)
    name = os.path.splitext(os.path.basename(args.config))[0]
    case = f"{name}/{steps} steps"
    status = "pass" if c["ok"] else "fail"
    tol = LOSS_TOLERANCE[dtype]
    tol_text = f"atol {tol['atol']:g} + rtol {tol['rtol']:g}"
    for op, key, unit in (("max_abs_loss_diff", "max_abs", f"nats ({tol_text})"),
                          ("max_rel_loss_diff", "max_rel", "fraction"),
                          ("first_step_loss_diff", "first", "nats")):  # fmt: skip
        res.add(case=case, routing="-", dtype=dtype, op=op, impl="triton-vs-torch",
                value=float(c[key]), unit=unit, status=status)  # fmt: skip
    for backend in backends:
        res.add(case=case, routing="-", dtype=dtype, op="tokens_per_s", impl=backend,
                value=tok_s[backend], unit="tokens/s", status="ok")  # fmt: skip
    print(f"losses: torch {losses['torch'][0]:.4f} -> {losses['torch'][-1]:.4f}, triton "
          f"{losses['triton'][0]:.4f} -> {losses['triton'][-1]:.4f}; worst step "
          f"{c['worst_step']}: {c['max_abs']:.3g} nats; {status.upper()}")  # fmt: skip
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        path = os.path.join(args.log_dir, f"loss_curves_{name}.csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss_torch", "loss_triton"])
            for i, (a, b) in enumerate(zip(losses["torch"], losses["triton"], strict=True)):
                w.writerow([i + 1, f"{a:.6f}", f"{b:.6f}"])
    res.write(args.csv, append=not args.no_append)
    if not c["ok"]:
        sys.exit(1)
    return res.rows


if __name__ == "__main__":
    main()
