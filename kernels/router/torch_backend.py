"""The router's torch backend: the unfused router, each step its own torch op (and kernel
launch); ``combine_weights``, its last step, is also what routing replay uses.
"""

from __future__ import annotations

import torch
from moetrain.kernels.common import RouteResult, bin_counts


def group_mask(
    select_TE: torch.Tensor, n_groups: int, topk_groups: int, group_score: str = "top2"
) -> torch.Tensor:
    """(T, E) bool: True for the experts of each token's ``topk_groups`` best groups, a group
    scored by the sum of its two highest entries of ``select_TE`` (DeepSeek-V3, "top2") or
    by its highest (DeepSeek-V2, "max")."""
    T, E = select_TE.shape
    grouped_TGE = select_TE.view(T, n_groups, E // n_groups)
    if group_score == "max":
        group_scores_TG = grouped_TGE.max(dim=-1).values
    else:
        group_scores_TG = grouped_TGE.topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_scores_TG.topk(topk_groups, dim=-1).indices, True)
    return keep_TG.repeat_interleave(E // n_groups, dim=1)


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
