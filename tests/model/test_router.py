"""Router math on hand-written logits: selection, scores, combine weights, bias, jitter, fp32 gate.

The gate is set to the identity (D == E), so the router input *is* the logit matrix and every
expected value below is written from the logits alone.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe import MoELayer, Router
from moetrain.model.transformer import FeedForward

# 3 tokens x 4 experts, no ties among the scores of a token.
LOGITS_TE = [
    [1.0, 3.0, 2.0, 0.0],
    [0.5, 0.0, 5.0, -1.0],
    [2.0, 1.0, 0.0, 4.0],
]
TOP2_IDS_TK = [[1, 2], [2, 0], [3, 0]]


def identity_router(cfg: MoEConfig) -> Router:
    router = Router(cfg.num_experts, cfg)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(cfg.num_experts))
    return router


def scores_reference(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """float64 scores written out from their definitions."""
    logits_TE = logits_TE.double()
    if score_func == "softmax":
        exp_TE = torch.exp(logits_TE - logits_TE.max(-1, keepdim=True).values)
        return exp_TE / exp_TE.sum(-1, keepdim=True)
    return 1.0 / (1.0 + torch.exp(-logits_TE))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_ids_scores_and_weights(score_func, renormalize, assert_close):
    cfg = MoEConfig(num_experts=4, top_k=2, score_func=score_func, renormalize=renormalize)
    router = identity_router(cfg)
    logits_TE = torch.tensor(LOGITS_TE)

    r = router(logits_TE, "torch")

    assert r.ids_TK.tolist() == TOP2_IDS_TK
    scores_TE = scores_reference(logits_TE, score_func)
    assert r.scores_TE.dtype == torch.float32
    assert_close(r.scores_TE, scores_TE, what="scores")
    chosen_TK = scores_TE.gather(1, torch.tensor(TOP2_IDS_TK))
    weights_TK = chosen_TK / chosen_TK.sum(-1, keepdim=True) if renormalize else chosen_TK
    assert_close(r.weights_TK, weights_TK, what="combine weights")
    lse_T = torch.log(torch.exp(logits_TE.double()).sum(-1))
    assert_close(r.lse_T, lse_T, what="logsumexp")
    assert r.counts_E.tolist() == [2, 1, 2, 1]


def test_softmax_weights_hand_values(assert_close):
    # Token 0 picks experts 1 and 2 (logits 3 and 2): renormalised softmax over the pair is
    # (e^3, e^2) / (e^3 + e^2) = (1, e^-1) / (1 + e^-1), independent of the other logits.
    cfg = MoEConfig(num_experts=4, top_k=2, score_func="softmax", renormalize=True)
    r = identity_router(cfg)(torch.tensor(LOGITS_TE), "torch")
    e_inv = torch.exp(torch.tensor(-1.0, dtype=torch.float64))
    assert_close(r.weights_TK[0], torch.stack([1 / (1 + e_inv), e_inv / (1 + e_inv)]))


def test_router_bias_is_gpt_oss_softmax_over_the_biased_top_k_logits(assert_close):
    """gpt-oss routes by softmax over the top-k of (logits + bias): the renormalised top-k of
    a softmax (``moe.renormalize``) over the biased logits is the same thing. The bias moves
    both the choice and the weights, and is trained (unlike the selection-only expert_bias)."""
    cfg = MoEConfig(num_experts=4, top_k=2, score_func="softmax", renormalize=True,
                    router_bias=True)  # fmt: skip
    router = identity_router(cfg)
    bias_E = torch.tensor([0.0, -2.5, 0.0, 1.0])
    with torch.no_grad():
        router.gate.bias.copy_(bias_E)
    logits_TE = torch.tensor(LOGITS_TE, requires_grad=True)
    r = router(logits_TE, "torch")
    biased_TE = torch.tensor(LOGITS_TE, dtype=torch.float64) + bias_E.double()
    top_TK, ids_TK = biased_TE.topk(2, dim=-1)
    assert r.ids_TK.tolist() == ids_TK.tolist() != TOP2_IDS_TK  # the bias changed a choice
    assert_close(r.weights_TK, torch.softmax(top_TK, dim=-1))
    r.weights_TK[:, 0].sum().backward()
    assert router.gate.bias.grad is not None and router.gate.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_expert_bias_changes_selection_not_weights(score_func, assert_close):
    cfg = MoEConfig(num_experts=4, top_k=2, score_func=score_func, expert_bias_rate=0.01)
    router = identity_router(cfg)
    logits_TE = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    unbiased = router(logits_TE, "torch")
    assert unbiased.ids_TK.tolist() == [[0, 1]]

    # A bias of +1 on expert 3 outranks every score in [0, 1]: it is selected first.
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    biased = router(logits_TE, "torch")

    assert biased.ids_TK.tolist() == [[3, 0]]
    scores_TE = scores_reference(logits_TE, score_func)
    chosen_TK = scores_TE[:, [3, 0]]
    assert_close(
        biased.weights_TK,
        chosen_TK / chosen_TK.sum(-1, keepdim=True),
        what="weights must come from the unbiased scores",
    )
    assert_close(biased.scores_TE, scores_TE, what="scores_TE must stay unbiased")


def _jitter_factors(router: Router, x_TE: torch.Tensor) -> torch.Tensor:
    """With an identity gate and sigmoid scores, logit(score) is the (jittered) input."""
    scores_TE = router(x_TE, "torch").scores_TE.double()
    return torch.log(scores_TE / (1 - scores_TE)) / x_TE.double()


def test_jitter_scales_router_input_within_eps_in_training_only(assert_close):
    eps = 0.2
    num_experts = 8
    cfg = MoEConfig(num_experts=num_experts, top_k=2, score_func="sigmoid", jitter_eps=eps)
    router = identity_router(cfg)
    gen = torch.Generator().manual_seed(0)
    # |x| in [0.5, 2]: sigmoid stays well away from 0 and 1, so logit() inverts it accurately.
    mag_TE = 0.5 + 1.5 * torch.rand(64, num_experts, generator=gen)
    sign_TE = torch.where(torch.rand(64, num_experts, generator=gen) < 0.5, -1.0, 1.0)
    x_TE = mag_TE * sign_TE

    torch.manual_seed(0)
    router.train()
    factors_TE = _jitter_factors(router, x_TE)
    slack = 1e-4  # fp32 error of the sigmoid/logit round trip, far below eps
    assert factors_TE.min() >= 1 - eps - slack and factors_TE.max() <= 1 + eps + slack, (
        f"jitter factors span [{factors_TE.min():.4f}, {factors_TE.max():.4f}], "
        f"allowed [{1 - eps}, {1 + eps}]"
    )
    # 512 draws of U(0.8, 1.2): the jitter is real and covers the range.
    assert factors_TE.min() < 1 - eps / 2 and factors_TE.max() > 1 + eps / 2
    # Elementwise, not one factor per token.
    assert (factors_TE.std(-1) > eps / 10).all()

    router.eval()
    assert_close(
        _jitter_factors(router, x_TE).float(),
        torch.ones_like(x_TE),
        what="eval-mode router input must not be jittered",
    )


def test_jitter_off_when_eps_zero(assert_close):
    cfg = MoEConfig(num_experts=4, top_k=2, score_func="sigmoid", jitter_eps=0.0)
    router = identity_router(cfg).train()
    x_TE = torch.tensor(LOGITS_TE) + 0.5  # no zeros
    assert_close(_jitter_factors(router, x_TE).float(), torch.ones_like(x_TE))


def test_jitter_does_not_reach_the_experts(assert_close):
    # One expert, top-1: the router weight is exactly 1 whatever its input, so the layer output
    # is the expert applied to the *unjittered* tokens even in training mode with jitter on.
    dim, ffn = 8, 16
    cfg = MoEConfig(
        num_experts=1,
        top_k=1,
        expert_ffn_dim=ffn,
        jitter_eps=0.5,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        kernels="torch",
    )
    torch.manual_seed(0)
    layer = MoELayer(dim, cfg).train()
    dense = FeedForward(dim, ffn)
    with torch.no_grad():
        dense.w1.weight.copy_(layer.experts.w1[0].T)
        dense.w3.weight.copy_(layer.experts.w3[0].T)
        dense.w2.weight.copy_(layer.experts.w2[0].T)
    x_BSD = torch.randn(2, 5, dim)
    with torch.no_grad():
        assert_close(layer(x_BSD), dense(x_BSD))


@pytest.mark.parametrize("autocast", [True, False])
def test_gate_runs_in_fp32_for_bf16_input(autocast, assert_close):
    dim, num_experts = 64, 8
    cfg = MoEConfig(num_experts=num_experts, top_k=2)
    torch.manual_seed(0)
    router = Router(dim, cfg)
    with torch.no_grad():
        router.gate.weight.normal_()  # logits of magnitude ~8: bf16 would round them by ~0.03
    x_TD = torch.randn(32, dim).bfloat16()

    with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=autocast):
        r = router(x_TD, "torch")

    assert r.scores_TE.dtype == torch.float32
    assert r.weights_TK.dtype == torch.float32
    logits_TE = x_TD.double() @ router.gate.weight.double().T
    assert_close(
        r.scores_TE,
        scores_reference(logits_TE, "softmax"),
        dtype=torch.float32,
        what="scores under bf16 autocast",
    )
    assert_close(
        r.lse_T,
        torch.logsumexp(logits_TE, -1),
        dtype=torch.float32,
        what="logsumexp under bf16 autocast",
    )


def test_jitter_is_a_function_of_where_the_token_is_not_of_the_layout():
    """The jitter a token's router input gets depends on (seed, step, layer, global sequence,
    position, feature) only: a batch routed whole or as two micro-batches, or a rank holding
    the second half of the global batch, draws the same factors; another step or layer draws
    others. Across a large draw the factors are uniform on [1 - eps, 1 + eps)."""
    from moetrain.model.jitter import jitter_factors

    eps, S, D = 0.1, 8, 16
    seq_T = torch.arange(6).repeat_interleave(S)
    pos_T = torch.arange(S).repeat(6)
    whole = jitter_factors(eps, (3, 5, 1), seq_T, pos_T, D)
    halves = torch.cat(
        [
            jitter_factors(eps, (3, 5, 1), seq_T[i : i + 3 * S], pos_T[i : i + 3 * S], D)
            for i in (0, 3 * S)
        ]
    )
    assert torch.equal(whole, halves)
    for key in ((3, 6, 1), (3, 5, 2), (4, 5, 1)):
        other = jitter_factors(eps, key, seq_T, pos_T, D)
        assert (other != whole).float().mean() > 0.99, key
    big = jitter_factors(
        eps, (0, 0, 0), torch.arange(4096).repeat_interleave(64), torch.arange(64).repeat(4096), 64
    ).flatten()
    assert 1 - eps <= big.min() and big.max() < 1 + eps
    u = ((big - (1 - eps)) / (2 * eps)).sort().values.double()
    n = u.numel()
    ks = (u - torch.arange(n, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / n**0.5, f"Kolmogorov-Smirnov statistic {ks:.2e} (1% level)"


def test_jitter_keys_follow_the_layers_sequence_counter():
    """MoELayer keys the jitter by its step key and the sequences it saw this step: two
    micro-batches of 2 get the factors of one micro-batch of 4."""
    D, S = 8, 4
    cfg = MoEConfig(num_experts=4, top_k=2, jitter_eps=0.3, expert_ffn_dim=8, kernels="torch")
    layer = MoELayer(D, cfg, layer_id=3).train()
    layer.set_jitter_key(seed=7, step=2, seq_offset=10)
    _, seq_a, pos_a = layer._jitter_at(2, S, torch.device("cpu"))
    layer.stats.rows += 2  # what a training forward of 2 sequences leaves behind
    _, seq_b, _ = layer._jitter_at(2, S, torch.device("cpu"))
    layer.set_jitter_key(seed=7, step=2, seq_offset=10)
    key, seq_all, pos_all = layer._jitter_at(4, S, torch.device("cpu"))
    assert key == (7, 2, 3)
    assert torch.equal(torch.cat([seq_a, seq_b]), seq_all)
    assert torch.equal(seq_all, torch.arange(10, 14).repeat_interleave(S))
    assert torch.equal(pos_a, torch.arange(S).repeat(2))
    assert layer.eval()._jitter_at(4, S, torch.device("cpu")) is None
