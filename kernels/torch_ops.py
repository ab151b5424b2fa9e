"""The torch backend: torch._grouped_mm where it applies, small autograd Functions elsewhere.

This is both the fallback when Triton is unavailable and the "unfused torch" peer
the benchmarks compare the Triton kernels against. No host syncs on the native path (nor
anywhere but the per-expert loops that stand in for torch._grouped_mm where its kernel does
not apply).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from moetrain.kernels.common import RouteResult, bin_counts, group_mask

# ---------------------------------------------------------------------------------------------
# Grouped GEMM
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------


def route_torch(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str,
    expert_bias_E: torch.Tensor | None,
    renormalize: bool,
    n_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "top2",
) -> RouteResult:
    """The unfused router: each step is its own torch op (and kernel launch)."""
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    select_TE = scores_TE.detach()
    if expert_bias_E is not None:
        select_TE = select_TE + expert_bias_E.to(torch.float32)
    if n_groups > 1:
        keep_TE = group_mask(select_TE, n_groups, topk_groups, group_score)
        select_TE = select_TE.masked_fill(~keep_TE, float("-inf"))
    ids_TK = torch.topk(select_TE, top_k, dim=-1, sorted=True).indices
    weights_TK = combine_weights(scores_TE, ids_TK, renormalize, score_func)
    lse_T = torch.logsumexp(logits_TE, dim=-1)
    counts_E = bin_counts(ids_TK, logits_TE.shape[1])
    return RouteResult(weights_TK, ids_TK, scores_TE, lse_T, counts_E)


def combine_weights(scores_TE: torch.Tensor, ids_TK: torch.Tensor, renormalize: bool,
                    score_func: str) -> torch.Tensor:
    """The combine weights of the chosen experts: their scores, renormalised to sum to one
    per token when asked (a sigmoid sum clamped away from zero). The torch router's own step,
    also used by routing replay so that replaying a model's own choices reproduces its
    outputs bit for bit."""
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        denom_T1 = weights_TK.sum(-1, keepdim=True)
        if score_func == "sigmoid":
            denom_T1 = denom_T1.clamp_min(1e-20)
        weights_TK = weights_TK / denom_T1
    return weights_TK


# ---------------------------------------------------------------------------------------------
# Permute / unpermute
# ---------------------------------------------------------------------------------------------


def _dest_or_sink(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Dropped slots (-1) point at an extra sink row num_rows, discarded afterwards."""
    return torch.where(dest_TK >= 0, dest_TK, num_rows)


class PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows):  # type: ignore[override]
        num_tokens, top_k = dest_TK.shape
        # Invert dest on device: src_N[row] = token, -1 for rows nobody writes. Dropped slots
        # all land on the extra sink row, which is cut off.
        src_N = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=x_TD.device)
        token_TK = torch.arange(num_tokens, device=x_TD.device).unsqueeze(1).expand(-1, top_k)
        src_N.scatter_(0, _dest_or_sink(dest_TK, num_rows).flatten(), token_TK.flatten())
        src_N = src_N[:num_rows]
        out_ND = x_TD.index_select(0, src_N.clamp_min(0))
        out_ND.masked_fill_((src_N < 0).unsqueeze(1), 0)
        ctx.save_for_backward(dest_TK)
        return out_ND

    @staticmethod
    def backward(ctx, dout_ND):  # type: ignore[override]
        (dest_TK,) = ctx.saved_tensors
        num_tokens, top_k = dest_TK.shape
        parts_TKD = dout_ND.index_select(0, dest_TK.clamp_min(0).flatten())
        parts_TKD = parts_TKD.view(num_tokens, top_k, -1).float()
        parts_TKD.masked_fill_((dest_TK < 0).unsqueeze(-1), 0)
        return parts_TKD.sum(1).to(dout_ND.dtype), None, None


def _fp32(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``t``'s device, so that einsums of ``.float()`` operands stay fp32
    (meta tensors have no autocast to turn off)."""
    dev = t.device.type
    if torch.amp.is_autocast_available(dev):
        return torch.autocast(dev, enabled=False)
    return contextlib.nullcontext()


class UnpermuteFunction(torch.autograd.Function):
    """The combine: fp32 weights, fp32 accumulation (as the Triton kernel), also under
    autocast, forward and backward."""

    @staticmethod
    def forward(ctx, y_ND, dest_TK, weights_TK):  # type: ignore[override]
        num_tokens, top_k = dest_TK.shape
        keep_TK = dest_TK >= 0
        w_TK = torch.where(keep_TK, weights_TK.float(), 0.0)
        y_TKD = y_ND.index_select(0, dest_TK.clamp_min(0).flatten()).view(num_tokens, top_k, -1)
        with _fp32(y_ND):
            out_TD = torch.einsum("tkd,tk->td", y_TKD.float(), w_TK).to(y_ND.dtype)
        ctx.save_for_backward(
            y_ND if ctx.needs_input_grad[2] else None,
            dest_TK,
            w_TK if ctx.needs_input_grad[0] else None,
        )
        ctx.num_rows = y_ND.shape[0]
        ctx.weights_dtype = weights_TK.dtype
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):  # type: ignore[override]
        y_ND, dest_TK, w_TK = ctx.saved_tensors
        num_tokens, top_k = dest_TK.shape
        keep_TK = dest_TK >= 0
        dy_ND = dw_TK = None
        if ctx.needs_input_grad[0]:
            contrib_TKD = w_TK.unsqueeze(-1) * dout_TD.float().unsqueeze(1)
            idx = _dest_or_sink(dest_TK, ctx.num_rows).flatten()
            dy_ND = contrib_TKD.new_zeros(ctx.num_rows + 1, dout_TD.shape[1])
            dy_ND.index_add_(0, idx, contrib_TKD.view(num_tokens * top_k, -1))
            dy_ND = dy_ND[: ctx.num_rows].to(dout_TD.dtype)
        if ctx.needs_input_grad[2]:
            y_TKD = y_ND.index_select(0, dest_TK.clamp_min(0).flatten()).view(num_tokens, top_k, -1)
            with _fp32(y_ND):
                dw_TK = torch.einsum("tkd,td->tk", y_TKD.float(), dout_TD.float())
            dw_TK = torch.where(keep_TK, dw_TK, 0.0).to(ctx.weights_dtype)
        return dy_ND, None, dw_TK


def permute_torch(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    return PermuteFunction.apply(x_TD, dest_TK, num_rows)


def unpermute_torch(
    y_ND: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    return UnpermuteFunction.apply(y_ND, dest_TK, weights_TK)
