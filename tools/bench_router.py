"""Router benchmark: fused Triton top-k router vs the unfused torch router, and vs HBM.

    python tools/bench_router.py                     # GPU
    TRITON_INTERPRET=1 python tools/bench_router.py --device cpu --quick --no-append

Cases are the routers of the anchor models (the router of DeepSeek-V3 scores all 256
experts with sigmoid + selection bias). fwd, bwd (gradients from weights, scores and lse
all at once, as the MoE layer's losses produce them) and fwd+bwd. GB/s counts the bytes
each pass must move at least; the ceiling is the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from moetrain.kernels import route  # noqa: E402

# name: (E, top_k, score_func, selection bias)
ROUTERS = {
    "mixtral": (8, 2, "softmax", False),
    "qwen3-30b-a3b": (128, 8, "softmax", False),
    "deepseek-v3": (256, 8, "sigmoid", True),
}
QUICK_ROUTERS = {
    "tiny-softmax": (16, 4, "softmax", False),
    "tiny-sigmoid": (16, 4, "sigmoid", True),
}


def _bytes(num_tokens: int, num_experts: int, top_k: int) -> dict[str, int]:
    te, tk = num_tokens * num_experts * 4, num_tokens * top_k
    fwd = te + te + tk * (4 + 8) + num_tokens * 4  # logits in; scores, weights, ids, lse out
    bwd = te + te + tk * (4 + 8) + num_tokens * 4 + te  # logits, dscores, dw, ids, dlse; dlogits
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


def bench_case(res, timer, name, num_tokens, cfg, impls, ceiling):
    num_experts, top_k, score_func, has_bias = cfg
    dev = timer.device
    logits = torch.randn(num_tokens, num_experts, device=dev, requires_grad=True)
    bias = 0.01 * torch.randn(num_experts, device=dev) if has_bias else None
    case = f"{name}/T{num_tokens}"
    nbytes = _bytes(num_tokens, num_experts, top_k)
    # One set of upstream gradients (weights, scores, lse), shared by every impl.
    grads_out = [
        torch.randn(num_tokens, top_k, device=dev),
        torch.randn(num_tokens, num_experts, device=dev),
        torch.randn(num_tokens, device=dev),
    ]
    for impl in impls:
        backend = "triton" if impl == "triton" else "torch"

        def fwd(backend=backend):
            return route(logits, top_k, score_func=score_func, expert_bias_E=bias,
                         backend=backend)  # fmt: skip

        out = fwd()

        def bwd(out=out):
            return torch.autograd.grad(
                [out.weights_TK, out.scores_TE, out.lse_T], logits, grads_out, retain_graph=True
            )

        def fwd_bwd(fwd=fwd):
            o = fwd()
            return torch.autograd.grad([o.weights_TK, o.scores_TE, o.lse_T], logits, grads_out)

        for op, fn in (("fwd", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd)):
            ms = timer(fn)
            gbs = nbytes[op] / (ms * 1e-3) / 1e9
            res.add(case=case, routing=score_func, dtype=torch.float32, op=op, impl=impl, ms=ms,
                    gbs=gbs, ceiling=ceiling)  # fmt: skip
    for op in nbytes:
        res.ratio(case, score_func, op, "triton", "torch", record=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = bc.parse_args(argv, __doc__.splitlines()[0])
    if args.tokens == [8192, 16384] and not args.quick:
        args.tokens = [8192, 16384, 65536]
    device = torch.device(args.device)
    timer = bc.Timer(device, args.reps)
    res = bc.Results("router", device)
    ceiling = bc.copy_bandwidth_gbs(timer, args.quick)
    res.add(case="copy", routing="-", dtype=torch.float32, op="copy", impl="memcpy",
            ms=0.0, gbs=ceiling, ceiling=ceiling)  # fmt: skip
    impls = ["triton", "torch"] if bc.triton_usable(device) else ["torch"]
    routers = QUICK_ROUTERS if args.quick else ROUTERS
    if args.shapes:
        routers = {k: v for k, v in routers.items() if k in args.shapes}
    for name, cfg in routers.items():
        for num_tokens in args.tokens:
            bench_case(res, timer, name, num_tokens, cfg, impls, ceiling)
            res.write(args.csv, append=not args.no_append)
    res.write(args.csv, append=not args.no_append)
    return res.rows


if __name__ == "__main__":
    main()
