"""Shared pieces of the kernel API: the route result type and argument checks.

Every backend (torch, triton) runs the same checks, so a bad call fails with the
same message whichever backend is selected.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RouteResult(NamedTuple):
    """What `route` returns (T tokens, E experts, K top-k).

    weights_TK: fp32 combine weights of the selected experts (renormalised if asked).
    ids_TK:     int64 selected expert ids, by descending biased score.
    scores_TE:  fp32 softmax or sigmoid of the logits (unbiased), for aux losses.
    lse_T:      fp32 logsumexp of the logits, for the router z-loss.
    counts_E:   int64 number of (token, slot) pairs routed to each expert.
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    scores_TE: torch.Tensor
    lse_T: torch.Tensor
    counts_E: torch.Tensor


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(op: str, t: torch.Tensor) -> None:
    """The Triton backend launches on CUDA tensors, or on CPU ones under the interpreter."""
    if t.device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"{op}: triton backend needs a CUDA tensor or TRITON_INTERPRET=1, got {t.device}"
        )


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        _fail(op, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_grouped_mm(op: str, x: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor) -> None:
    """Checks x (rows, K), w (E, K, M), offs (E,) int32 on one device, one dtype."""
    if x.dim() != 2:
        _fail(op, f"x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    if w_EKM.dim() != 3:
        _fail(op, f"w must be 3-D (E, K, M), got shape {tuple(w_EKM.shape)}")
    if x.shape[1] != w_EKM.shape[1]:
        _fail(op, f"x has K={x.shape[1]} columns but w has K={w_EKM.shape[1]} rows per expert")
    if offs_E.dim() != 1 or offs_E.shape[0] != w_EKM.shape[0]:
        _fail(
            op,
            f"offs must be 1-D with one end offset per expert (E={w_EKM.shape[0]}), "
            f"got shape {tuple(offs_E.shape)}",
        )
    if w_EKM.shape[0] == 0:
        _fail(op, "w must hold at least one expert (E >= 1)")
    if offs_E.dtype != torch.int32:
        _fail(op, f"offs must be int32 (cumulative end offsets), got {offs_E.dtype}")
    check_float(op, "x", x)
    if x.dtype != w_EKM.dtype:
        _fail(op, f"x and w must share a dtype, got {x.dtype} and {w_EKM.dtype}")
    if not (x.device == w_EKM.device == offs_E.device):
        _fail(
            op,
            f"x, w, offs must be on one device, got {x.device}, {w_EKM.device}, {offs_E.device}",
        )


def check_gather(op: str, x_TK: torch.Tensor, src_N: torch.Tensor) -> None:
    if src_N.dim() != 1:
        _fail(op, f"src must be 1-D (rows,), got shape {tuple(src_N.shape)}")
    if src_N.dtype != torch.int64:
        _fail(op, f"src must be int64 (-1 = padding row), got {src_N.dtype}")
    if src_N.device != x_TK.device:
        _fail(op, f"src must be on x's device {x_TK.device}, got {src_N.device}")


def bin_counts(ids: torch.Tensor, bins: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 (bins,): how many entries of ``ids`` (int64 values in [0, bins), any shape) hold
    each value, each counted ``weights`` times (an integer or bool tensor of ``ids``' shape)
    when given. ``torch.bincount(ids, minlength=bins)`` without its host sync: CUDA's
    bincount reads the largest id to size its output. Integer adds: exact and deterministic."""
    ids = ids.reshape(-1)
    ones = torch.ones_like(ids) if weights is None else weights.reshape(-1).to(torch.int64)
    return torch.zeros(bins, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, ones)


def sorted_bin_ends(sorted_ids: torch.Tensor, bins: int) -> torch.Tensor:
    """int64 (bins,): for ids sorted ascending (values in [0, bins)), the end of each value's
    run, i.e. the cumulative counts: binary searches, no atomics and no host sync."""
    values = torch.arange(1, bins + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, values)


GROUP_SCORES = ("top2", "max")
"""How group-limited routing scores a group: the sum of its two best entries (DeepSeek-V3's
noaux_tc) or its best one (DeepSeek-V2's group_limited_greedy)."""


def check_groups(
    op: str,
    num_experts: int,
    top_k: int,
    n_groups: int,
    topk_groups: int,
    group_score: str = "top2",
) -> None:
    if n_groups < 1 or num_experts % n_groups:
        _fail(op, f"n_groups must be >= 1 and divide E={num_experts}, got {n_groups}")
    if group_score not in GROUP_SCORES:
        _fail(op, f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if n_groups == 1:
        return
    per_group = num_experts // n_groups
    if per_group < 2 and group_score == "top2":
        _fail(
            op,
            f"group-limited routing scores a group by its two best experts; {n_groups} "
            f"groups of E={num_experts} leave {per_group}",
        )
    if not 1 <= topk_groups <= n_groups:
        _fail(op, f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    if top_k > topk_groups * per_group:
        _fail(
            op,
            f"top_k={top_k} exceeds the {topk_groups * per_group} experts of "
            f"topk_groups={topk_groups} groups",
        )


def check_route(
    op: str,
    logits_TE: torch.Tensor,
    top_k: int,
    score_func: str,
    expert_bias_E: torch.Tensor | None,
) -> None:
    if logits_TE.dim() != 2:
        _fail(op, f"logits must be 2-D (T, E), got shape {tuple(logits_TE.shape)}")
    if logits_TE.dtype != torch.float32:
        _fail(op, f"logits must be float32, got {logits_TE.dtype}")
    num_experts = logits_TE.shape[1]
    if not 1 <= top_k <= num_experts:
        _fail(op, f"top_k must be in [1, E={num_experts}], got {top_k}")
    if score_func not in ("softmax", "sigmoid"):
        _fail(op, f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if expert_bias_E is not None:
        if expert_bias_E.shape != (num_experts,):
            _fail(
                op,
                f"expert_bias must have shape ({num_experts},), got {tuple(expert_bias_E.shape)}",
            )
        if expert_bias_E.device != logits_TE.device:
            _fail(op, f"expert_bias must be on logits' device {logits_TE.device}")


def check_dest(op: str, dest_TK: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    if dest_TK.dim() != 2 or dest_TK.shape[0] != num_tokens:
        _fail(op, f"dest must be 2-D (T={num_tokens}, K), got shape {tuple(dest_TK.shape)}")
    if dest_TK.dtype != torch.int64:
        _fail(op, f"dest must be int64 (-1 = dropped), got {dest_TK.dtype}")
    if dest_TK.device != device:
        _fail(op, f"dest must be on device {device}, got {dest_TK.device}")


def check_permute(op: str, x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> None:
    if x_TD.dim() != 2:
        _fail(op, f"x must be 2-D (T, D), got shape {tuple(x_TD.shape)}")
    check_float(op, "x", x_TD)
    check_dest(op, dest_TK, x_TD.shape[0], x_TD.device)
    if num_rows < 0:
        _fail(op, f"num_rows must be >= 0, got {num_rows}")


def check_unpermute(
    op: str, y_ND: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor
) -> None:
    if y_ND.dim() != 2:
        _fail(op, f"y must be 2-D (rows, D), got shape {tuple(y_ND.shape)}")
    check_float(op, "y", y_ND)
    if weights_TK.dim() != 2:
        _fail(op, f"weights must be 2-D (T, K), got shape {tuple(weights_TK.shape)}")
    check_dest(op, dest_TK, weights_TK.shape[0], y_ND.device)
    if weights_TK.shape != dest_TK.shape:
        _fail(
            op,
            f"weights {tuple(weights_TK.shape)} and dest {tuple(dest_TK.shape)} "
            "must have the same shape",
        )
    check_float(op, "weights", weights_TK)
    if weights_TK.device != y_ND.device:
        _fail(op, f"weights must be on y's device {y_ND.device}, got {weights_TK.device}")
