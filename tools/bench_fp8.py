"""FP8 against BF16 in one run: the expert grouped GEMMs on the anchor shapes, a dense
linear, and end-to-end training.

    python tools/bench_fp8.py                            # GPU: anchor shapes + configs/gpu_1b.yaml
    python tools/bench_fp8.py --device cpu --quick --no-append   # smoke test (CPU)

Grouped GEMM (benchmark "fp8_gemm"): for each anchor shape (tools/bench_common.py), token
count and projection (up: H -> F, down: F -> H), uniform routing, the bf16 grouped GEMM the
MoE layer runs without FP8 (``moetrain.kernels.grouped_mm``, torch backend:
``torch._grouped_mm``) against ``fp8_grouped_mm`` of each recipe on the ``scaled_mm``
backend (``torch._scaled_grouped_mm``), ops fwd, bwd (autograd: dgrad in FP8 + the bf16
wgrad) and fwd+bwd, every FP8 cast included in the time. Rows: TFLOP/s of the real routed
rows, the speed-up over bf16 measured in this run (peer "bf16", ratio_peer), and the
forward's relative error against bf16 (value, unit rel_err). A dense linear of the
shape's H -> F runs the same way (case ".../linear", ``fp8_linear`` against ``F.linear``).

End to end (benchmark "fp8_e2e"): configs/gpu_1b.yaml (``--config``) trained ``--steps``
steps with ``train.fp8`` none, tensorwise and rowwise, each a fresh Trainer on the same
seed and batches (``tools/bench_e2e.py``'s variant runner): tokens/s, MFU, peak memory and
the final loss per variant, and tokens/s over the bf16 run's (op "speedup_vs_bf16").

Published figures to hold these against (docs/fp8.md): FP8 grouped GEMMs 1.15-1.3x BF16 on
DeepSeek-V3 shapes (torchao, MXFP8 on B200), +20-30 % end to end (torchtitan; Megatron-Bridge
DeepSeek-V3 on GB200). They are not measured here until this runs on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import bench_e2e  # noqa: E402
from moetrain.kernels import fp8, grouped_mm  # noqa: E402

RECIPES = ("tensorwise", "rowwise")
E2E_VARIANTS = ("none", *RECIPES)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _timed_ops(op, x, w, dy):
    """fwd, bwd (one graph, reused) and fwd+bwd of ``op(x, w)`` through autograd."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = op(x, w)

    def fwd():
        with torch.no_grad():
            return op(x, w)

    def bwd():
        return torch.autograd.grad(y, (x, w), dy, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(op(x, w), (x, w), dy)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def bench_gemm(res, timer, case, rows, k_dim, m_dim, offs_E, backend, dtype):
    """One shape: bf16 vs each FP8 recipe, grouped (``offs_E`` given) or a dense linear."""
    dev = timer.device
    grouped = offs_E is not None
    num_experts = offs_E.shape[0] if grouped else 1
    x = torch.randn(rows, k_dim, device=dev, dtype=dtype)
    w = torch.randn(num_experts, k_dim, m_dim, device=dev) / k_dim**0.5  # fp32 master
    if not grouped:
        w = w[0].t().contiguous()  # a linear's (out, in) weight
    dy = torch.randn(rows, m_dim, device=dev, dtype=dtype)
    flops = 2 * rows * k_dim * m_dim
    op_flops = {"fwd": flops, "bwd": 2 * flops, "fwd+bwd": 3 * flops}

    def hp(x_, w_):
        if grouped:
            return grouped_mm(x_, w_.to(dtype), offs_E, backend="torch")
        return F.linear(x_, w_.to(dtype))

    impls = {"bf16": hp}
    for name in RECIPES:
        recipe = fp8.get_recipe(name)
        if grouped:
            impls[f"fp8_{name}"] = lambda x_, w_, r=recipe: fp8.fp8_grouped_mm(
                x_, w_, offs_E, r, backend
            )
        else:
            impls[f"fp8_{name}"] = lambda x_, w_, r=recipe: fp8.fp8_linear(x_, w_, None, r, backend)
    ref = hp(x, w).detach()
    for impl, op in impls.items():
        err = None if impl == "bf16" else _rel_err(op(x, w), ref)
        try:
            fns = _timed_ops(op, x, w, dy)
            for name, fn in fns.items():
                ms = timer(fn)
                shown = err if name == "fwd" else None
                res.add(case=case, routing="uniform", dtype=dtype, op=name, impl=impl, ms=ms,
                        tflops=op_flops[name] / (ms * 1e-3) / 1e12, value=shown,
                        unit="rel_err vs bf16" if shown is not None else "")  # fmt: skip
        except RuntimeError as exc:  # an FP8 kernel this device lacks must not end the run
            print(f"# {impl} failed: {str(exc).splitlines()[0]}")
            res.add(case=case, routing="uniform", dtype=dtype, op="fwd", impl=impl,
                    unit=str(exc).splitlines()[0][:120], status="fail")  # fmt: skip
    for name in op_flops:
        for impl in impls:
            if impl != "bf16":
                res.ratio(case, "uniform", name, impl, "bf16", record=True)


def run_e2e(res, args, device, start) -> None:
    """gpu_1b (or ``--config``) with train.fp8 none / tensorwise / rowwise."""
    e2e_args = argparse.Namespace(
        config=args.config, device=args.device, steps=args.steps, warmup=args.warmup,
        log_dir=None, profile_steps=0,
    )  # fmt: skip
    overrides = (bench_e2e.QUICK_OVERRIDES if args.quick else []) + args.overrides
    ceiling = bench_e2e.measure_ceiling(device, args.quick)
    name = os.path.splitext(os.path.basename(args.config))[0]
    probe = bench_e2e.load_config(args.config, overrides)
    case = f"{name}/b{probe.train.global_batch_size}xs{probe.data.seq_len}"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    last_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for variant in E2E_VARIANTS:
            impl = f"fp8_{variant}" if variant != "none" else "bf16"
            left = (args.budget_s - (time.monotonic() - start)) if args.budget_s else None
            if left is not None and left < last_s:
                print(f"# {impl}: skipped, {left:.0f} s of the budget left, ~{last_s:.0f} needed")
                res.add(case=case, routing="-", dtype=dtype, op="step", impl=impl,
                        status="skipped")  # fmt: skip
                continue
            t0 = time.monotonic()
            try:
                bench_e2e.run_variant(res, e2e_args, [*overrides, f"train.fp8={variant}"],
                                      ("auto", False), ceiling, case, tmp, impl=impl)  # fmt: skip
            except Exception as exc:  # OOM or a missing kernel: the other variants still run
                traceback.print_exc()
                status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"
                res.add(case=case, routing="-", dtype=dtype, op="step", impl=impl,
                        unit=f"{type(exc).__name__}: {str(exc)[:120]}", status=status)  # fmt: skip
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            last_s = max(last_s, time.monotonic() - t0)
            res.write(args.csv, append=not args.no_append)
    base = next((r for r in res.rows if r["op"] == "tokens_per_s" and r["impl"] == "bf16"), None)
    for r in [r for r in res.rows if r["op"] == "tokens_per_s" and r["impl"] != "bf16"]:
        if base and r["value"] and float(base["value"]) > 0:
            speedup = float(r["value"]) / float(base["value"])
            res.add(case=case, routing="-", dtype=dtype, op="speedup_vs_bf16", impl=r["impl"],
                    value=speedup, unit="tokens/s over the bf16 run's")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and model (CPU)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts T")
    parser.add_argument("--shapes", nargs="*", default=None, help="subset of anchor shapes")
    parser.add_argument("--parts", nargs="*", default=["gemm", "e2e"], choices=["gemm", "e2e"])
    parser.add_argument("--config", default=os.path.join(bc.REPO, "configs", "gpu_1b.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="e2e steps a variant (30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed e2e steps (8)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip what would not fit")
    parser.add_argument("--csv", default=bc.DEFAULT_CSV)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides (e2e)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick)")
    args.reps = args.reps or (1 if args.quick else 20)
    args.tokens = args.tokens or ([64] if args.quick else [16384])
    args.steps = args.steps or (3 if args.quick else 30)
    args.warmup = min(args.warmup if args.warmup is not None else (1 if args.quick else 8),
                      args.steps - 1)  # fmt: skip
    start = time.monotonic()
    device = torch.device(args.device)
    backend = fp8.resolve_backend("scaled_mm", device)
    if "gemm" in args.parts:
        res = bc.Results("fp8_gemm", device)
        timer = bc.Timer(device, args.reps)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        table = bc.shapes_for(argparse.Namespace(quick=args.quick, shapes=args.shapes))
        for name, (num_experts, hidden, ffn, top_k) in table.items():
            for num_tokens in args.tokens:
                rt = bc.make_routing(num_tokens, num_experts, top_k, "uniform", device)
                rows = rt.src_N.shape[0]
                for proj, (k_dim, m_dim) in (("up", (hidden, ffn)), ("down", (ffn, hidden))):
                    bench_gemm(res, timer, f"{name}/T{num_tokens}/{proj}", rows, k_dim, m_dim,
                               rt.offs_E, backend, dtype)  # fmt: skip
                    res.write(args.csv, append=not args.no_append)
                bench_gemm(res, timer, f"{name}/T{num_tokens}/linear", num_tokens, hidden, ffn,
                           None, backend, dtype)  # fmt: skip
                res.write(args.csv, append=not args.no_append)
        rows_out = res.rows
    else:
        rows_out = []
    if "e2e" in args.parts:
        res = bc.Results("fp8_e2e", device)
        run_e2e(res, args, device, start)
        res.write(args.csv, append=not args.no_append)
        rows_out += res.rows
    return rows_out


if __name__ == "__main__":
    main()
