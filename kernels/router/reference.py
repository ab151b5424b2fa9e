"""Pure-torch oracle of the top-k router (``route``). Deliberately simple: python loops,
plain ops.

What the tests compare the torch and triton backends against; never on a hot path. It
accumulates in fp32 and returns the input dtype, which is what the fast paths promise too.
Autograd differentiates it directly.
"""

from __future__ import annotations

import torch
from moetrain.kernels.common import RouteResult


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
