"""End to end on one GPU: a coarse ~1.8B MoE trained in bf16, five variants in one run.

    python tools/bench_e2e.py                         # GPU: configs/gpu_1b.yaml, 50 steps each
    TRITON_INTERPRET=1 python tools/bench_e2e.py --device cpu --quick --no-append

Variants: moe.kernels = triton | torch, each with train.compile off and on, and triton
eager with routing forced to perfect balance (moe.force_load_balancing, a benchmark run:
impl "triton/eager/balanced"; on a CPU dry run torch/eager/balanced), every one a fresh
moetrain Trainer on the same config, seed and batches (train_step only: no eval, no
checkpoint). The first --warmup steps (compilation, autotuning, allocator growth) are not
timed. Rows per variant (impl "<kernels>/<eager|compile>[/balanced]"):

    step            median step ms; TFLOP/s of model FLOPs; ratio_ceiling = MFU
    tokens_per_s    trained tokens per second over the timed steps
    mfu             tokens/s x FLOPs per token / the bf16 dense-matmul ceiling measured at
                    the start of this run (an 8192^3 matmul); FLOPs per token are
                    Transformer.flops_per_token: 6 x active parameters + causal attention
    mfu_datasheet   the same against the trainer's datasheet peak (989 TFLOP/s on H100/H200)
    peak_mem_gib    torch.cuda.max_memory_allocated over the timed steps
    analytic_mem_gib  16 B/param model state (fp32 weights, grads, Adam m, v) + per layer
                    s*b*h*(34 + 5*a*s/h) activation bytes (b = micro-batch), the dense-GPT
                    formula: MoE layers and SDPA differ, so read the ratio as a yardstick
    mem_ratio       peak / analytic
    final_loss      mean loss of the last 5 steps (the variants should agree; not the
                    balanced one, whose routing ignores the router)
    plan_step       ``moetrain plan``'s estimated step of the same config on this GPU (ms;
                    on a CPU dry run the h100 constants), value = measured / planned step
    part/<part>     with --log-dir, a profile of --profile-steps more steps (eager
                    variants: each matmul labelled by class, ``moetrain.plan.stepmix.
                    MatmulLabels``): device ms per step of each part of the step (expert
                    GEMMs, attention, other matmuls, elementwise and copies, optimizer;
                    ``breakdown``), value = the plan's ms for that part; printed side by side

The profile's table (top ops by device time) is written to --log-dir as well.
--budget-s skips the variants that would not fit.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from moetrain.config import load_config  # noqa: E402
from moetrain.train.trainer import Trainer  # noqa: E402

TARGET_MFU = 0.45
VARIANTS = [("triton", False), ("torch", False), ("triton", True), ("torch", True),
            ("triton", False, "balanced")]  # fmt: skip
BALANCED = ["moe.force_load_balancing=true", "train.benchmark=true"]
# --quick (CPU): a model the Triton interpreter runs in seconds.
QUICK_OVERRIDES = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=128", "model.max_seq_len=32", "moe.num_experts=4", "moe.top_k=2",
    "moe.expert_ffn_dim=64", "train.micro_batch_size=2", "train.global_batch_size=4",
    "data.seq_len=16",
]  # fmt: skip
GIB = 2**30


def analytic_memory(cfg, n_params: int) -> tuple[float, float]:
    """(model-state bytes, activation bytes) of the analytic formulas for this config."""
    s, b, h, a = cfg.data.seq_len, cfg.train.micro_batch_size, cfg.model.dim, cfg.model.n_heads
    activations = cfg.model.n_layers * s * b * h * (34 + 5 * a * s / h)
    return 16.0 * n_params, float(activations)


PARTS = ("expert GEMMs", "attention", "other matmuls", "elementwise and copies", "optimizer")
LABELS = {"moetrain::experts": "expert GEMMs", "moetrain::attention": "attention",
          "moetrain::matmul": "other matmuls"}  # fmt: skip
MATMUL_OPS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::addmv",
    "aten::mv", "aten::_scaled_mm", "aten::_scaled_grouped_mm",
}  # fmt: skip
TRITON_GEMMS = ("_grouped_mm_kernel", "_grouped_wgrad_kernel")
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(cell: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", cell.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0


def _fp32_gemm(name: str) -> bool:
    """A cuBLAS / CUTLASS fp32 GEMM kernel (SIMT sgemm, or f32 operands throughout)."""
    return "sgemm" in name or "f32f32_f32f32" in name or "gemm_f32" in name


def breakdown(table: str, steps: int, fp32_matmuls: str | None = None) -> dict[str, float]:
    """Device ms per step of each part (``PARTS``) from a torch.profiler ``key_averages``
    table (``_profile``'s, sorted by device time) of ``steps`` steps.

    expert GEMMs, attention, other matmuls: the CUDA time of the ``moetrain::<class>``
    ranges (``MatmulLabels``) when the profile has them; else the Triton grouped-GEMM
    kernels are the experts', every other matmul op (``MATMUL_OPS``, self time) is an other
    matmul unless ``fp32_matmuls`` names the part its fp32 GEMM kernels belong to (a profile
    of the code whose experts ran in fp32), and attention is the ops named so. optimizer:
    the ``Optimizer.step`` ranges. elementwise and copies: the rest of the device total.
    Also "device total" and "unlisted" (device time below the table's last row)."""
    header, rows, total = None, [], 0.0
    for line in table.splitlines():
        if line.strip().startswith("Name") and "Self CUDA" in line:
            header = [h.strip() for h in re.split(r"\s{2,}", line.strip())]
            continue
        m = re.match(r"\s*Self CUDA time total:\s*(\S+)", line)
        if m:
            total = _ms(m.group(1))
            continue
        if header is None or not line.strip() or set(line.strip()) <= {"-", " "}:
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            continue
        rows.append(dict(zip(header, cells, strict=True)))
    out = dict.fromkeys(PARTS, 0.0)
    kernel_ms = 0.0
    matmul_ops = fp32 = 0.0
    labelled = any(r["Name"] in LABELS for r in rows)
    for r in rows:
        name, self_cuda, cuda = r["Name"], _ms(r["Self CUDA"]), _ms(r["CUDA total"])
        is_kernel = _ms(r["CPU total"]) == 0.0
        kernel_ms += self_cuda if is_kernel else 0.0
        if name in LABELS:
            out[LABELS[name]] += cuda
        elif name.startswith("Optimizer.step"):
            out["optimizer"] += cuda
        elif labelled:
            continue
        elif is_kernel and any(k in name for k in TRITON_GEMMS):
            out["expert GEMMs"] += self_cuda
        elif is_kernel and _fp32_gemm(name):
            fp32 += self_cuda
        elif name in MATMUL_OPS:
            matmul_ops += self_cuda
        elif not is_kernel and "attention" in name:
            out["attention"] += self_cuda
    if not labelled:
        if fp32_matmuls is not None:
            out[fp32_matmuls] += fp32
        out["other matmuls"] += matmul_ops - (fp32 if fp32_matmuls is not None else 0.0)
    listed = sum(out.values())
    out["elementwise and copies"] = max(total - listed, 0.0)
    result = {k: v / steps for k, v in out.items()}
    result["device total"] = total / steps
    result["unlisted"] = max(total - kernel_ms, 0.0) / steps
    return result


def _profile(trainer: Trainer, steps: int, path: str) -> str:
    """The profiler's table of ``steps`` more steps, written to ``path`` and returned; eager
    steps label each matmul by class (``MatmulLabels``)."""
    from torch.profiler import ProfilerActivity, profile

    from moetrain.plan.stepmix import MatmulLabels

    cuda = trainer.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    eager = not trainer.cfg.train.compile
    with profile(activities=acts) as prof:
        for _ in range(steps):
            if eager:
                with MatmulLabels(trainer.engine.parts):
                    trainer.train_step()
            else:
                trainer.train_step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=200, max_name_column_width=80)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)
    print(f"# profile written to {path}")
    return table


