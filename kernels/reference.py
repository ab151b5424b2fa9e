"""Pure-torch oracles for every kernel. Deliberately simple: python loops, plain ops.

These are what the tests compare the torch and triton backends against; they are
never on a hot path. They accumulate in fp32 and return the input dtype, which is
what the fast paths promise too. Autograd differentiates them directly.
"""

from __future__ import annotations

import torch
from moetrain.kernels.common import RouteResult


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


def route_reference(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    expert_bias_E: torch.Tensor | None = None,
    renormalize: bool = True,
    n_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "top2",
) -> RouteResult:
    """Scores, biased top-k selection (among each token's best expert groups when
    ``n_groups > 1``), (re)normalised weights, logsumexp and counts."""
    logits_TE = logits_TE.float()
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    select_TE = scores_TE.detach()
    if expert_bias_E is not None:
        select_TE = select_TE + expert_bias_E.float()
    if n_groups > 1:
        # Token by token: rank the groups by the sum of their two best entries (or their best
        # one), then mask every expert outside the topk_groups best.
        per = logits_TE.shape[1] // n_groups
        best = 1 if group_score == "max" else 2
        masked = []
        for row_E in select_TE:
            group_scores = [
                sorted(row_E[g * per : (g + 1) * per].tolist())[-best:] for g in range(n_groups)
            ]
            ranked = sorted(range(n_groups), key=lambda g: -sum(group_scores[g]))
            keep = set(ranked[:topk_groups])
            masked.append(
                torch.tensor(
                    [
                        row_E[e].item() if e // per in keep else float("-inf")
                        for e in range(row_E.shape[0])
                    ]
                )
            )
        select_TE = torch.stack(masked).to(select_TE.device)
    ids_TK = torch.topk(select_TE, top_k, dim=-1, sorted=True).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        denom_T1 = weights_TK.sum(-1, keepdim=True)
        if score_func == "sigmoid":
            denom_T1 = denom_T1.clamp_min(1e-20)
        weights_TK = weights_TK / denom_T1
    lse_T = torch.logsumexp(logits_TE, dim=-1)
    counts_E = torch.zeros(logits_TE.shape[1], dtype=torch.int64, device=logits_TE.device)
    for e in ids_TK.flatten().tolist():
        counts_E[e] += 1
    return RouteResult(weights_TK, ids_TK, scores_TE, lse_T, counts_E)


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
