"""Quantile balancing (``moe.quantile_balancing``): the expert bias that would have balanced
the step, read from a histogram of the bias each token needed.

Experts are selected by score + bias (``Router``). For token t with router scores s_t, let
c_t be the (k+1)-th highest of its biased scores s_te + b_e: the score an expert must beat to
enter t's top k. Expert e would be among t's choices with a bias of at least

    r_te = c_t - s_te        (the other experts' biases unchanged)

so a bias b'_e has e chosen by the tokens whose r_te <= b'_e, and the bias that has e chosen
by exactly its balanced share, T * K / E of the step's T tokens, is the (K / E)-quantile of
r_e over those tokens. Each forward counts its tokens' r_te per expert into ``bins`` equal
bins over [min(b) - 1, max(b) + 1] (scores lie in [0, 1], so every r_te does too); the step's
counts are summed over micro-batches and ranks (integers: every layout sums them exactly),
and after the optimizer step each expert's bias becomes its quantile, interpolated linearly
within the bin where the cumulative count reaches T * K / E, then mean-centred (a common
shift changes no token's choice) and mixed with the previous bias by ``ema``.

This is the two-part rule of Megatron-Core's ``quantile_balancing`` and Kimi K3's report,
with the histogram estimate of torchtitan and Transformer Engine. It needs no host sync: the
bins and the update are tensor operations on the device.
"""

from __future__ import annotations

import torch


def bias_range(bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of the histogram for a layer whose current bias is ``bias_E`` (0-d tensors,
    fp64): [min(b) - 1, max(b) + 1] holds every r_te, since scores lie in [0, 1]."""
    b = bias_E.detach().double()
    return b.min() - 1.0, b.max() + 1.0


def required_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """r_te = c_t - s_te, (T, E) fp64: the bias expert e needs to enter token t's top
    ``top_k``, with c_t the (top_k + 1)-th highest biased score of token t."""
    s = scores_TE.detach().double()
    cutoff_T = torch.topk(s + bias_E.detach().double(), top_k + 1, dim=-1).values[:, -1]
    return cutoff_T[:, None] - s


def required_bias_histogram(
    scores_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    bins: int,
    valid_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """(E, bins) float32 counts of the tokens' r_te per expert over ``bias_range(bias_E)``
    (``valid_T``: only the tokens that count; padding is left out)."""
    T, E = scores_TE.shape
    lo, hi = bias_range(bias_E)
    r_TE = required_bias(scores_TE, bias_E, top_k)
    bin_TE = ((r_TE - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).long()
    flat_TE = bin_TE + torch.arange(E, device=bin_TE.device)[None, :] * bins
    weight_TE = torch.ones(T, E, device=scores_TE.device)
    if valid_T is not None:
        weight_TE = weight_TE * valid_T[:, None].to(weight_TE.dtype)
    hist = torch.zeros(E * bins, device=scores_TE.device)
    # index_add of ones: exact integer counts in any order (below 2**24 a bin).
    hist.index_add_(0, flat_TE.reshape(-1), weight_TE.reshape(-1))
    return hist.view(E, bins)


def quantile_bias(
    hist_EB: torch.Tensor, bias_E: torch.Tensor, assignments: torch.Tensor
) -> torch.Tensor:
    """The mean-centred bias (E,) fp64 at which each expert would have been chosen
    ``assignments / E`` times, from the step's summed ``required_bias_histogram`` counts
    (``bias_E``: the bias they were counted under, which fixes the bins; ``assignments``:
    the step's T * K). Where the step counted no token the bias is returned unchanged."""
    E, bins = hist_EB.shape
    lo, hi = bias_range(bias_E)
    width = (hi - lo) / bins
    hist = hist_EB.double()
    target = assignments.double() / E
    cum_EB = hist.cumsum(1)
    # The first bin whose cumulative count reaches the target, and the count before it.
    j_E = torch.searchsorted(cum_EB, target.expand(E, 1).contiguous()).clamp_(max=bins - 1)
    before_E = torch.where(j_E > 0, cum_EB.gather(1, (j_E - 1).clamp(min=0)), 0.0)[:, 0]
    in_bin_E = hist.gather(1, j_E)[:, 0]
    frac_E = ((target - before_E) / in_bin_E.clamp(min=1.0)).clamp(0.0, 1.0)
    estimate_E = lo + width * (j_E[:, 0].double() + frac_E)
    estimate_E = estimate_E - estimate_E.mean()
    return torch.where(target > 0, estimate_E, bias_E.detach().double())