def _impl(variant: tuple) -> str:
    kernels, compile_, *extra = variant
    return "/".join([kernels, "compile" if compile_ else "eager", *extra])


def plan_step(cfg, device: torch.device) -> tuple[float, dict[str, float], str]:
    """``moetrain plan``'s estimated step of ``cfg`` on one GPU of this kind (ms), its parts
    (ms, ``PARTS``), and which GPU's constants (h100's where the device is not in the table:
    a CPU dry run)."""
    from moetrain.plan import hardware, planner
    from moetrain.train.engine import build_optimizers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    known = hardware.gpu_of_device(name)
    gpu = known.name if known is not None else "h100"
    plan = planner.plan(cfg, 1, build_optimizers, device_type="cuda", gpu=hardware.gpu(gpu))
    e = plan.ranks[0].estimate
    parts = {**{k: v * 1e3 for k, v in e.parts.items()}, "optimizer": e.optimizer_s * 1e3}
    return plan.step_s * 1e3, parts, gpu


def print_breakdown(measured: dict[str, float], planned: dict[str, float]) -> None:
    """The measured step's parts beside the plan's (ms per step)."""
    print(f"#   {'part':<24} {'measured':>10} {'planned':>10}")
    for part in PARTS:
        print(f"#   {part:<24} {measured.get(part, 0.0):>10.1f} {planned.get(part, 0.0):>10.1f}")
    print(f"#   {'device total':<24} {measured['device total']:>10.1f} "
          f"{sum(planned.values()):>10.1f}")  # fmt: skip


