"""Router balancing losses and the autograd trick that applies them from inside the layer.

Every loss here is a mean of per-group (or per-token) terms, so a batch split into equal
micro-batches or equal data-parallel shards averages back to exactly the same value.

Excluded tokens (padding, and under ``model.document_mask`` each document's separator: the
tokens whose label the LM loss leaves out) are left out of every loss and statistic through
``valid_T``: means are taken over the valid tokens of each group, and the choices counted are
theirs. Under context parallelism a process holds 1/cp of every group's tokens;
``token_weights`` then weighs its tokens so that the mean over the processes sharing the
groups is the whole groups' value, however the valid tokens fall between them.

Shape legend: T tokens, E experts, K top-k, G token groups.
"""

from __future__ import annotations

import torch
from torch import nn


def balance_probs(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token distribution over experts for the balancing statistics: the softmax scores
    themselves, or sigmoid scores normalised to sum to one (DeepSeek-V3)."""
    if score_func == "softmax":
        return scores_TE
    return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def token_weights(
    valid_T: torch.Tensor, num_groups: int, valid_all_T: torch.Tensor | None = None
) -> torch.Tensor:
    """(G, T/G) weights of this process's tokens: valid ones get share / (valid tokens of
    their whole group), the others 0, so that sum(w * x) over a group is this process's share
    of the group's mean of x over its valid tokens (the shares of the processes holding the
    group's tokens, share = whole group / this process's part of it, average to the mean).
    ``valid_all_T``: validity of the whole groups' tokens (context parallelism)."""
    G = num_groups
    whole = valid_T if valid_all_T is None else valid_all_T
    share = whole.numel() / valid_T.numel()
    n_G = whole.reshape(G, -1).sum(1).clamp_min(1).to(torch.float32)
    return valid_T.reshape(G, -1).to(torch.float32) * (share / n_G)[:, None]


