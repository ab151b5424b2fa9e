"""Balancing losses against hand-computed values, and their gradient injection by MoELayer."""

from __future__ import annotations

import math

import pytest
import torch
from moetrain.kernels import route

from moetrain.config import MoEConfig
from moetrain.model.losses import balance_probs, load_balancing_loss, router_entropy, z_loss
from moetrain.model.moe import MoELayer

F64 = torch.float64


def test_load_balancing_uniform_routing_is_one(assert_close):
    # T=4, E=2, K=1: every token 50/50, assignments alternate.
    probs_TE = torch.full((4, 2), 0.5, dtype=F64)
    ids_TK = torch.tensor([[0], [1], [0], [1]])
    assert_close(load_balancing_loss(probs_TE, ids_TK, 1), 1.0)
    # T=4, E=4, K=2: uniform probabilities, each expert chosen twice.
    probs_TE = torch.full((4, 4), 0.25, dtype=F64)
    ids_TK = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert_close(load_balancing_loss(probs_TE, ids_TK, 1), 1.0)


# 4 tokens, 2 experts, top-1 (argmax): ids [0, 0, 1, 0].
PROBS_TE = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]
ARGMAX_IDS_TK = [[0], [0], [1], [0]]


def test_load_balancing_hand_computed(assert_close):
    # f = (3/4, 1/4), P = (2.6/4, 1.4/4) = (0.65, 0.35)
    # loss = 2 * (0.75 * 0.65 + 0.25 * 0.35) = 2 * 0.575 = 1.15
    loss = load_balancing_loss(torch.tensor(PROBS_TE, dtype=F64), torch.tensor(ARGMAX_IDS_TK), 1)
    assert_close(loss, 1.15)


def test_load_balancing_averages_groups(assert_close):
    # group 0 = tokens 0, 1: f = (1, 0), P = (0.85, 0.15) -> 2 * 0.85 = 1.7
    # group 1 = tokens 2, 3: f = (0.5, 0.5), P = (0.45, 0.55) -> 2 * 0.5 * 1.0 = 1.0
    loss = load_balancing_loss(torch.tensor(PROBS_TE, dtype=F64), torch.tensor(ARGMAX_IDS_TK), 2)
    assert_close(loss, (1.7 + 1.0) / 2)


def test_load_balancing_all_on_one_expert_is_num_experts(assert_close):
    probs_TE = torch.tensor([[1.0, 0.0, 0.0]] * 4, dtype=F64)
    ids_TK = torch.zeros(4, 1, dtype=torch.int64)
    assert_close(load_balancing_loss(probs_TE, ids_TK, 1), 3.0)


def test_z_loss_hand_computed(assert_close):
    # lse(0, 0) = ln 2; lse(ln 3, 0) = ln 4 = 2 ln 2 -> mean((ln 2)^2, 4 (ln 2)^2) = 2.5 (ln 2)^2
    logits_TE = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    lse_T = route(logits_TE, 1, backend="torch").lse_T
    assert_close(z_loss(lse_T), 2.5 * math.log(2.0) ** 2, dtype=torch.float32)


def test_router_entropy_hand_computed(assert_close):
    # entropies: ln 2, 0 (a certain choice), ln 4
    probs_TE = torch.tensor([[0.5, 0.5, 0, 0], [1, 0, 0, 0], [0.25] * 4], dtype=torch.float32)
    expected = (math.log(2.0) + 0.0 + math.log(4.0)) / 3
    assert_close(router_entropy(probs_TE), expected)


def test_balance_probs(assert_close):
    scores_TE = torch.tensor([[0.2, 0.6], [0.5, 0.5], [0.9, 0.1]], dtype=F64)
    assert_close(balance_probs(scores_TE, "softmax"), scores_TE)
    assert_close(balance_probs(scores_TE, "sigmoid"), [[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]])


# ----------------------------------------------------------------------- values MoELayer records


def router_reference(x_TD, gate_ED, cfg):
    """float64 router from its definition: probabilities for balancing and top-k ids."""
    logits_TE = x_TD.double() @ gate_ED.double().T
    if cfg.score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, -1)
        probs_TE = scores_TE
    else:
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
    ids_TK = scores_TE.detach().topk(cfg.top_k, -1).indices
    return logits_TE, probs_TE, ids_TK


