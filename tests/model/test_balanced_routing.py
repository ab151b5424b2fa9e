"""``moe.force_load_balancing`` (the benchmark mode) against a hand computation: token t of
the step's global batch goes to experts (t K + j) mod E, every expert gets exactly its share,
and the output is each token's K experts weighted by the router's (renormalised) scores of
them, computed here token by token in float64 from the layer's own weights.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, F expert FFN dim, E experts,
K top-k.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError, MoEConfig, load_config
from moetrain.model.moe import MoELayer

B, S, D, F, E, K = 2, 5, 8, 16, 4, 2  # S K not a multiple of E: the offset matters
NO_AUX = {"aux_loss_coef": 0.0, "seq_aux_loss_coef": 0.0, "z_loss_coef": 0.0}


def _expert64(layer: MoELayer, e: int, x_D: torch.Tensor) -> torch.Tensor:
    w1, w3, w2 = (w[e].double() for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
    return (torch.nn.functional.silu(x_D @ w1) * (x_D @ w3)) @ w2


@pytest.mark.parametrize("first_sequence", [0, 3])
def test_every_expert_gets_exactly_its_share(first_sequence: int, assert_close) -> None:
    cfg = MoEConfig(num_experts=E, top_k=K, expert_ffn_dim=F, kernels="torch",
                    force_load_balancing=True, capacity_factor=1.0, **NO_AUX)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(D, cfg).train()
    with torch.no_grad():
        layer.router.gate.weight.normal_(std=2.0)  # a router that would route very unevenly
    # This forward's sequences are sequences first_sequence.. of the step (another dp rank's).
    layer.set_jitter_key(0, 0, first_sequence)
    x_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1))
    y_BSD = layer(x_BSD)
    stats = layer.pop_stats()
    # Every expert exactly T K / E assignments, nothing dropped at capacity factor 1.
    assert stats["tokens_per_expert"].tolist() == [B * S * K / E] * E
    assert float(stats["dropped"]) == 0.0
    # By hand: token t = (first_sequence + b) * S + s goes to (t K + j) mod E.
    x_TD = x_BSD.reshape(-1, D).double()
    scores_TE = torch.softmax(x_TD @ layer.router.gate.weight.double().T, dim=-1)
    want = torch.zeros_like(x_TD)
    for row in range(B * S):
        t = (first_sequence + row // S) * S + row % S
        ids = [(t * K + j) % E for j in range(K)]
        w = scores_TE[row, ids] / scores_TE[row, ids].sum()
        want[row] = sum(w[j] * _expert64(layer, e, x_TD[row]) for j, e in enumerate(ids))
    assert_close(y_BSD.reshape(-1, D), want, dtype=torch.float32, what="output")


def test_training_refuses_it_unless_the_run_is_a_benchmark() -> None:
    with pytest.raises(ConfigError, match="moe.force_load_balancing: .*train.benchmark=true"):
        load_config(None, ["moe.force_load_balancing=true"])
    cfg = load_config(None, ["moe.force_load_balancing=true", "train.benchmark=true"])
    assert cfg.moe.force_load_balancing and cfg.train.benchmark
    with pytest.raises(ConfigError, match="moe.force_load_balancing: and train.routing_replay"):
        load_config(None, ["moe.force_load_balancing=true", "train.benchmark=true",
                           "train.routing_replay=."])  # fmt: skip