def load_balancing_loss(
    probs_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    num_groups: int,
    ids_all_TK: torch.Tensor | None = None,
    valid_T: torch.Tensor | None = None,
    valid_all_T: torch.Tensor | None = None,
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

    ``valid_T`` (``valid_all_T`` for the whole groups under context parallelism): only the
    valid tokens' probabilities and choices count, f and P are theirs (module doc).
    """
    T, E = probs_TE.shape
    G = num_groups
    counted = ids_TK if ids_all_TK is None else ids_all_TK
    n = counted.numel() // G  # assignments per group
    counts_GE = torch.zeros(G, E, device=probs_TE.device, dtype=probs_TE.dtype)
    if valid_T is None:
        P_GE = probs_TE.view(G, T // G, E).mean(1)
        counts_GE.scatter_add_(
            1, counted.reshape(G, n), torch.ones_like(counted, dtype=probs_TE.dtype).view(G, n)
        )
        return E * (counts_GE / n * P_GE).sum(-1).mean()
    w_GT = token_weights(valid_T, G, valid_all_T).to(probs_TE.dtype)
    P_GE = (w_GT[..., None] * probs_TE.view(G, T // G, E)).sum(1)
    whole = valid_T if valid_all_T is None else valid_all_T
    K = counted.shape[1]
    valid_A = whole.reshape(-1, 1).expand(-1, K).reshape(G, n).to(probs_TE.dtype)
    counts_GE.scatter_add_(1, counted.reshape(G, n), valid_A)
    f_GE = counts_GE / valid_A.sum(1, keepdim=True).clamp_min(1)
    return E * (f_GE * P_GE).sum(-1).mean()


def token_mean(x_T: torch.Tensor, w_GT: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of per-token values (T, ...) over the tokens, or with ``token_weights`` (G, T/G)
    the mean over the token groups of each group's mean over its valid tokens (so that a
    micro-batch cut into other micro-batches averages back to the same value)."""
    if w_GT is None:
        return x_T.mean(0)
    G = w_GT.shape[0]
    x_GtX = x_T.reshape(G, -1, *x_T.shape[1:])
    w = w_GT.reshape(*w_GT.shape, *([1] * (x_T.dim() - 1))).to(x_T.dtype)
    return (w * x_GtX).sum(1).mean(0)


def z_loss(lse_T: torch.Tensor, w_GT: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
    return token_mean(lse_T.float().pow(2), w_GT)


def router_entropy(probs_TE: torch.Tensor, w_GT: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the routing distribution."""
    p = probs_TE.float().clamp_min(1e-20)
    return token_mean(-(p * p.log()).sum(-1), w_GT)


class GlobalBalanceLoss(nn.Module):
    """The global-batch balancing loss of one MoE layer (``moe.global_aux_loss_coef``,
    Megatron-Core's global aux loss), the whole computation:

        L = E * sum_e f_e * P_e

    f_e: the fraction of the step's expert choices (every micro-batch and data-parallel rank,
    before drops, counted tokens only) that picked e, without gradient; P_e: the mean routing
    probability of e over a micro-batch's counted tokens. f is known once every forward of
    the step has counted, and only d/dP_e = E * f_e is needed for the gradient:

    1. ``count``: each training forward adds its choices to ``counts_E`` (this rank's, this
       step; ``begin_step`` zeroes them).
    2. ``set_step_counts``: the engine sums every layer's ``counts_E`` over dp x cp and hands
       the sum back before the step's first backward -- after a no-grad counting pass over
       the step's micro-batches, or, with one forward per rank and step, between that forward
       and its backward (``moetrain.train.routing_passes.RoutingPasses``: no forward is added
       where there was none). Every layout then uses the counts of one process on the whole
       global batch.
    3. ``term``: a micro-batch's share, coef * L with P its own, injected with the other
       balancing losses (``AuxLossInjector``). Its forward value is 0 and its backward gives P
       the gradient coef * E * f, f read when backward runs (``_StepFrequencyGradient``), which
       may be after a later forward. A layer used without an engine (no counts handed) uses
       its forward's own f. Under torch.compile the term runs eagerly: AOT autograd would
       trace its backward when it compiles the forward, with the f of that moment.
    4. ``value``: the loss's value for the logs, from the step's statistics once their counts
       are summed (``moetrain.train.metrics.layer_summary``).
    """

    def __init__(self, num_experts: int, coef: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.coef = coef
        E = num_experts
        self.register_buffer("counts_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("step_counts_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.step_counts_set = False

    def init_buffers(self) -> None:
        """Counts start at zero (``moetrain.model.init.init_buffers``)."""
        self.begin_step()
        self.step_counts_E.zero_()

    def begin_step(self) -> None:
        """Before a step's first forward: forget the previous step's counts."""
        self.counts_E.zero_()
        self.step_counts_set = False

    @torch.no_grad()
    def count(self, counts_E: torch.Tensor) -> None:
        """A training forward's expert choices (of its counted tokens, before drops)."""
        self.counts_E += counts_E

    def set_step_counts(self, counts_E: torch.Tensor) -> None:
        """The step's choices over every micro-batch and data-parallel rank (the f of every
        micro-batch's gradient); before the step's first backward."""
        self.step_counts_E.copy_(counts_E)
        self.step_counts_set = True

    # Eager under torch.compile (a graph break where the loss is on): AOT autograd traces a
    # backward when it compiles the forward, and would read f then -- this forward's own, not
    # the step's that the engine hands over later.
    @torch.compiler.disable
    def term(self, mean_probs_E: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the loss, for its gradient: 0 in value, coef * E * f to
        ``mean_probs_E`` (P) in backward. ``counts_E``: this forward's choices (f when no
        step counts are handed)."""
        local_f_E = counts_E.float() / counts_E.sum().clamp_min(1)
        return self.coef * _StepFrequencyGradient.apply(mean_probs_E, self, local_f_E)

    def e_times_f(self, local_f_E: torch.Tensor) -> torch.Tensor:
        """E * f, read when backward runs: the step's frequencies, or this forward's own."""
        if not self.step_counts_set:
            return self.num_experts * local_f_E
        counts = self.step_counts_E.to(local_f_E.device, torch.float64)
        return (self.num_experts * counts / counts.sum().clamp_min(1)).to(local_f_E.dtype)

    @staticmethod
    def value(tokens_per_expert_E: torch.Tensor, probs_sum_E: torch.Tensor,
              forwards: float) -> float:
        """E * sum_e f_e * P_e of a step: f_e from its expert counts summed over every
        micro-batch and rank, P_e its forwards' mean routing probability."""
        load_E = tokens_per_expert_E.double()
        f_E = load_E / load_E.sum().clamp_min(1)
        probs_E = probs_sum_E.double() / max(float(forwards), 1.0)
        return float(load_E.numel() * (f_E * probs_E).sum())


class _StepFrequencyGradient(torch.autograd.Function):
    """``GlobalBalanceLoss.term``: 0 in forward; in backward, ``grad * E f`` to P with f the
    owner's step frequencies as they are then (``GlobalBalanceLoss.e_times_f``)."""

    @staticmethod
    def forward(ctx, probs_E: torch.Tensor, owner: GlobalBalanceLoss,  # type: ignore[override]
                local_f_E: torch.Tensor) -> torch.Tensor:
        ctx.owner, ctx.local_f_E = owner, local_f_E
        return probs_E.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.owner.e_times_f(ctx.local_f_E), None, None


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
