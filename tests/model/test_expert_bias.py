"""Aux-loss-free balancing (expert bias) and the statistics MoELayer accumulates."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe import MoELayer

D = 4  # == num_experts below, so an identity gate makes the input the logits


def identity_gate_layer(**overrides) -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, kernels="torch", **overrides)
    torch.manual_seed(0)
    layer = MoELayer(D, cfg)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(4))
    return layer


def test_update_expert_bias_hand_example(assert_close):
    layer = identity_gate_layer(expert_bias_rate=0.1)
    # mean load 6: expert 0 over-loaded, expert 1 under-loaded, experts 2 and 3 balanced.
    layer.update_expert_bias(torch.tensor([10, 2, 6, 6]))
    assert_close(layer.router.expert_bias, [-0.1, 0.1, 0.0, 0.0], dtype=torch.float32)
    # Steps accumulate; the size of the imbalance does not matter, only its sign.
    layer.update_expert_bias(torch.tensor([1, 100, 0, 3]))  # mean 26
    assert_close(layer.router.expert_bias, [0.0, 0.0, 0.1, 0.1], dtype=torch.float32)


def test_expert_bias_steers_layer_selection_when_enabled():
    layer = identity_gate_layer(expert_bias_rate=0.1).train()
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    # logits favour experts 0 and 1 for every token; the bias forces expert 3 in.
    x_BSD = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(1, 6, 4)
    with torch.no_grad():
        layer(x_BSD)
    assert layer.pop_stats()["tokens_per_expert"].tolist() == [6, 0, 0, 6]


def test_rate_zero_is_a_no_op_and_bias_is_ignored():
    layer = identity_gate_layer(expert_bias_rate=0.0).train()
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    layer.update_expert_bias(torch.tensor([10, 2, 6, 6]))
    assert layer.router.expert_bias.tolist() == [0.0, 0.0, 0.0, 5.0]

    x_BSD = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(1, 6, 4)
    with torch.no_grad():
        layer(x_BSD)
    # The unbiased top-2 (experts 0 and 1), not the biased one.
    assert layer.pop_stats()["tokens_per_expert"].tolist() == [6, 6, 0, 0]


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_pop_stats_sums_training_forwards_and_resets(capacity_factor, assert_close):
    B, S, K = 2, 3, 2
    T = B * S
    layer = identity_gate_layer(capacity_factor=capacity_factor).train()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, S, D, generator=gen) for _ in range(2)]

    for x_BSD in xs:
        layer(x_BSD).sum().backward()
    stats = layer.pop_stats()

    assert stats["calls"].item() == 2
    assert stats["assignments"].item() == 2 * T * K
    assert stats["tokens_per_expert"].sum().item() == 2 * T * K
    # Counted before capacity drops: the routed choices of both forwards, rebuilt here.
    ids = torch.cat([torch.softmax(x.reshape(T, D).double(), -1).topk(K).indices for x in xs])
    assert (
        stats["tokens_per_expert"].tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()
    )
    if capacity_factor is None:
        assert stats["dropped"].item() == 0
    else:
        # cap = ceil(0.5 * 6 * 2 / 4) = 2 per expert and forward: anything beyond is dropped.
        loads = [torch.bincount(ids[i * T : (i + 1) * T].flatten(), minlength=4) for i in (0, 1)]
        expected_dropped = sum(int((load - 2).clamp_min(0).sum()) for load in loads)
        assert expected_dropped > 0
        assert stats["dropped"].item() == expected_dropped
    # z-loss of each forward, summed.
    lse = [torch.logsumexp(x.reshape(T, D).double(), -1) for x in xs]
    assert_close(stats["z_loss"], sum(v.pow(2).mean() for v in lse), dtype=torch.float32)

    again = layer.pop_stats()
    for name in ("calls", "assignments", "dropped", "aux_loss", "z_loss", "entropy"):
        assert again[name].item() == 0, name
    assert again["tokens_per_expert"].tolist() == [0.0] * 4


def test_eval_forwards_record_nothing():
    layer = identity_gate_layer().eval()
    with torch.no_grad():
        layer(torch.randn(2, 3, D))
    layer(torch.randn(2, 3, D))  # with grad enabled too
    stats = layer.pop_stats()
    assert stats["calls"].item() == 0
    assert stats["tokens_per_expert"].abs().sum().item() == 0
    for name in ("aux_loss", "seq_aux_loss", "z_loss", "entropy", "assignments", "dropped"):
        assert stats[name].item() == 0, name
