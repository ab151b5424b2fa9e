"""MoE layer benchmark: the layer's fwd+bwd time over its grouped GEMMs' time, and the rest.

    python tools/bench_moe_layer.py                      # GPU, bf16 autocast, anchor shapes
    TRITON_INTERPRET=1 python tools/bench_moe_layer.py --device cpu --quick --no-append

For each anchor shape (E experts, H model dim, F expert FFN dim, top-k), token count and
kernel backend (triton, torch), a dropless MoE layer (moetrain.model.MoELayer, fp32
parameters, bf16 autocast on CUDA as in training) runs forward + backward, and so does
each of its phases on the same tensors:

    router    the fp32 gate and top-k routing, backward from weights, scores and lse
    dispatch  permute into expert order + unpermute (combine), forward and backward
    experts   the grouped SwiGLU experts: weight casts, 3 grouped GEMMs fwd, 6 bwd, SwiGLU
    gemms     the experts' 9 grouped GEMMs alone, on weights already in the compute dtype

Rows: each phase's ms; `layer/gemms` (ratio_ceiling = layer time / GEMM time; target
<= 1.15); `experts-gemms` (casts and SwiGLU); `rest` = layer - router - dispatch - experts
(dispatch plan, balancing losses, statistics, launch gaps); `host_syncs` (CUDA only: the
synchronising calls in one layer fwd+bwd, counted by torch.cuda.set_sync_debug_mode). A
torch.profiler table of the layer's top ops goes to --log-dir when given.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from moetrain.kernels import grouped_mm  # noqa: E402

from moetrain.config import load_config  # noqa: E402
from moetrain.model import MoELayer  # noqa: E402

TARGET_LAYER_OVER_GEMMS = 1.15


class RecordingDispatcher:
    """The layer's own dispatcher, keeping the last plan and expert offsets it saw, so the
    phases can be re-run on exactly the layer's routing (the dispatcher is the seam)."""

    def __init__(self, inner):
        self.inner = inner
        self.plan = None
        self.offs_E: torch.Tensor | None = None

    def start_dispatch(self, x_TD, plan, backend):
        self.plan = plan
        return self.inner.start_dispatch(x_TD, plan, backend)

    def finish_dispatch(self, flight, side=None):
        x_ND, offs_E, side_out = self.inner.finish_dispatch(flight, side)
        self.offs_E = offs_E
        return x_ND, offs_E, side_out

    def pop_comm_bytes(self) -> float:
        return self.inner.pop_comm_bytes()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build_layer(num_experts: int, hidden: int, ffn: int, top_k: int, backend: str,
                device: torch.device) -> MoELayer:  # fmt: skip
    """A dropless MoE layer with the default router and losses, through the public config."""
    cfg = load_config(None, [
        f"moe.num_experts={num_experts}", f"moe.top_k={top_k}", f"moe.expert_ffn_dim={ffn}",
        "moe.capacity_factor=null", "moe.num_shared_experts=0", f"moe.kernels={backend}",
    ])  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(hidden, cfg.moe).to(device)
    layer.install_dispatcher(RecordingDispatcher(layer.dispatcher))
    return layer


