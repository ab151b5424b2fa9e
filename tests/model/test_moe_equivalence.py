"""MoELayer against independent references (MegaBlocks / ScatterMoE style).

- one expert, top-1, dropless == the dense SwiGLU FeedForward;
- dropless == capacity mode that cannot drop == the padded layout of that capacity;
- a float64 per-token loop, router and drop decision rebuilt from their definitions, matches
  the forward and the gradients of the input, the gate and every expert weight.

Balancing-loss coefficients are zero here so that only the routed computation is compared
(their gradient injection is tested in test_losses.py).

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, F expert FFN dim, E experts,
K top-k.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe import MoELayer
from moetrain.model.transformer import FeedForward

B, S, D, F, E, K = 2, 6, 8, 16, 4, 2
NO_AUX = {"aux_loss_coef": 0.0, "seq_aux_loss_coef": 0.0, "z_loss_coef": 0.0}


def make_layer(cfg: MoEConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(D, cfg).train()
    with torch.no_grad():
        # Gate weights large enough that routing is far from uniform (and from ties).
        layer.router.gate.weight.normal_(std=0.5)
    return layer


def layer_params(layer: MoELayer) -> list[torch.Tensor]:
    params = [layer.router.gate.weight, layer.experts.w1, layer.experts.w3, layer.experts.w2]
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        params += [shared.w1.weight, shared.w3.weight, shared.w2.weight]
    return params


PARAM_NAMES = ["gate", "w1", "w3", "w2", "shared.w1", "shared.w3", "shared.w2"]


def forward_and_grads(layer: MoELayer, x_BSD: torch.Tensor, dout_BSD: torch.Tensor):
    """Output and d(sum(out * dout)) w.r.t. the input and every parameter."""
    x_BSD = x_BSD.detach().requires_grad_()
    out_BSD = layer(x_BSD)
    inputs = [x_BSD, *layer_params(layer)]
    grads = torch.autograd.grad((out_BSD * dout_BSD).sum(), inputs)
    return out_BSD.detach(), grads


def assert_same_run(actual, expected, assert_close, dtype=torch.float32):
    out_a, grads_a = actual
    out_e, grads_e = expected
    assert_close(out_a, out_e, dtype=dtype, what="output")
    names = ["input", *PARAM_NAMES]
    assert len(grads_a) == len(grads_e)
    for name, g_a, g_e in zip(names, grads_a, grads_e, strict=False):
        assert_close(g_a, g_e, dtype=dtype, what=f"d/d{name}")


def random_inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, D, generator=gen), torch.randn(B, S, D, generator=gen)


# --------------------------------------------------------------------------- one expert == dense


def test_one_expert_top1_equals_dense_swiglu(assert_close):
    cfg = MoEConfig(num_experts=1, top_k=1, expert_ffn_dim=F, kernels="torch", **NO_AUX)
    layer = make_layer(cfg)
    dense = FeedForward(D, F)
    # Expert weights are (E, D, F) / (E, F, D) = (in, out); nn.Linear stores (out, in).
    with torch.no_grad():
        dense.w1.weight.copy_(layer.experts.w1[0].T)
        dense.w3.weight.copy_(layer.experts.w3[0].T)
        dense.w2.weight.copy_(layer.experts.w2[0].T)
    x_BSD, dout_BSD = random_inputs()

    out_moe, (dx_moe, dgate, dw1, dw3, dw2) = forward_and_grads(layer, x_BSD, dout_BSD)

    x_dense = x_BSD.clone().requires_grad_()
    out_dense = dense(x_dense)
    dx_dense, dw1_dense, dw3_dense, dw2_dense = torch.autograd.grad(
        (out_dense * dout_BSD).sum(), [x_dense, dense.w1.weight, dense.w3.weight, dense.w2.weight]
    )
    assert_close(out_moe, out_dense, what="output")
    assert_close(dx_moe, dx_dense, what="d/dinput")
    assert_close(dw1[0], dw1_dense.T, what="d/dw1")
    assert_close(dw3[0], dw3_dense.T, what="d/dw3")
    assert_close(dw2[0], dw2_dense.T, what="d/dw2")
    # softmax over one expert is constant 1: the gate gets no gradient.
    assert dgate.abs().max() == 0


# ---------------------------------------------------------------- dropless == no-drop capacity


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("token_group_seqs", [None, 1])
def test_dropless_equals_capacity_without_drops(score_func, token_group_seqs, assert_close):
    # capacity_factor = E / K gives capacity = group tokens: no expert can overflow.
    common = {
        "num_experts": E,
        "top_k": K,
        "expert_ffn_dim": F,
        "score_func": score_func,
        "token_group_seqs": token_group_seqs,
        "kernels": "torch",
        **NO_AUX,
    }
    dropless = make_layer(MoEConfig(**common))
    x_BSD, dout_BSD = random_inputs()
    expected = forward_and_grads(dropless, x_BSD, dout_BSD)
    assert int(dropless.pop_stats()["dropped"]) == 0

    for pad in (False, True):
        capped = MoELayer(D, MoEConfig(capacity_factor=E / K, pad_to_capacity=pad, **common))
        capped.load_state_dict(dropless.state_dict())
        capped.train()
        assert_same_run(forward_and_grads(capped, x_BSD, dout_BSD), expected, assert_close)
        assert int(capped.pop_stats()["dropped"]) == 0


# -------------------------------------------------------------------- per-token loop reference


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * (1.0 / (1.0 + torch.exp(-x)))


def kept_assignments(ids_TK, scores_TK, num_groups, cap, drop_policy):
    """The drop decision from its definition: within each token group, each expert keeps its
    ``cap`` highest-scoring assignments ("probs") or those of the earliest tokens."""
    T = ids_TK.shape[0]
    per_group = T // num_groups
    keep = torch.zeros(T, K, dtype=torch.bool)
    for g in range(num_groups):
        for e in range(E):
            cands = [
                (t, k)
                for t in range(g * per_group, (g + 1) * per_group)
                for k in range(K)
                if int(ids_TK[t, k]) == e
            ]
            if drop_policy == "probs":
                cands.sort(key=lambda tk: -float(scores_TK[tk]))
            for t, k in cands[:cap]:
                keep[t, k] = True
    return keep


def moe_loop_reference(x_TD, params, cfg: MoEConfig, num_groups: int):
    """float64, one token at a time: route, drop, sum_k w_k * swiglu_e(x) (+ shared experts).

    Returns the outputs (T, D) and the number of dropped assignments.
    """
    gate_ED, w1_EDF, w3_EDF, w2_EFD = params[:4]
    logits_TE = x_TD @ gate_ED.T
    if cfg.score_func == "softmax":
        exp_TE = torch.exp(logits_TE - logits_TE.max(-1, keepdim=True).values)
        scores_TE = exp_TE / exp_TE.sum(-1, keepdim=True)
    else:
        scores_TE = 1.0 / (1.0 + torch.exp(-logits_TE))
    ids_TK = scores_TE.detach().topk(K, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if cfg.renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)

    T = x_TD.shape[0]
    if cfg.capacity_factor is None:
        keep_TK = torch.ones(T, K, dtype=torch.bool)
    else:
        cap = math.ceil(cfg.capacity_factor * (T // num_groups) * K / E)
        keep_TK = kept_assignments(
            ids_TK, scores_TE.detach().gather(1, ids_TK), num_groups, cap, cfg.drop_policy
        )

    rows = []
    for t in range(T):
        x_D = x_TD[t]
        y_D = torch.zeros_like(x_D)
        for k in range(K):
            if not keep_TK[t, k]:
                continue
            e = int(ids_TK[t, k])
            h_F = silu(x_D @ w1_EDF[e]) * (x_D @ w3_EDF[e])
            y_D = y_D + weights_TK[t, k] * (h_F @ w2_EFD[e])
        if len(params) > 4:
            sw1_HD, sw3_HD, sw2_DH = params[4:]
            y_D = y_D + sw2_DH @ (silu(sw1_HD @ x_D) * (sw3_HD @ x_D))
        rows.append(y_D)
    return torch.stack(rows), int((~keep_TK).sum())


MODES = {
    "dropless": {},
    "capacity-probs": {"capacity_factor": 0.5, "drop_policy": "probs"},
    "capacity-position": {"capacity_factor": 0.5, "drop_policy": "position"},
    "padded-probs": {"capacity_factor": 0.5, "drop_policy": "probs", "pad_to_capacity": True},
}
SCORING = {
    "softmax": {"score_func": "softmax", "renormalize": True},
    "sigmoid": {"score_func": "sigmoid", "renormalize": True},
    "softmax-raw": {"score_func": "softmax", "renormalize": False},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("scoring", list(SCORING))
@pytest.mark.parametrize("num_shared_experts", [0, 2])
def test_matches_per_token_loop(mode, scoring, num_shared_experts, assert_close):
    # token_group_seqs=1: two groups of S=6 tokens; capacity ceil(0.5 * 6 * 2 / 4) = 2 against
    # an average load of 3 per expert and group, so the capacity modes do drop.
    cfg = MoEConfig(
        num_experts=E,
        top_k=K,
        expert_ffn_dim=F,
        num_shared_experts=num_shared_experts,
        token_group_seqs=1,
        kernels="torch",
        **MODES[mode],
        **SCORING[scoring],
        **NO_AUX,
    )
    layer = make_layer(cfg)
    x_BSD, dout_BSD = random_inputs()

    actual = forward_and_grads(layer, x_BSD, dout_BSD)

    x64_TD = x_BSD.reshape(B * S, D).double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in layer_params(layer)]
    out64_TD, dropped = moe_loop_reference(x64_TD, params64, cfg, num_groups=B)
    grads64 = torch.autograd.grad(
        (out64_TD * dout_BSD.reshape(B * S, D)).sum(), [x64_TD, *params64]
    )
    expected = (out64_TD.view(B, S, D), (grads64[0].view(B, S, D), *grads64[1:]))

    assert_same_run(actual, expected, assert_close)
    stats = layer.pop_stats()
    assert int(stats["dropped"]) == dropped
    if cfg.capacity_factor is not None:
        assert dropped > 0, "the capacity case must exercise dropping"