def run_variant(res, args, overrides, variant, ceiling, case, tmp, impl=None):
    """One variant's rows; ``impl`` names it (default ``_impl(variant)``)."""
    kernels, compile_, *extra = variant
    impl = impl or _impl(variant)
    balanced = BALANCED if "balanced" in extra else []
    cfg = load_config(args.config, [
        *overrides, *balanced, f"moe.kernels={kernels}", f"train.compile={str(compile_).lower()}",
        f"train.device={args.device}", f"train.steps={args.steps}", "train.eval_every=0",
        "log.tensorboard=false", "log.progress_bar=false",
        f"train.output_dir={os.path.join(tmp, impl.replace('/', '_'))}",
    ])  # fmt: skip
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    dtype = trainer.dtype
    print(f"# {impl}: {trainer.n_params / 1e9:.3f}B params, {trainer.n_active / 1e9:.3f}B "
          f"active, {trainer.flops_per_token / 1e9:.2f} GFLOP/token, built in "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    losses, times, tokens = [], [], 0
    for step in range(args.steps):
        if cuda and step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        r = trainer.train_step()
        losses.append(r.loss)
        if step >= args.warmup:
            times.append(r.seconds)
            tokens += r.tokens
        if step in (0, args.warmup - 1) or (step + 1) % 10 == 0:
            print(f"#   step {step + 1}: loss {r.loss:.4f}, {r.seconds * 1e3:.0f} ms")
    tok_s = tokens / sum(times)
    model_tflops = tok_s * trainer.flops_per_token / 1e12
    mfu = model_tflops / ceiling
    res.add(case=case, routing="-", dtype=dtype, op="step", impl=impl,
            ms=statistics.median(times) * 1e3, tflops=model_tflops, ceiling=ceiling)  # fmt: skip
    res.add(case=case, routing="-", dtype=dtype, op="tokens_per_s", impl=impl, value=tok_s,
            unit="tokens/s")  # fmt: skip
    res.add(case=case, routing="-", dtype=dtype, op="mfu", impl=impl, value=mfu,
            unit=f"of the measured dense ceiling {ceiling:.4g} TFLOP/s (target >= {TARGET_MFU})",
            status="ok")  # fmt: skip
    res.add(case=case, routing="-", dtype=dtype, op="mfu_datasheet", impl=impl,
            value=tok_s * trainer.flops_per_token / trainer.peak_flops,
            unit=f"of {trainer.peak_flops / 1e12:.4g} TFLOP/s ({trainer.peak_source})")  # fmt: skip
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        state, acts = analytic_memory(cfg, trainer.n_params)
        res.add(case=case, routing="-", dtype=dtype, op="peak_mem_gib", impl=impl,
                value=peak / GIB, unit="GiB (max_memory_allocated)")  # fmt: skip
        res.add(case=case, routing="-", dtype=dtype, op="analytic_mem_gib", impl=impl,
                value=(state + acts) / GIB,
                unit=f"GiB = state {state / GIB:.1f} + activations {acts / GIB:.1f}")  # fmt: skip
        res.add(case=case, routing="-", dtype=dtype, op="mem_ratio", impl=impl,
                value=peak / (state + acts), unit="peak / analytic")  # fmt: skip
    last = losses[-5:]
    res.add(case=case, routing="-", dtype=dtype, op="final_loss", impl=impl,
            value=sum(last) / len(last), unit="nats (mean of the last 5 steps)")  # fmt: skip
    planned_ms, parts, gpu = plan_step(cfg, trainer.device)
    measured_ms = statistics.median(times) * 1e3
    res.add(case=case, routing="forced balance" if balanced else "-", dtype=dtype,
            op="plan_step", impl=impl, ms=planned_ms, value=measured_ms / planned_ms,
            unit=f"measured / planned step (moetrain plan, {gpu} constants)")  # fmt: skip
    if args.log_dir and args.profile_steps:
        name = f"e2e_profile_{impl.replace('/', '_')}.txt"
        table = _profile(trainer, args.profile_steps, os.path.join(args.log_dir, name))
        if trainer.device.type == "cuda":
            measured = breakdown(table, args.profile_steps)
            print_breakdown(measured, parts)
            for part in PARTS:
                unit = f"device ms per step (profile); value: planned ms ({gpu})"
                res.add(case=case, routing="-", dtype=dtype, op=f"part/{part}", impl=impl,
                        ms=measured[part], value=parts[part], unit=unit)  # fmt: skip
    trainer.close()


def measure_ceiling(device: torch.device, quick: bool) -> float:
    """The dense matmul ceiling of this device now: bf16 8192^3 on CUDA, fp32 on CPU."""
    n = 256 if quick else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return bc.dense_tflops(bc.Timer(device, reps=3 if quick else 10), n, n, n, dtype)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(bc.REPO, "configs", "gpu_1b.yaml"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="per variant (default 50)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10)")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="triton/eager torch/eager triton/compile torch/compile "
                        "triton/eager/balanced")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None, help="skip what would not fit")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--csv", default=bc.DEFAULT_CSV)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick)")
    args.steps = args.steps or (3 if args.quick else 50)
    args.warmup = min(args.warmup if args.warmup is not None else (1 if args.quick else 10),
                      args.steps - 1)  # fmt: skip
    overrides = (QUICK_OVERRIDES if args.quick else []) + args.overrides
    if args.quick:
        args.profile_steps = min(args.profile_steps, 1)
    variants = VARIANTS
    if args.variants:
        variants = [v for v in VARIANTS if _impl(v) in args.variants]
    if args.quick:
        variants = [v for v in variants if not v[1]]  # compile costs minutes on CPU
    device = torch.device(args.device)
    if not bc.triton_usable(device):  # the torch path stands in, balanced variant included
        variants = [("torch", *v[1:]) if v[2:] else v for v in variants if v[0] != "triton"
                    or v[2:]]  # fmt: skip
    start = time.monotonic()
    res = bc.Results("e2e", device)
    ceiling = measure_ceiling(device, args.quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = os.path.splitext(os.path.basename(args.config))[0]
    probe = load_config(args.config, overrides)
    case = f"{name}/b{probe.train.global_batch_size}xs{probe.data.seq_len}"
    res.add(case=case, routing="-", dtype=dtype, op="dense_ceiling", impl="dense",
            tflops=ceiling, ceiling=ceiling)  # fmt: skip
    res.write(args.csv, append=not args.no_append)
    last_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            kernels, compile_ = variant[:2]
            impl = _impl(variant)
            left = (args.budget_s - (time.monotonic() - start)) if args.budget_s else None
            need = last_s * (2.0 if compile_ else 1.0)
            if left is not None and left < need:
                print(f"# {impl}: skipped, {left:.0f} s of the budget left, ~{need:.0f} s needed")
                res.add(case=case, routing="-", dtype=dtype, op="step", impl=impl,
                        status="skipped")  # fmt: skip
                continue
            t0 = time.monotonic()
            try:
                run_variant(res, args, overrides, variant, ceiling, case, tmp)
            except Exception as exc:  # one variant failing (OOM, compile) must not end the run
                traceback.print_exc()
                status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"
                res.add(case=case, routing="-", dtype=dtype, op="step", impl=impl,
                        value=None, unit=f"{type(exc).__name__}: {str(exc)[:120]}",
                        status=status)  # fmt: skip
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if compile_:
                    torch._dynamo.reset()
            last_s = max(last_s, time.monotonic() - t0)
            res.write(args.csv, append=not args.no_append)
    res.write(args.csv, append=not args.no_append)
    return res.rows


if __name__ == "__main__":
    main()