def _grad(outputs, inputs, grads):
    outs = [o for o in outputs if o.requires_grad]
    gs = [g for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    return torch.autograd.grad(outs, inputs, gs, allow_unused=True)


def count_host_syncs(fn) -> tuple[int, list[str]]:
    """Synchronising CUDA calls made by fn() (torch.cuda.set_sync_debug_mode warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()  # not counted: set_sync_debug_mode ignores explicit syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return len(msgs), msgs


def bench_case(res, timer, args, name, shape, num_tokens, backend, log_dir):
    num_experts, hidden, ffn, top_k = shape
    dev = timer.device
    cdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    autocast = (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16) if dev.type == "cuda"
        else nullcontext()
    )  # fmt: skip
    layer = build_layer(num_experts, hidden, ffn, top_k, backend, dev)
    case = f"{name}/T{num_tokens}"
    x_BSD = torch.randn(1, num_tokens, hidden, device=dev, dtype=cdtype, requires_grad=True)
    dy_BSD = torch.randn(1, num_tokens, hidden, device=dev, dtype=cdtype)

    def layer_fn():
        # Fresh gradients each rep, as a step's first micro-batch: no accumulation kernels.
        layer.zero_grad(set_to_none=True)
        x_BSD.grad = None
        with autocast:
            y = layer(x_BSD)
        y.backward(dy_BSD)

    layer_fn()  # records the plan and offsets the phases reuse
    rec = layer.dispatcher
    x_TD = x_BSD.detach().view(num_tokens, hidden).requires_grad_()
    with autocast:
        r = layer.router(x_TD, backend)
    r_grads = [torch.randn_like(t) for t in (r.weights_TK, r.scores_TE, r.lse_T)]
    gate = layer.router.gate.weight

    def router_fn():
        with autocast:
            o = layer.router(x_TD, backend)
        _grad([o.weights_TK, o.scores_TE, o.lse_T], [x_TD, gate], r_grads)

    plan, offs_E = rec.plan, rec.offs_E
    num_rows = plan.num_rows
    weights_TK = r.weights_TK.detach().requires_grad_()
    y_rows = torch.randn(num_rows, hidden, device=dev, dtype=cdtype, requires_grad=True)
    d_rows = torch.randn(num_rows, hidden, device=dev, dtype=cdtype)

    def dispatch_fn():
        x_ND, _ = rec.inner.dispatch(x_TD, plan, backend)
        out_TD = rec.inner.combine(y_rows, plan, weights_TK, backend)
        _grad([x_ND, out_TD], [x_TD, y_rows, weights_TK], [d_rows, dy_BSD.view_as(x_TD)])

    x_ND = torch.randn(num_rows, hidden, device=dev, dtype=cdtype, requires_grad=True)

    def experts_fn():
        layer.zero_grad(set_to_none=True)
        x_ND.grad = None
        with autocast:
            y = layer.experts(x_ND, offs_E, backend)
        y.backward(d_rows)

    ws = [p.detach().to(cdtype).requires_grad_() for p in (layer.experts.w1, layer.experts.w3,
                                                          layer.experts.w2)]  # fmt: skip
    h_NF = torch.randn(num_rows, ffn, device=dev, dtype=cdtype, requires_grad=True)
    g_up = torch.randn(num_rows, ffn, device=dev, dtype=cdtype)

    def gemms_fn():
        y1 = grouped_mm(x_ND, ws[0], offs_E, backend=backend)
        y3 = grouped_mm(x_ND, ws[1], offs_E, backend=backend)
        y2 = grouped_mm(h_NF, ws[2], offs_E, backend=backend)
        torch.autograd.grad([y1, y3, y2], [x_ND, h_NF, *ws], [g_up, g_up, d_rows])

    ms = {}
    for phase, fn in (("layer", layer_fn), ("router", router_fn), ("dispatch", dispatch_fn),
                      ("experts", experts_fn), ("gemms", gemms_fn)):  # fmt: skip
        ms[phase] = timer(fn)
        layer.zero_grad(set_to_none=True)
    gemm_flops = 3 * 3 * 2 * num_rows * hidden * ffn  # 3 GEMMs, each fwd + dgrad + wgrad
    where = {"case": case, "routing": "layer-router", "dtype": cdtype}
    for phase in ("layer", "router", "dispatch", "experts"):
        res.add(**where, op=phase, impl=backend, ms=ms[phase])
    res.add(**where, op="gemms", impl=backend, ms=ms["gemms"],
            tflops=gemm_flops / (ms["gemms"] * 1e-3) / 1e12)  # fmt: skip
    res.add(**where, op="experts-gemms", impl=backend,
            ms=ms["experts"] - ms["gemms"])  # fmt: skip
    rest = ms["layer"] - ms["router"] - ms["dispatch"] - ms["experts"]
    res.add(**where, op="rest", impl=backend, ms=rest)
    ratio = ms["layer"] / ms["gemms"]
    res.add(**where, op="layer/gemms", impl=backend,
            value=ratio, unit=f"layer time / GEMM time (target <= {TARGET_LAYER_OVER_GEMMS})",
            status="ok")  # fmt: skip
    if dev.type == "cuda":
        n_syncs, msgs = count_host_syncs(layer_fn)
        res.add(**where, op="host_syncs", impl=backend,
                value=n_syncs, unit="synchronising calls per layer fwd+bwd")  # fmt: skip
        for m in sorted(set(msgs)):
            print(f"#   sync: {m}")
    if log_dir:
        _profile(layer_fn, dev, os.path.join(log_dir, f"layer_profile_{name}_{backend}.txt"))


def _profile(fn, dev: torch.device, path: str) -> None:
    """A torch.profiler table of fn's top ops (3 calls), sorted by device or CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))
    print(f"# profile written to {path}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--log-dir", default=None, help="where profiler tables go")
    parser.add_argument("--backends", nargs="*", default=None, help="triton and/or torch")
    extra, rest = parser.parse_known_args(argv)
    args = bc.parse_args(rest, __doc__.splitlines()[0])
    if args.tokens == [8192, 16384] and not args.quick:
        args.tokens = [16384]
    if args.quick:
        args.tokens = [t for t in args.tokens if t <= 256] or [64]
    device = torch.device(args.device)
    timer = bc.Timer(device, args.reps)
    res = bc.Results("moe_layer", device)
    backends = extra.backends or (["triton", "torch"] if bc.triton_usable(device) else ["torch"])
    for name, shape in bc.shapes_for(args).items():
        for num_tokens in args.tokens:
            for backend in backends:
                bench_case(res, timer, args, name, shape, num_tokens, backend, extra.log_dir)
                res.write(args.csv, append=not args.no_append)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    res.write(args.csv, append=not args.no_append)
    return res.rows


if __name__ == "__main__":
    main()
