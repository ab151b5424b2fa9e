"""The grouped GEMM's torch backend: ``torch._grouped_mm`` where it applies, a per-expert loop
elsewhere, in one small autograd Function.

Both the fallback when Triton is unavailable and the peer the benchmarks compare the Triton
kernels against. No host syncs on the native path (nor anywhere but the per-expert loops that
stand in for ``torch._grouped_mm`` where its kernel does not apply). ``_gmm`` and
``_gmm_wgrad`` are also the FP8 emulation's GEMMs (``moetrain.kernels.fp8``) and the torch
half of a mixed choice (``grouped_gemm/mixed.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned base pointers and non-unit strides."""
    nbytes = t.element_size()
    # A traced tensor has no address (torch.compile): the operands here are whole
    # buffers or their transposes, which every allocator aligns to at least 64 bytes.
    if not torch.compiler.is_compiling() and t.data_ptr() % 16:
        return False
    return (
        all(
            size <= 1 or stride == 1 or (stride * nbytes) % 16 == 0
            for size, stride in zip(t.shape, t.stride(), strict=True)
        )
        and 1 in t.stride()[-2:]
    )


_CUDA_RULES: tuple[int, int] | None = None
"""Set by ``cuda_rules``: the compute capability whose CUDA rules every device follows."""


@contextlib.contextmanager
def cuda_rules(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Decide ``torch._grouped_mm``'s eligibility by CUDA's rules on a GPU of
    ``capability``, whatever the tensors' device: a CPU test then takes the path that GPU
    takes (CPU's kernel accepts fp32 too, CUDA's only bf16 on sm90+)."""
    global _CUDA_RULES
    before, _CUDA_RULES = _CUDA_RULES, capability
    try:
        yield
    finally:
        _CUDA_RULES = before


def _native_ok(a: torch.Tensor, b: torch.Tensor, out_cols: int) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    device_type = a.device.type if _CUDA_RULES is None else "cuda"
    if device_type == "cpu":
        # fp16 works on torch 2.13's CPU kernel but not on every version we support; fp32
        # does too, except under torch.compile, which traces the op through its meta
        # kernel: that one takes bf16 only (CUDA's rule).
        dtype_ok = a.dtype == torch.bfloat16 or (
            a.dtype == torch.float32 and not torch.compiler.is_compiling()
        )
    elif device_type == "cuda":
        # The CUDA kernel is the sm90+ bf16 CUTLASS path.
        capability = _CUDA_RULES or torch.cuda.get_device_capability(a.device)
        dtype_ok = a.dtype == torch.bfloat16 and capability[0] >= 9
    else:
        dtype_ok = False
    return dtype_ok and (out_cols * a.element_size()) % 16 == 0 and _aligned(a) and _aligned(b)


def _row_mask(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(N, 1) bool, True for rows at/after the last offset (no group): no host sync."""
    rows_N = torch.arange(num_rows, device=offs_E.device, dtype=torch.int32)
    return (rows_N >= offs_E[-1]).unsqueeze(1)


def _gmm(x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y = x @ w[group] per group, rows past offs[-1] zero. w may be a transposed view."""
    num_rows, out_cols = x_NK.shape[0], w_EKM.shape[2]
    if _native_ok(x_NK, w_EKM, out_cols):
        y_NM = torch._grouped_mm(x_NK, w_EKM, offs=offs_E)
        # torch._grouped_mm leaves rows past the last offset unwritten (garbage).
        return y_NM.masked_fill_(_row_mask(offs_E, num_rows), 0)
    return _gmm_loop(x_NK, w_EKM, offs_E)


# The loops below read the offsets on the host (a sync) and slice by them: under
# torch.compile they would break the graph and recompile for every new set of offsets, so
# they always run eagerly. torch._grouped_mm's path above has neither.
@torch.compiler.disable
def _gmm_loop(x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    y_NM = x_NK.new_zeros(x_NK.shape[0], w_EKM.shape[2])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.matmul(x_NK[start:end], w_EKM[e], out=y_NM[start:end])
        start = end
    return y_NM


def _gmm_wgrad(x_NK: torch.Tensor, dy_NM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """dw[e] = x[rows e]^T @ dy[rows e]; zero for empty groups; rows past offs[-1] ignored."""
    x_KN = x_NK.t()
    if _native_ok(x_KN, dy_NM, dy_NM.shape[1]):
        return torch._grouped_mm(x_KN, dy_NM, offs=offs_E)
    return _gmm_wgrad_loop(x_KN, dy_NM, offs_E)


@torch.compiler.disable
def _gmm_wgrad_loop(x_KN: torch.Tensor, dy_NM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    dw_EKM = x_KN.new_zeros(offs_E.shape[0], x_KN.shape[0], dy_NM.shape[1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.matmul(x_KN[:, start:end], dy_NM[start:end], out=dw_EKM[e])
        start = end
    return dw_EKM


class GroupedMMFunction(torch.autograd.Function):
    """Grouped GEMM with dgrad via the transposed weights and wgrad as a K-grouped GEMM."""

    @staticmethod
    def forward(ctx, x_NK, w_EKM, offs_E):  # type: ignore[override]
        x_NK = x_NK.contiguous()
        w_EKM = w_EKM.contiguous()
        ctx.save_for_backward(
            x_NK if ctx.needs_input_grad[1] else None,
            w_EKM if ctx.needs_input_grad[0] else None,
            offs_E,
        )
        return _gmm(x_NK, w_EKM, offs_E)

    @staticmethod
    def backward(ctx, dy_NM):  # type: ignore[override]
        x_NK, w_EKM, offs_E = ctx.saved_tensors
        dy_NM = dy_NM.contiguous()
        dx_NK = dw_EKM = None
        if ctx.needs_input_grad[0]:
            dx_NK = _gmm(dy_NM, w_EKM.transpose(1, 2), offs_E)
        if ctx.needs_input_grad[1]:
            dw_EKM = _gmm_wgrad(x_NK, dy_NM, offs_E)
        return dx_NK, dw_EKM, None


def grouped_mm_torch(x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return GroupedMMFunction.apply(x_NK, w_EKM, offs_E)


def gather_grouped_mm_torch(
    x_TK: torch.Tensor, src_N: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """Materialises x[src] (the unfused path), then the grouped GEMM."""
    pad_N1 = (src_N < 0).unsqueeze(1)
    x_NK = x_TK.index_select(0, src_N.clamp_min(0)).masked_fill(pad_N1, 0)
    return GroupedMMFunction.apply(x_NK, w_EKM, offs_E)
