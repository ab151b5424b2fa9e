"""Fused Triton top-k router: one kernel forward, one kernel backward.

Forward, per block of tokens (T tokens, E experts, K top-k): scores = softmax|sigmoid(logits),
lse = logsumexp(logits), top-k of (scores + bias) by K rounds of row max, weights gathered
from the unbiased scores and renormalised, and a block-local expert histogram added to the
global counts with one vector atomic per program.

Backward recomputes the scores from the logits (cheaper than saving them) and folds the
three incoming gradients (weights, scores, lse) into dlogits in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moetrain.kernels import common

_INTERPRET = common.interpreter_enabled()


@triton.jit
def _route_fwd_kernel(
    logits_ptr,
    bias_ptr,
    scores_ptr,
    weights_ptr,
    ids_ptr,
    lse_ptr,
    counts_ptr,
    T,
    E,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, E_POW2)
    col_mask = cols < E
    mask = row_mask[:, None] & col_mask[None, :]
    te_offs = rows64[:, None] * E + cols[None, :]
    logits = tl.load(logits_ptr + te_offs, mask=mask, other=-float("inf"))
    # Rows past T become all-zero rather than all -inf, so they stay finite (never stored).
    logits = tl.where(row_mask[:, None], logits, 0.0)

    row_max = tl.max(logits, 1)
    ex = tl.exp(logits - row_max[:, None])
    denom = tl.sum(ex, 1)
    lse = row_max + tl.log(denom)
    if SIGMOID:
        scores = tl.where(mask, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        scores = ex / denom[:, None]
    tl.store(scores_ptr + te_offs, scores, mask=mask)
    tl.store(lse_ptr + rows, lse, mask=row_mask)

    select = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        select = select + bias[None, :]
    select = tl.where(col_mask[None, :], select, -float("inf"))

    k_cols = tl.arange(0, K_POW2)
    w_tile = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    id_tile = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    hist = tl.zeros((E_POW2,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(select, 1)
        # Lowest index among ties, so the choice is deterministic.
        idx = tl.min(tl.where(select == best[:, None], cols[None, :], E_POW2), 1)
        onehot = cols[None, :] == idx[:, None]
        w_i = tl.sum(tl.where(onehot, scores, 0.0), 1)
        w_tile = tl.where(k_cols[None, :] == i, w_i[:, None], w_tile)
        id_tile = tl.where(k_cols[None, :] == i, idx[:, None], id_tile)
        hist += tl.sum((onehot & row_mask[:, None]).to(tl.int32), 0)
        select = tl.where(onehot, -float("inf"), select)
    if RENORM:
        total = tl.sum(w_tile, 1)
        if SIGMOID:
            total = tl.maximum(total, 1e-20)
        w_tile = w_tile / total[:, None]
    out_mask = row_mask[:, None] & (k_cols[None, :] < TOP_K)
    out_offs = rows64[:, None] * TOP_K + k_cols[None, :]
    tl.store(weights_ptr + out_offs, w_tile, mask=out_mask)
    tl.store(ids_ptr + out_offs, id_tile.to(tl.int64), mask=out_mask)
    tl.atomic_add(counts_ptr + cols, hist, mask=col_mask)


@triton.jit
def _route_bwd_kernel(
    logits_ptr,
    ids_ptr,
    dweights_ptr,
    dscores_ptr,
    dlse_ptr,
    dlogits_ptr,
    T,
    E,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, E_POW2)
    col_mask = cols < E
    mask = row_mask[:, None] & col_mask[None, :]
    te_offs = rows64[:, None] * E + cols[None, :]
    logits = tl.load(logits_ptr + te_offs, mask=mask, other=-float("inf"))
    logits = tl.where(row_mask[:, None], logits, 0.0)  # keep rows past T finite
    row_max = tl.max(logits, 1)
    ex = tl.exp(logits - row_max[:, None])
    probs = ex / tl.sum(ex, 1)[:, None]
    if SIGMOID:
        scores = tl.where(mask, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        scores = probs

    if HAS_DS:
        dscores = tl.load(dscores_ptr + te_offs, mask=mask, other=0.0)
    else:
        dscores = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    if HAS_DW:
        # Dense per-expert view of the selection: dw_dense[t, e] = dweights[t, k] if ids[t, k]
        # == e, selected[t, e] = 1 if e was picked. Then renormalisation is dense algebra.
        dw_dense = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
        selected = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            id_i = tl.load(ids_ptr + rows64 * TOP_K + i, mask=row_mask, other=-1)
            dw_i = tl.load(dweights_ptr + rows64 * TOP_K + i, mask=row_mask, other=0.0)
            onehot = cols[None, :] == id_i[:, None]
            dw_dense = tl.where(onehot, dw_i[:, None], dw_dense)
            selected = tl.where(onehot, 1.0, selected)
        if RENORM:
            # w = w_raw / S, S = sum(w_raw): dw_raw = (dw - sum_j dw_j w_j) / S.
            total = tl.sum(scores * selected, 1)
            if SIGMOID:
                clamped = tl.maximum(total, 1e-20)
                # Below the clamp S is a constant: only the direct term survives.
                proj = tl.where(total > 1e-20, tl.sum(dw_dense * scores, 1) / clamped, 0.0)
            else:
                clamped = tl.where(row_mask, total, 1.0)  # rows past T select nothing
                proj = tl.sum(dw_dense * scores, 1) / clamped
            dscores += selected * (dw_dense - proj[:, None]) / clamped[:, None]
        else:
            dscores += dw_dense
    if SIGMOID:
        dlogits = dscores * scores * (1.0 - scores)
    else:
        dlogits = probs * (dscores - tl.sum(dscores * probs, 1)[:, None])
    if HAS_DLSE:
        dlse = tl.load(dlse_ptr + rows, mask=row_mask, other=0.0)
        dlogits += dlse[:, None] * probs
    tl.store(dlogits_ptr + te_offs, dlogits, mask=mask)


def _block_t(num_experts: int) -> int:
    # 2K fp32 elements per program on GPU (4 warps; ~150 registers at E=128..256, no spills
    # when compiled for sm_90); under the interpreter fewer, larger programs.
    budget = 16384 if _INTERPRET else 2048
    return max(1, min(256, budget // triton.next_power_of_2(num_experts)))


class RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, expert_bias_E, top_k, score_func, renormalize):  # type: ignore[override]
        common.check_triton_device("route", logits_TE)
        logits_TE = logits_TE.contiguous()
        num_tokens, num_experts = logits_TE.shape
        dev = logits_TE.device
        scores_TE = torch.empty_like(logits_TE)
        weights_TK = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=dev)
        lse_T = torch.empty(num_tokens, dtype=torch.float32, device=dev)
        counts_E = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        if num_tokens > 0:
            block_t = _block_t(num_experts)
            bias = expert_bias_E.contiguous() if expert_bias_E is not None else logits_TE
            _route_fwd_kernel[(triton.cdiv(num_tokens, block_t),)](
                logits_TE, bias, scores_TE, weights_TK, ids_TK, lse_T, counts_E,
                num_tokens, num_experts,
                TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
                E_POW2=triton.next_power_of_2(num_experts), BLOCK_T=block_t,
                SIGMOID=score_func == "sigmoid", HAS_BIAS=expert_bias_E is not None,
                RENORM=renormalize,
            )  # fmt: skip
        counts_E = counts_E.to(torch.int64)
        ctx.mark_non_differentiable(ids_TK, counts_E)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_TE, ids_TK)
        ctx.top_k = top_k
        ctx.sigmoid = score_func == "sigmoid"
        ctx.renormalize = renormalize
        return weights_TK, ids_TK, scores_TE, lse_T, counts_E

    @staticmethod
    def backward(ctx, dweights_TK, _dids, dscores_TE, dlse_T, _dcounts):  # type: ignore[override]
        logits_TE, ids_TK = ctx.saved_tensors
        if dweights_TK is None and dscores_TE is None and dlse_T is None:
            return None, None, None, None, None
        num_tokens, num_experts = logits_TE.shape
        dlogits_TE = torch.empty_like(logits_TE)
        if num_tokens > 0:
            block_t = _block_t(num_experts)
            dummy = logits_TE  # stands in for absent gradients; never read
            _route_bwd_kernel[(triton.cdiv(num_tokens, block_t),)](
                logits_TE, ids_TK,
                dweights_TK.float().contiguous() if dweights_TK is not None else dummy,
                dscores_TE.float().contiguous() if dscores_TE is not None else dummy,
                dlse_T.float().contiguous() if dlse_T is not None else dummy,
                dlogits_TE, num_tokens, num_experts,
                TOP_K=ctx.top_k, E_POW2=triton.next_power_of_2(num_experts), BLOCK_T=block_t,
                SIGMOID=ctx.sigmoid, RENORM=ctx.renormalize,
                HAS_DW=dweights_TK is not None, HAS_DS=dscores_TE is not None,
                HAS_DLSE=dlse_T is not None,
            )  # fmt: skip
        return dlogits_TE, None, None, None, None


def route_triton(
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    expert_bias_E: torch.Tensor | None = None,
    renormalize: bool = True,
) -> common.RouteResult:
    """Fused router; same contract as moetrain.kernels.route."""
    common.check_route("route", logits_TE, top_k, score_func, expert_bias_E)
    return common.RouteResult(
        *RouteFunction.apply(logits_TE, expert_bias_E, top_k, score_func, renormalize)
    )
