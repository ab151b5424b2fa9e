"""Pure-torch oracles of permute / unpermute. Deliberately simple: python loops, plain ops.

What the tests compare the torch and triton backends against; never on a hot path. They
accumulate in fp32 and return the input dtype, which is what the fast paths promise too.
Autograd differentiates them directly.
"""

from __future__ import annotations

import torch


def permute_reference(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """out[dest[t, k]] = x[t] for dest >= 0; other rows zero."""
    x_f32 = x_TD.float()  # the backward sums a token's copies in fp32
    rows = [None] * num_rows
    for t in range(dest_TK.shape[0]):
        for k in range(dest_TK.shape[1]):
            d = int(dest_TK[t, k])
            if d >= 0:
                rows[d] = x_f32[t]
    zero = x_f32.new_zeros(x_TD.shape[1])
    if num_rows == 0:
        return x_TD.new_zeros(0, x_TD.shape[1])
    return torch.stack([zero if r is None else r for r in rows]).to(x_TD.dtype)


def unpermute_reference(
    y_ND: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[dest[t, k]] over dest >= 0, in fp32."""
    y_f32, w_f32 = y_ND.float(), weights_TK.float()
    outs = []
    for t in range(dest_TK.shape[0]):
        acc = torch.zeros(y_ND.shape[1], dtype=torch.float32, device=y_ND.device)
        for k in range(dest_TK.shape[1]):
            d = int(dest_TK[t, k])
            if d >= 0:
                acc = acc + w_f32[t, k] * y_f32[d]
        outs.append(acc.to(y_ND.dtype))
    if not outs:
        return y_ND.new_zeros(0, y_ND.shape[1])
    return torch.stack(outs)
