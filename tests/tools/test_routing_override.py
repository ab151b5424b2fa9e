"""Router.routing_override, the eval-only hook offline ablation uses, against independent
references: top-1 equals a top_k=1 layer, zeroing every expert leaves the shared experts,
replaying the router's own ids changes nothing, and training refuses an override."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.moe import MoELayer, RoutingOverride

D = 16


def layer(cfg: MoEConfig) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D, cfg).eval()


@pytest.mark.thread_counts
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_top1_override_equals_a_top1_layer(capacity_factor, score_func) -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, capacity_factor=capacity_factor,
                    score_func=score_func)
    top2 = layer(cfg)
    top1 = layer(dataclasses.replace(cfg, top_k=1))
    top1.load_state_dict(top2.state_dict())
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        want = top1(x)
        top2.router.routing_override = RoutingOverride(top1=True)
        got = top2(x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_zeroing_every_expert_leaves_the_shared_experts() -> None:
    moe = layer(MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, num_shared_experts=1))
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        moe.router.routing_override = RoutingOverride(zero_experts=(0, 1, 2, 3))
        got = moe(x)
        want = moe.shared_experts(x.reshape(-1, D)).view_as(x)
    torch.testing.assert_close(got, want)


def test_replaying_the_routers_own_ids_is_exact_and_other_ids_are_not() -> None:
    moe = layer(MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, capacity_factor=1.0))
    x = torch.randn(2, 8, D)
    seen = []
    hook = moe.router.register_forward_hook(lambda m, i, out: seen.append(out.ids_TK))
    with torch.no_grad():
        base = moe(x)
        moe.router.routing_override = RoutingOverride(replay_ids_TK=seen[0].clone())
        assert torch.equal(moe(x), base)
        moe.router.routing_override = RoutingOverride(replay_ids_TK=(seen[0] + 1) % 4)
        assert not torch.allclose(moe(x), base)
        moe.router.routing_override = RoutingOverride(replay_ids_TK=seen[0][:, :1])
        with pytest.raises(ValueError, match="replay_ids_TK: shape"):
            moe(x)
    hook.remove()


def test_an_override_in_training_raises() -> None:
    moe = layer(MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8)).train()
    moe.router.routing_override = RoutingOverride(top1=True)
    with pytest.raises(RuntimeError, match="eval-only"):
        moe(torch.randn(1, 4, D))
