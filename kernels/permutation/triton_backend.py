"""Triton permute / unpermute (token rows <-> expert-sorted rows).

T tokens, K top-k slots, D features, N permuted rows. dest_TK[t, k] is the permuted row of
slot (t, k), or -1 when the slot was dropped.

Kernels:
- `_invert_kernel`: inv_N[dest[t, k]] = t * K + k (-1 where no slot lands), so that the
  permuted side can be produced by a gather that writes every row exactly once, with no
  memset of the output.
- `_gather_rows_kernel`: out[n] = x[inv[n] // K] (* w[inv[n]]) or zero. permute forward
  and unpermute's dy.
- `_combine_rows_kernel`: out[t] = sum_k (w[t, k] *) y[dest[t, k]] in fp32. unpermute
  forward and permute's dx.
- `_rowdot_kernel`: dw[t, k] = <dout[t], y[dest[t, k]]>. unpermute's dweights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moetrain.kernels import common

_INTERPRET = common.interpreter_enabled()


@triton.jit
def _invert_kernel(dest_ptr, inv_ptr, num_slots, num_rows, BLOCK: tl.constexpr):
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot_mask = slots < num_slots
    dest = tl.load(dest_ptr + slots, mask=slot_mask, other=-1)
    ok = slot_mask & (dest >= 0) & (dest < num_rows)
    tl.store(inv_ptr + tl.where(ok, dest, 0), slots.to(tl.int64), mask=ok)


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    inv_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    D,
    stride_x,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols < D
    slot = tl.load(inv_ptr + rows, mask=row_mask, other=-1)
    valid = slot >= 0
    token = tl.where(valid, slot // TOP_K, 0)
    vals = tl.load(
        x_ptr + token[:, None] * stride_x + cols[None, :],
        mask=valid[:, None] & col_mask[None, :],
        other=0.0,
    )
    if HAS_W:
        w = tl.load(w_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        vals = vals.to(tl.float32) * w[:, None]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
        vals.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _combine_rows_kernel(
    y_ptr,
    dest_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    stride_y,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_mask = tokens < T
    col_mask = cols < D
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        dest = tl.load(dest_ptr + tokens64 * TOP_K + i, mask=tok_mask, other=-1)
        valid = dest >= 0
        vals = tl.load(
            y_ptr + tl.where(valid, dest, 0)[:, None] * stride_y + cols[None, :],
            mask=valid[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + tokens64 * TOP_K + i, mask=valid, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    tl.store(
        out_ptr + tokens64[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=tok_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _rowdot_kernel(
    y_ptr,
    dest_ptr,
    dout_ptr,
    dw_ptr,
    T,
    D,
    stride_y,
    stride_dout,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tokens < T
    tokens64 = tokens.to(tl.int64)
    k_cols = tl.arange(0, K_POW2)
    acc = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        g = tl.load(
            dout_ptr + tokens64[:, None] * stride_dout + cols[None, :],
            mask=tok_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        for i in tl.static_range(TOP_K):
            dest = tl.load(dest_ptr + tokens64 * TOP_K + i, mask=tok_mask, other=-1)
            valid = dest >= 0
            vals = tl.load(
                y_ptr + tl.where(valid, dest, 0)[:, None] * stride_y + cols[None, :],
                mask=valid[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            part = tl.sum(vals * g, 1)
            acc = tl.where(k_cols[None, :] == i, acc + part[:, None], acc)
    tl.store(
        dw_ptr + tokens64[:, None] * TOP_K + k_cols[None, :],
        acc.to(dw_ptr.dtype.element_ty),
        mask=tok_mask[:, None] & (k_cols[None, :] < TOP_K),
    )


def _row_blocks(d_dim: int) -> tuple[int, int]:
    """(rows, cols) per program: ~8K elements on GPU; under the interpreter fewer programs."""
    block_d = min(triton.next_power_of_2(max(d_dim, 1)), 256 if _INTERPRET else 1024)
    block_r = 64 if _INTERPRET else max(1, 8192 // block_d)
    return block_r, block_d


def _invert(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    inv_N = torch.full((num_rows,), -1, dtype=torch.int64, device=dest_TK.device)
    num_slots = dest_TK.numel()
    if num_slots and num_rows:
        block = 1024
        _invert_kernel[(triton.cdiv(num_slots, block),)](
            dest_TK, inv_N, num_slots, num_rows, BLOCK=block
        )
    return inv_N


def _gather_rows(x_TD, inv_N, w_TK, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    num_rows, d_dim = inv_N.shape[0], x_TD.shape[1]
    out = torch.empty(num_rows, d_dim, dtype=out_dtype, device=x_TD.device)
    if num_rows and d_dim:
        block_r, block_d = _row_blocks(d_dim)
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(d_dim, block_d))
        _gather_rows_kernel[grid](
            x_TD, inv_N, w_TK if w_TK is not None else x_TD, out, num_rows, d_dim,
            x_TD.stride(0), out.stride(0),
            TOP_K=top_k, HAS_W=w_TK is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def _combine_rows(y_ND, dest_TK, w_TK, out_dtype: torch.dtype) -> torch.Tensor:
    num_tokens, top_k = dest_TK.shape
    d_dim = y_ND.shape[1]
    out = torch.empty(num_tokens, d_dim, dtype=out_dtype, device=y_ND.device)
    if num_tokens and d_dim:
        block_t, block_d = _row_blocks(d_dim)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(d_dim, block_d))
        _combine_rows_kernel[grid](
            y_ND, dest_TK, w_TK if w_TK is not None else y_ND, out, num_tokens, d_dim,
            y_ND.stride(0), out.stride(0),
            TOP_K=top_k, HAS_W=w_TK is not None, BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=8,  # all K row loads are in flight at once: 4 warps spill at K=8
        )  # fmt: skip
    return out


def _rowdot(y_ND, dest_TK, dout_TD, out_dtype: torch.dtype) -> torch.Tensor:
    num_tokens, top_k = dest_TK.shape
    d_dim = y_ND.shape[1]
    dw_TK = torch.empty(num_tokens, top_k, dtype=out_dtype, device=y_ND.device)
    if num_tokens and d_dim:
        # The K row loads of a token block are all in flight at once: 16 x BLOCK_D tiles of
        # 16 KiB (512 bf16 or 256 fp32 columns) fill 128 registers per thread of 8 warps at
        # K=8; 512 fp32 columns spilled (docs/kernels_compiled.md).
        block_d = min(triton.next_power_of_2(d_dim),
                      256 if _INTERPRET else 1024 // y_ND.element_size())  # fmt: skip
        block_t = 64 if _INTERPRET else 16
        _rowdot_kernel[(triton.cdiv(num_tokens, block_t),)](
            y_ND, dest_TK, dout_TD, dw_TK, num_tokens, d_dim, y_ND.stride(0), dout_TD.stride(0),
            TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=8,
        )  # fmt: skip
    return dw_TK


class PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows):  # type: ignore[override]
        common.check_triton_device("permute", x_TD)
        x_TD = x_TD.contiguous()
        dest_TK = dest_TK.contiguous()
        inv_N = _invert(dest_TK, num_rows)
        ctx.save_for_backward(dest_TK)
        return _gather_rows(x_TD, inv_N, None, dest_TK.shape[1], x_TD.dtype)

    @staticmethod
    def backward(ctx, dout_ND):  # type: ignore[override]
        (dest_TK,) = ctx.saved_tensors
        dout_ND = dout_ND.contiguous()
        return _combine_rows(dout_ND, dest_TK, None, dout_ND.dtype), None, None


class UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, dest_TK, weights_TK):  # type: ignore[override]
        common.check_triton_device("unpermute", y_ND)
        y_ND = y_ND.contiguous()
        dest_TK = dest_TK.contiguous()
        weights_TK = weights_TK.contiguous()
        ctx.save_for_backward(
            y_ND if ctx.needs_input_grad[2] else None,
            dest_TK,
            weights_TK if ctx.needs_input_grad[0] else None,
        )
        ctx.num_rows = y_ND.shape[0]
        ctx.weights_dtype = weights_TK.dtype
        return _combine_rows(y_ND, dest_TK, weights_TK, y_ND.dtype)

    @staticmethod
    def backward(ctx, dout_TD):  # type: ignore[override]
        y_ND, dest_TK, weights_TK = ctx.saved_tensors
        dout_TD = dout_TD.contiguous()
        dy_ND = dw_TK = None
        if ctx.needs_input_grad[0]:
            inv_N = _invert(dest_TK, ctx.num_rows)
            dy_ND = _gather_rows(dout_TD, inv_N, weights_TK, dest_TK.shape[1], dout_TD.dtype)
        if ctx.needs_input_grad[2]:
            dw_TK = _rowdot(y_ND, dest_TK, dout_TD, ctx.weights_dtype)
        return dy_ND, None, dw_TK


def permute_triton(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Triton permute; same contract as moetrain.kernels.permute."""
    common.check_permute("permute", x_TD, dest_TK, num_rows)
    return PermuteFunction.apply(x_TD, dest_TK, num_rows)


def unpermute_triton(
    y_ND: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Triton unpermute; same contract as moetrain.kernels.unpermute."""
    common.check_unpermute("unpermute", y_ND, dest_TK, weights_TK)
    return UnpermuteFunction.apply(y_ND, dest_TK, weights_TK)