def switch_loss_reference(probs_TE, ids_TK, num_experts, group_tokens):
    """E * sum_e f_e * P_e per group of ``group_tokens`` consecutive tokens, averaged."""
    values = []
    for start in range(0, probs_TE.shape[0], group_tokens):
        p_SE = probs_TE[start : start + group_tokens]
        ids = ids_TK[start : start + group_tokens].flatten()
        f_E = torch.bincount(ids, minlength=num_experts).double() / ids.numel()
        values.append(num_experts * (f_E * p_SE.mean(0)).sum())
    return torch.stack(values).mean()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("token_group_seqs", [None, 1, 2])
def test_moe_layer_records_loss_values(score_func, token_group_seqs, assert_close):
    B, S, D = 4, 5, 8
    cfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=8,
        score_func=score_func,
        token_group_seqs=token_group_seqs,
        kernels="torch",
    )
    torch.manual_seed(0)
    layer = MoELayer(D, cfg).train()
    x_BSD = torch.randn(B, S, D)
    with torch.no_grad():
        layer(x_BSD)
    stats = layer.pop_stats()

    x_TD = x_BSD.reshape(-1, D)
    logits_TE, probs_TE, ids_TK = router_reference(x_TD, layer.router.gate.weight, cfg)
    group_tokens = S * (token_group_seqs or B)
    assert_close(
        stats["aux_loss"],
        switch_loss_reference(probs_TE, ids_TK, 4, group_tokens),
        dtype=torch.float32,
        what="aux_loss",
    )
    # Sequence-level: the same statistic with one group per sequence.
    assert_close(
        stats["seq_aux_loss"],
        switch_loss_reference(probs_TE, ids_TK, 4, S),
        dtype=torch.float32,
        what="seq_aux_loss",
    )
    assert_close(
        stats["z_loss"],
        torch.logsumexp(logits_TE, -1).pow(2).mean(),
        dtype=torch.float32,
        what="z_loss",
    )
    entropy = -(probs_TE * probs_TE.log()).sum(-1).mean()
    assert_close(stats["entropy"], entropy, dtype=torch.float32, what="entropy")


# ---------------------------------------------------------------------------- gradient injection


def _loss_reference(name, x_TD, gate_ED, cfg, batch):
    """The loss from its definition (float64, independent of moetrain.model.losses)."""
    logits_TE, probs_TE, ids_TK = router_reference(x_TD, gate_ED, cfg)
    seq = x_TD.shape[0] // batch
    if name == "aux":
        group_tokens = seq * (cfg.token_group_seqs or batch)
        return switch_loss_reference(probs_TE, ids_TK, cfg.num_experts, group_tokens)
    if name == "seq_aux":
        return switch_loss_reference(probs_TE, ids_TK, cfg.num_experts, seq)
    return torch.logsumexp(logits_TE, -1).pow(2).mean()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("loss_name", ["aux", "seq_aux", "z"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("token_group_seqs", [1, None])
def test_moe_layer_injects_loss_gradient(
    score_func, loss_name, scale, token_group_seqs, assert_close
):
    B, S, D, coef = 2, 6, 8, 0.3
    coefs = {"aux_loss_coef": 0.0, "seq_aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    coefs[f"{loss_name}_loss_coef"] = coef
    cfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=8,
        score_func=score_func,
        token_group_seqs=token_group_seqs,
        kernels="torch",
        **coefs,
    )
    torch.manual_seed(0)
    layer = MoELayer(D, cfg).train()
    layer.step_context.aux_loss_scale = scale
    x_BSD = torch.randn(B, S, D)

    out_BSD = layer(x_BSD)
    (out_BSD * 0).sum().backward()

    gate64 = layer.router.gate.weight.detach().double().requires_grad_()
    loss = _loss_reference(loss_name, x_BSD.reshape(-1, D), gate64, cfg, B)
    (dgate_ED,) = torch.autograd.grad(loss, gate64)
    assert dgate_ED.abs().max() > 1e-3, "the reference gradient must not vanish"
    assert_close(
        layer.router.gate.weight.grad,
        coef * scale * dgate_ED,
        dtype=torch.float32,
        what=f"injected d({loss_name})/d(gate)",
    )
    # The zeroed output carries no gradient to the experts.
    assert layer.experts.w1.grad.abs().max() == 0


def test_no_injection_in_eval_mode():
    cfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=8,
        aux_loss_coef=1.0,
        seq_aux_loss_coef=1.0,
        z_loss_coef=1.0,
        kernels="torch",
    )
    torch.manual_seed(0)
    layer = MoELayer(8, cfg).eval()
    (layer(torch.randn(2, 6, 8)) * 0).sum().backward()
    assert layer.router.gate.weight.grad.abs().max() == 0
