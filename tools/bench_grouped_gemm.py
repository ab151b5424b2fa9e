"""Grouped GEMM benchmark: Triton vs torch._grouped_mm vs per-expert loop vs dense ceiling.

    python tools/bench_grouped_gemm.py                     # GPU, anchor shapes, bf16
    TRITON_INTERPRET=1 python tools/bench_grouped_gemm.py --device cpu --quick --no-append

For each shape (E experts, H model dim, F expert FFN dim, top-k), token count and routing
(uniform, Zipf-skewed), both expert GEMMs (up: H->F, down: F->H) are timed as fwd, dgrad,
wgrad, bwd (autograd: dgrad + wgrad) and fwd+bwd. TFLOP/s count only real routed rows.
The dense ceiling is a plain matmul with the same FLOPs, measured in the same run.
Each Triton row records its speed-up over `torch._grouped_mm` (peer, ratio_peer) and the
relative error of its fwd/dgrad/wgrad output against that peer (value, unit rel_err; status
"mismatch" past the dtype's bound), so the autotuned configs are checked on these shapes too.
MegaBlocks' grouped GEMM (the `grouped_gemm` package, its CUTLASS dependency) joins the
comparison when it imports; no wheel of it exists, see docs/benchmarks.md.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from moetrain.kernels import grouped_mm  # noqa: E402

# Relative Frobenius error allowed between two implementations of one GEMM (METHOD: bf16
# operands land between 1e-3 and 1e-2; fp32 with full-precision products far under 1e-3).
REL_ERR_BOUND = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def _megablocks_gmm():
    """MegaBlocks' grouped GEMM backend (package `grouped_gemm`) as (fwd, dgrad, wgrad)
    makers, or None when it does not import (it has no wheel; see docs/benchmarks.md)."""
    try:
        from grouped_gemm import backend
    except Exception as exc:  # missing package or unbuilt CUDA extension: the peer is absent
        print(f"# grouped_gemm (MegaBlocks) not available: {type(exc).__name__}: {exc}")
        return None
    return backend.gmm


def _loop_fns(x_NK, w_EKM, dy_NM, sizes):
    """The per-expert loop (host-side splits, as a naive MoE layer would have them)."""

    def fwd():
        return torch.cat([a @ w_EKM[e] for e, a in enumerate(x_NK.split(sizes))])

    def dgrad():
        return torch.cat([g @ w_EKM[e].t() for e, g in enumerate(dy_NM.split(sizes))])

    def wgrad():
        return torch.stack(
            [a.t() @ g for a, g in zip(x_NK.split(sizes), dy_NM.split(sizes), strict=True)]
        )

    return fwd, dgrad, wgrad


def _native_fns(x_NK, w_EKM, dy_NM, offs_E):
    def fwd():
        return torch._grouped_mm(x_NK, w_EKM, offs=offs_E)

    def dgrad():
        return torch._grouped_mm(dy_NM, w_EKM.transpose(1, 2), offs=offs_E)

    def wgrad():
        return torch._grouped_mm(x_NK.t(), dy_NM, offs=offs_E)

    return fwd, dgrad, wgrad


def _triton_fns(x_NK, w_EKM, dy_NM, offs_E):
    from moetrain.kernels.grouped_gemm import triton_backend as gg

    num_rows = x_NK.shape[0]

    def fwd():
        return gg.launch_grouped_mm(x_NK, None, w_EKM, offs_E, num_rows)

    def dgrad():
        return gg.launch_grouped_mm(dy_NM, None, w_EKM.transpose(1, 2), offs_E, num_rows)

    def wgrad():
        return gg.launch_grouped_wgrad(x_NK, None, dy_NM, offs_E, w_EKM.dtype)

    return fwd, dgrad, wgrad


def _autograd_fns(op, x_NK, w_EKM, dy_NM):
    """bwd (graph built once, reused) and fwd+bwd through autograd."""
    x = x_NK.detach().requires_grad_()
    w = w_EKM.detach().requires_grad_()
    y = op(x, w)

    def bwd():
        return torch.autograd.grad(y, (x, w), dy_NM, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(op(x, w), (x, w), dy_NM)

    return bwd, fwd_bwd


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_case(res, timer, case, routing_name, rt, k_dim, m_dim, dtype, impls, mb_gmm):
    dev = timer.device
    num_rows = rt.src_N.shape[0]
    num_experts = rt.offs_E.shape[0]
    sizes = rt.counts_E.tolist()
    x_NK = torch.randn(num_rows, k_dim, device=dev, dtype=dtype)
    w_EKM = torch.randn(num_experts, k_dim, m_dim, device=dev, dtype=dtype) / k_dim**0.5
    dy_NM = torch.randn(num_rows, m_dim, device=dev, dtype=dtype)
    flops = 2 * num_rows * k_dim * m_dim
    ceiling = bc.dense_tflops(timer, num_rows, k_dim, m_dim, dtype)
    res.add(case=case, routing=routing_name, dtype=dtype, op="fwd", impl="dense",
            ms=flops / ceiling / 1e9, tflops=ceiling, ceiling=ceiling)  # fmt: skip

    fns = {}
    if "triton" in impls:
        fns["triton"] = _triton_fns(x_NK, w_EKM, dy_NM, rt.offs_E) + _autograd_fns(
            lambda x, w: grouped_mm(x, w, rt.offs_E, backend="triton"), x_NK, w_EKM, dy_NM
        )
    try:
        native = _native_fns(x_NK, w_EKM, dy_NM, rt.offs_E)
        native[0]()
        fns["torch_gmm"] = native + _autograd_fns(
            lambda x, w: torch._grouped_mm(x, w, offs=rt.offs_E), x_NK, w_EKM, dy_NM
        )
    except (RuntimeError, AttributeError) as exc:
        print(f"# torch._grouped_mm unavailable here for {dtype}: {str(exc).splitlines()[0]}")
    fns["loop"] = _loop_fns(x_NK, w_EKM, dy_NM, sizes) + (None, None)
    if mb_gmm is not None:
        sizes_cpu = rt.counts_E.cpu()
        fns["megablocks"] = (
            lambda: mb_gmm(x_NK, w_EKM, sizes_cpu),
            lambda: mb_gmm(dy_NM, w_EKM, sizes_cpu, trans_b=True),
            lambda: mb_gmm(x_NK, dy_NM, sizes_cpu, trans_a=True),
            None, None,
        )  # fmt: skip

    # Correctness of each impl's fwd/dgrad/wgrad against torch._grouped_mm (else the loop).
    ref_impl = "torch_gmm" if "torch_gmm" in fns else "loop"
    refs = [fn() for fn in fns[ref_impl][:3]]
    errors: dict[tuple[str, str], float] = {}
    for impl, impl_fns in fns.items():
        if impl == ref_impl:
            continue
        for op, fn, ref in zip(("fwd", "dgrad", "wgrad"), impl_fns[:3], refs, strict=True):
            try:
                errors[(impl, op)] = _rel_err(fn(), ref)
            except RuntimeError as exc:
                print(f"# {impl} {op} failed: {str(exc).splitlines()[0]}")
    del refs

    op_flops = {"fwd": flops, "dgrad": flops, "wgrad": flops, "bwd": 2 * flops,
                "fwd+bwd": 3 * flops}  # fmt: skip
    for impl, impl_fns in fns.items():
        for op, fn in zip(op_flops, impl_fns, strict=True):
            if fn is None:
                continue
            try:
                ms = timer(fn)
            except RuntimeError as exc:  # a peer lacking this op/dtype must not end the run
                print(f"# {impl} {op} failed: {str(exc).splitlines()[0]}")
                continue
            tflops = op_flops[op] / (ms * 1e-3) / 1e12
            err = errors.get((impl, op))
            bad = err is not None and not err <= REL_ERR_BOUND[dtype]  # NaN is bad too
            res.add(case=case, routing=routing_name, dtype=dtype, op=op, impl=impl, ms=ms,
                    tflops=tflops, ceiling=ceiling, value=err,
                    unit=f"rel_err vs {ref_impl}" if err is not None else "",
                    status="mismatch" if bad else "ok")  # fmt: skip
    for op in op_flops:
        for peer in ("torch_gmm", "loop", "megablocks"):
            res.ratio(case, routing_name, op, "triton", peer, record=peer == "torch_gmm")
        res.ratio(case, routing_name, op, "megablocks", "torch_gmm", record=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = bc.parse_args(argv, __doc__.splitlines()[0])
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = bc.Timer(device, args.reps)
    res = bc.Results("grouped_gemm", device)
    impls = ["triton"] if bc.triton_usable(device) else []
    if not impls:
        print("# triton skipped: needs CUDA, or TRITON_INTERPRET=1 on CPU")
    mb_gmm = _megablocks_gmm() if device.type == "cuda" else None
    for name, (num_experts, hidden, ffn, top_k) in bc.shapes_for(args).items():
        for num_tokens in args.tokens:
            for routing_name in ("uniform", "zipf"):
                rt = bc.make_routing(num_tokens, num_experts, top_k, routing_name, device)
                projections = (("up", (hidden, ffn)), ("down", (ffn, hidden)))
                for proj, (k_dim, m_dim) in projections[: 1 if args.quick else 2]:
                    case = f"{name}/T{num_tokens}/{proj}"
                    bench_case(res, timer, case, routing_name, rt, k_dim, m_dim, dtype, impls,
                               mb_gmm)  # fmt: skip
                    res.write(args.csv, append=not args.no_append)
    _print_skew(res)
    res.write(args.csv, append=not args.no_append)
    return res.rows


def _print_skew(res) -> None:
    """Skew robustness: Zipf TFLOP/s / uniform TFLOP/s per case and op (target >= 0.95)."""
    figs = {(r["case"], r["routing"], r["op"], r["impl"]): float(r["tflops"]) for r in res.rows}
    for (case, routing, op, impl), tflops in sorted(figs.items()):
        if routing == "zipf" and impl in ("triton", "torch_gmm"):
            uniform = figs.get((case, "uniform", op, impl))
            if uniform:
                print(f"skew {case:24s} {op:8s} {impl:10s} zipf/uniform = {tflops / uniform:.2f}")


if __name__ == "__main__":
    main()
