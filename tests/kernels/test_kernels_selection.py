"""moe.kernels auto: the per-op choice from the measured table, and the kernels honouring it.

``choose`` is pure (an architecture, a shape, a table): checked here on hand-made tables and
on the committed one. The device side (a faked H100 / B200, the start-up log) is in
tests/test_cuda_paths.py. A KernelChoice reaches each op: the grouped GEMM runs its forward,
dgrad and wgrad on the implementations it names (checked against the reference with every
mix), the router, permute and unpermute theirs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testing import HAS_CUDA, assert_close, grads, offsets
from moetrain.kernels import grouped_mm, permute, route, selection, unpermute
from moetrain.kernels.grouped_gemm.reference import grouped_mm_reference
from moetrain.kernels.selection import KernelChoice, MoEShape, OpChoice, choose

GPU_1B = MoEShape(tokens=8192, dim=2048, ffn=2816, experts=8, top_k=2, score_func="softmax")


def _case(op, case, features, pick, speedup=1.0, dtype="bfloat16", score_func=None, arch="sm_90"):
    return {"op": op, "arch": arch, "case": case, "features": features, "score_func": score_func,
            "dtype": dtype, "triton_ms": 1.0, "torch_ms": speedup, "speedup": speedup,
            "pick": pick, "rows": f"rows of {case}"}  # fmt: skip


def test_the_nearest_measured_class_decides_each_op():
    coarse = {"experts": 8, "dim": 4096, "ffn": 14336, "rows_per_expert": 4096}
    fine = {"experts": 128, "dim": 2048, "ffn": 768, "rows_per_expert": 1024}
    table = [
        _case("grouped_mm_fwd", "coarse", coarse, "triton", 1.2),
        _case("grouped_mm_fwd", "fine", fine, "torch", 0.7),
        _case("route", "small/T8192", {"experts": 8, "tokens": 8192}, "triton", 3.0,
              "float32", "softmax"),
        _case("route", "big/T8192", {"experts": 256, "tokens": 8192}, "torch", 0.5,
              "float32", "sigmoid"),
        _case("route", "big/T65536", {"experts": 256, "tokens": 65536}, "triton", 3.4,
              "float32", "sigmoid"),
    ]  # fmt: skip
    c = choose("sm_90", GPU_1B, table)
    assert c.fwd == OpChoice("triton", "bfloat16")  # E 8 is nearer the coarse class
    assert "Triton 1.20x torch._grouped_mm on the coarse class" in c.fwd.why
    assert "rows of coarse" in c.fwd.why
    fine_layer = GPU_1B._replace(experts=64, ffn=1024, top_k=8)
    assert choose("sm_90", fine_layer, table).fwd.backend == "torch"
    # Not measured: the default, said so.
    assert c.dgrad == OpChoice("triton", None) and "no measurement" in c.dgrad.why
    assert choose("sm_100", GPU_1B, table).fwd.backend == "triton"
    # The router: same score function where measured, then the nearest token count.
    sig = GPU_1B._replace(experts=256, score_func="sigmoid")
    assert choose("sm_90", sig, table).route.backend == "torch"
    assert choose("sm_90", sig._replace(tokens=40000), table).route.backend == "triton"
    assert choose("sm_90", GPU_1B._replace(experts=256), table).route.backend == "triton"


def test_a_choice_holds_in_its_measured_dtype_only():
    c = choose("sm_90", GPU_1B, [_case("grouped_mm_fwd", "x", {"experts": 8, "dim": 2048,
               "ffn": 2816, "rows_per_expert": 2048}, "torch", 0.9)])  # fmt: skip
    assert c.backend("fwd", torch.bfloat16) == "torch"
    assert c.backend("fwd", torch.float32) == "triton"  # unmeasured dtype: the default


def test_todays_table_on_sm90():
    """What the committed measurements say (issue 33): torch._grouped_mm for every GEMM on
    the anchor shapes; Triton for the router, permute and unpermute, except the DeepSeek-V3
    sigmoid router at 8,192 tokens (fwd+bwd 0.52x)."""
    shapes = {
        "gpu_1b": GPU_1B,
        "mixtral": MoEShape(16384, 4096, 14336, 8, 2),
        "qwen3": MoEShape(16384, 2048, 768, 128, 8),
        "dsv3": MoEShape(16384, 7168, 2048, 256, 8, "sigmoid"),
    }
    for name, shape in shapes.items():
        c = choose("sm_90", shape)
        assert (c.fwd.backend, c.dgrad.backend, c.wgrad.backend) == ("torch",) * 3, name
        assert (c.route.backend, c.permute.backend, c.unpermute.backend) == ("triton",) * 3, name
        assert c.gather.backend == "triton" and c.gather.dtype is None, name  # no row: default
    dsv3_8k = choose("sm_90", shapes["dsv3"]._replace(tokens=8192))
    assert dsv3_8k.route.backend == "torch" and "0.52x" in dsv3_8k.route.why
    assert all(getattr(choose("sm_100", GPU_1B), op).backend == "triton" for op in selection.OPS)


def _choice(fwd="torch", dgrad="torch", wgrad="torch", route_="torch", perm="torch",
            unperm="torch", dtype="float32") -> KernelChoice:  # fmt: skip
    ops = dict(fwd=fwd, dgrad=dgrad, wgrad=wgrad, gather="torch", route=route_, permute=perm,
               unpermute=unperm)  # fmt: skip
    return KernelChoice("sm_90", "torch", **{k: OpChoice(v, dtype) for k, v in ops.items()})


@pytest.mark.skipif(HAS_CUDA, reason="CPU interpreter run; the GPU suite runs the kernels")
@pytest.mark.parametrize("mix", [m for m in itertools.product(("torch", "triton"), repeat=3)
                                 if len(set(m)) > 1], ids="-".join)  # fmt: skip
def test_grouped_mm_runs_each_gemm_on_its_choice(mix, monkeypatch):
    """Every mix of forward / dgrad / wgrad implementations gives the reference's output and
    gradients, and each GEMM ran where the choice put it."""
    from moetrain.kernels.grouped_gemm import torch_backend, triton_backend

    ran = []
    for mod, name in ((triton_backend, "launch_grouped_mm"),
                      (triton_backend, "launch_grouped_wgrad"),
                      (torch_backend, "_gmm"), (torch_backend, "_gmm_wgrad")):  # fmt: skip
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: ran.append(_n)
                            or _r(*a, **k))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    sizes, k_dim, m_dim = [5, 0, 11, 7], 24, 40
    x = torch.randn(sum(sizes) + 3, k_dim, generator=gen).requires_grad_()
    w = (torch.randn(len(sizes), k_dim, m_dim, generator=gen) / 5).requires_grad_()
    offs = offsets(sizes)
    y = grouped_mm(x, w, offs, backend=_choice(*mix))
    y_ref = grouped_mm_reference(x, w, offs)
    assert_close(y, y_ref, "y")
    assert torch.count_nonzero(y[sum(sizes) :]) == 0
    dy = torch.randn_like(y_ref)
    for got, want, name in zip(grads(y, [x, w], dy), grads(y_ref, [x, w], dy), ("dx", "dw"),
                               strict=True):  # fmt: skip
        assert_close(got, want, name)
    names = {"triton": ("launch_grouped_mm", "launch_grouped_mm", "launch_grouped_wgrad"),
             "torch": ("_gmm", "_gmm", "_gmm_wgrad")}  # fmt: skip
    assert ran == [names[b][i] for i, b in enumerate(mix)], ran


def test_router_permute_unpermute_take_their_choice(monkeypatch):
    from moetrain.kernels.permutation import torch_backend as permutation_torch
    from moetrain.kernels.permutation import triton_backend as permutation_triton
    from moetrain.kernels.router import torch_backend as router_torch
    from moetrain.kernels.router import triton_backend as router_triton

    ran = []
    for mod, name in (
        (router_triton, "route_triton"),
        (router_torch, "route_torch"),
        (permutation_triton, "permute_triton"),
        (permutation_torch, "permute_torch"),
        (permutation_triton, "unpermute_triton"),
        (permutation_torch, "unpermute_torch"),
    ):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: ran.append(_n)
                            or _r(*a, **k))  # fmt: skip
    logits = torch.randn(6, 4)
    x = torch.randn(6, 8)
    for r_, p_, u_ in (("triton", "torch", "triton"), ("torch", "triton", "torch")):
        ran.clear()
        c = _choice(route_=r_, perm=p_, unperm=u_)
        res = route(logits, 2, backend=c)
        dest = torch.arange(12).view(6, 2)
        rows = permute(x, dest, 12, backend=c)
        unpermute(rows, dest, res.weights_TK, backend=c)
        assert ran == [f"route_{r_}", f"permute_{p_}", f"unpermute_{u_}"], ran
    # The router runs fp32 logits: a choice measured in bf16 does not apply to it.
    ran.clear()
    route(logits, 2, backend=_choice(route_="triton", dtype="bfloat16"))
    assert ran == ["route_torch"]
