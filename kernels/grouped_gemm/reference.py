"""Pure-torch oracles of the grouped GEMM (``grouped_mm``, ``gather_grouped_mm``).
Deliberately simple: python loops, plain ops.

What the tests compare the torch and triton backends against; never on a hot path. They
accumulate in fp32 and return the input dtype, which is what the fast paths promise too.
Autograd differentiates them directly.
"""

from __future__ import annotations

import torch


def grouped_mm_reference(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e]; rows at/after offs[-1] are zero."""
    ends = offs_E.tolist()
    outs = []
    start = 0
    for e, end in enumerate(ends):
        outs.append((x_NK[start:end].float() @ w_EKM[e].float()).to(x_NK.dtype))
        start = end
    tail = x_NK.shape[0] - start
    outs.append(x_NK.new_zeros(tail, w_EKM.shape[2]))
    return torch.cat(outs, dim=0)


def gather_grouped_mm_reference(
    x_TK: torch.Tensor, src_N: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """y[n] = x[src[n]] @ w[group(n)], per row; src -1 and rows past offs[-1] give zero.

    Padding rows multiply a zero row (by w[0] past the last group), which keeps the output
    attached to the autograd graph even when every row is padding.
    """
    ends = offs_E.tolist()
    # Cast once, so autograd accumulates the gradients of repeated rows in fp32.
    x_f32, w_f32 = x_TK.float(), w_EKM.float()
    zero_K = torch.zeros(x_TK.shape[1], dtype=torch.float32, device=x_TK.device)
    rows = []
    group = 0
    for n in range(src_N.shape[0]):
        while group < len(ends) and n >= ends[group]:
            group += 1
        s = int(src_N[n])
        x_K = zero_K if s < 0 or group == len(ends) else x_f32[s]
        w_KM = w_f32[min(group, len(ends) - 1)]
        rows.append((x_K @ w_KM).to(x_TK.dtype))
    if not rows:
        return x_TK.new_zeros(0, w_EKM.shape[2])
    return torch.stack(rows)
