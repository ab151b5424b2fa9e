"""permute / unpermute's torch backend: index_select / index_add in small autograd Functions,
no host sync. The combine (``unpermute``) keeps fp32 weights and accumulates in fp32, as the
Triton kernel does.
"""

from __future__ import annotations

import contextlib

import torch


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
