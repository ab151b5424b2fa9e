"""Permute / unpermute benchmark: Triton vs the index_select/index_add torch path, vs HBM.

    python tools/bench_permutation.py                     # GPU, bf16
    TRITON_INTERPRET=1 python tools/bench_permutation.py --device cpu --quick --no-append

Token rows of the anchor models (H, top-k) are permuted into expert order (uniform
and Zipf routing) and combined back with routing weights. GB/s counts the bytes each pass
must move at least; the ceiling is the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from moetrain.kernels import permute, unpermute  # noqa: E402


def _bytes(num_tokens: int, num_rows: int, d_dim: int, top_k: int, es: int) -> dict[str, int]:
    td, nd, tk = num_tokens * d_dim * es, num_rows * d_dim * es, num_tokens * top_k
    permute_fwd = td + nd + tk * 8  # x in, rows out, dest in
    permute_bwd = nd + td + tk * 8  # drows in, dx out
    unpermute_fwd = nd + td + tk * 12  # rows in, out, dest + weights
    unpermute_bwd = td + nd + nd + tk * 16  # dout, rows in; drows out; dweights
    return {
        "permute_fwd": permute_fwd,
        "permute_bwd": permute_bwd,
        "permute_fwd+bwd": permute_fwd + permute_bwd,
        "unpermute_fwd": unpermute_fwd,
        "unpermute_bwd": unpermute_bwd,
        "unpermute_fwd+bwd": unpermute_fwd + unpermute_bwd,
    }


def bench_case(res, timer, case, routing_name, rt, d_dim, dtype, impls, ceiling):
    dev = timer.device
    num_tokens, top_k = rt.dest_TK.shape
    num_rows = num_tokens * top_k
    nbytes = _bytes(num_tokens, num_rows, d_dim, top_k, torch.finfo(dtype).bits // 8)
    x_TD = torch.randn(num_tokens, d_dim, device=dev, dtype=dtype, requires_grad=True)
    y_ND = torch.randn(num_rows, d_dim, device=dev, dtype=dtype, requires_grad=True)
    w_TK = torch.rand(num_tokens, top_k, device=dev, requires_grad=True)
    dout_ND = torch.randn(num_rows, d_dim, device=dev, dtype=dtype)
    dout_TD = torch.randn(num_tokens, d_dim, device=dev, dtype=dtype)
    dest = rt.dest_TK
    for impl in impls:
        b = impl

        def p_fwd(b=b):
            return permute(x_TD, dest, num_rows, backend=b)

        def u_fwd(b=b):
            return unpermute(y_ND, dest, w_TK, backend=b)

        p_out, u_out = p_fwd(), u_fwd()
        fns = {
            "permute_fwd": p_fwd,
            "permute_bwd": lambda p_out=p_out: torch.autograd.grad(
                p_out, x_TD, dout_ND, retain_graph=True
            ),
            "permute_fwd+bwd": lambda p_fwd=p_fwd: torch.autograd.grad(p_fwd(), x_TD, dout_ND),
            "unpermute_fwd": u_fwd,
            "unpermute_bwd": lambda u_out=u_out: torch.autograd.grad(
                u_out, (y_ND, w_TK), dout_TD, retain_graph=True
            ),
            "unpermute_fwd+bwd": lambda u_fwd=u_fwd: torch.autograd.grad(
                u_fwd(), (y_ND, w_TK), dout_TD
            ),
        }
        for op, fn in fns.items():
            ms = timer(fn)
            gbs = nbytes[op] / (ms * 1e-3) / 1e9
            res.add(case=case, routing=routing_name, dtype=dtype, op=op, impl=impl, ms=ms,
                    gbs=gbs, ceiling=ceiling)  # fmt: skip
    for op in nbytes:
        res.ratio(case, routing_name, op, "triton", "torch", record=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = bc.parse_args(argv, __doc__.splitlines()[0])
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = bc.Timer(device, args.reps)
    res = bc.Results("permute", device)  # the rows' label in every recorded run (benchmarks.csv)
    ceiling = bc.copy_bandwidth_gbs(timer, args.quick)
    res.add(case="copy", routing="-", dtype=torch.float32, op="copy", impl="memcpy",
            ms=0.0, gbs=ceiling, ceiling=ceiling)  # fmt: skip
    impls = ["triton", "torch"] if bc.triton_usable(device) else ["torch"]
    for name, (num_experts, hidden, _ffn, top_k) in bc.shapes_for(args).items():
        for num_tokens in args.tokens:
            for routing_name in ("uniform", "zipf"):
                rt = bc.make_routing(num_tokens, num_experts, top_k, routing_name, device)
                bench_case(res, timer, f"{name}/T{num_tokens}", routing_name, rt, hidden, dtype,
                           impls, ceiling)  # fmt: skip
                res.write(args.csv, append=not args.no_append)
    res.write(args.csv, append=not args.no_append)
    return res.rows


if __name__ == "__main__":
    main()
