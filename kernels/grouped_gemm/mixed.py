"""The grouped GEMM on a mix of implementations: what a ``KernelChoice`` (``moe.kernels: auto``,
``kernels/selection.py``) asks for when it puts the forward, dgrad and wgrad on different
backends. The Triton half is imported lazily: this module imports without triton.
"""

from __future__ import annotations

import torch
from moetrain.kernels.grouped_gemm import torch_backend


class MixedGroupedMMFunction(torch.autograd.Function):
    """A grouped GEMM whose forward, dgrad and wgrad run on different implementations
    (``backends`` = (fwd, dgrad, wgrad), each "triton" or "torch"): the forward and dgrad
    are the same product (dgrad reads the weights transposed), the wgrad the K-grouped one.
    Rows past ``offs[-1]`` are zero and get a zero gradient, as in both backends."""

    @staticmethod
    def forward(ctx, x_NK, w_EKM, offs_E, backends):  # type: ignore[override]
        offs_E = offs_E.contiguous()
        ctx.backends = backends
        ctx.save_for_backward(
            x_NK if ctx.needs_input_grad[1] else None,
            w_EKM if ctx.needs_input_grad[0] else None,
            offs_E,
        )
        ctx.w_dtype = w_EKM.dtype
        return _product(backends[0], x_NK, w_EKM, offs_E)

    @staticmethod
    def backward(ctx, dy_NM):  # type: ignore[override]
        x_NK, w_EKM, offs_E = ctx.saved_tensors
        dy_NM = dy_NM.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _product(ctx.backends[1], dy_NM, w_EKM.transpose(1, 2), offs_E)
        if ctx.needs_input_grad[1]:
            if ctx.backends[2] == "triton":
                from moetrain.kernels.grouped_gemm import triton_backend

                dw = triton_backend.launch_grouped_wgrad(x_NK, None, dy_NM, offs_E, ctx.w_dtype)
            else:
                dw = torch_backend._gmm_wgrad(x_NK.contiguous(), dy_NM, offs_E)
        return dx, dw, None, None


def _product(backend: str, x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor):
    """y = x @ w[group] without autograd; w may be a transposed view."""
    if backend == "triton":
        from moetrain.kernels.grouped_gemm import triton_backend

        return triton_backend.launch_grouped_mm(x_NK, None, w_EKM, offs_E, x_NK.shape[0])
    return torch_backend._gmm(x_NK.contiguous(), w_EKM, offs_E)
