"""Router balancing losses and the autograd trick that applies them from inside the layer.

Every loss here is a mean of per-group (or per-token) terms, so a batch split into equal
micro-batches or equal data-parallel shards averages back to exactly the same value.

Shape legend: T tokens, E experts, K top-k, G token groups.
"""

from __future__ import annotations

import torch


def balance_probs(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token distribution over experts for the balancing statistics: the softmax scores
    themselves, or sigmoid scores normalised to sum to one (DeepSeek-V3)."""
    if score_func == "softmax":
        return scores_TE
    return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def load_balancing_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    num_groups: int,
    ids_all_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch load-balancing loss, mean over token groups of E * sum_e f_e * P_e.

    f_e: fraction of the group's T*K assignments that chose expert e (before capacity drops,
    no gradient); P_e: mean probability of expert e over the group's tokens. Equals 1 when
    routing is perfectly uniform, E when every token picks the same experts with certainty.

    ``ids_all_TK``: when this process holds only an equal part of every group's tokens
    (context parallelism), the choices of all of the groups' tokens: f counts them, P
    averages this process's tokens. The loss is linear in P, so the mean of this value over
    the processes sharing the groups is the whole groups' loss (and so is its gradient,
    averaged over them as every gradient is).
    """
    T, E = probs_TE.shape
    G = num_groups
    P_GE = probs_TE.view(G, T // G, E).mean(1)
    counted = ids_TK if ids_all_TK is None else ids_all_TK
    n = counted.numel() // G  # assignments per group
    counts_GE = torch.zeros(G, E, device=probs_TE.device, dtype=probs_TE.dtype)
    counts_GE.scatter_add_(
        1, counted.reshape(G, n), torch.ones_like(counted, dtype=probs_TE.dtype).view(G, n)
    )
    f_GE = counts_GE / n
    return E * (f_GE * P_GE).sum(-1).mean()


def z_loss(lse_T: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
    return lse_T.float().pow(2).mean()


def router_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the routing distribution."""
    p = probs_TE.float().clamp_min(1e-20)
    return -(p * p.log()).sum(-1).mean()


class DeferredBalanceLoss(torch.autograd.Function):
    """The global-batch balancing loss ``E * sum_e f_e * P_e`` of one micro-batch, for its
    gradient only: ``f`` (expert frequencies over the whole step) is read when backward runs.

    ``f`` carries no gradient, so d/dP_e = E * f_e and nothing else of the loss is needed:
    ``read_Ef()`` returns E * f, and the engine makes it the step's global frequencies before
    any backward of the step, which may be after this forward (a step of one forward per
    rank: no pre-pass). The forward value is 0 -- the loss's value is computed from the
    statistics once the step's counts are known (``moetrain.train.metrics.layer_summary``).
    """

    @staticmethod
    def forward(ctx, probs_E: torch.Tensor, read_Ef) -> torch.Tensor:  # type: ignore[override]
        ctx.read_Ef = read_Ef
        return probs_E.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.read_Ef(), None


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward, gives ``aux`` the gradient ``scale``.

    This attaches a balancing loss to the layer's output, so that its gradient flows in
    the same backward pass as the LM loss without the loss value having to travel out of
    the model. Pipeline schedules backpropagate only the last stage's loss; losses of
    layers on other stages reach the optimizer this way all the same.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad_x, torch.full(shape, ctx.scale, dtype=dtype, device=device), None
