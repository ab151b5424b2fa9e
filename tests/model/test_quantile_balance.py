"""Quantile balancing (``moe.quantile_balancing``): a hand computation of the histogram and
the bias, the estimate against the exact quantile, counts that add up exactly whatever the
split, the balance it buys, the layer's update, and the config's refusals. Under every layout:
the equivalence matrix (tests/parallel/matrix_options.py, factor "expert_bias")."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import MoEConfig, load_config
from moetrain.config.errors import ConfigError
from moetrain.model.moe import MoELayer
from moetrain.model.quantile_balance import (
    quantile_bias,
    required_bias,
    required_bias_histogram,
)

# Four tokens, three experts, top-1, no bias; every r_te lies inside a bin of width 0.5
# over [-1, 1] (4 bins), away from the edges.
SCORES = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.8, 0.15, 0.05], [0.2, 0.3, 0.5]])


def test_hand_computation() -> None:
    bias = torch.zeros(3)
    # Cutoffs (each token's 2nd highest score): 0.3, 0.4, 0.15, 0.3; r = cutoff - score.
    r = required_bias(SCORES, bias, top_k=1)
    expected_r = [[-0.3, 0.0, 0.2], [-0.1, 0.0, 0.3], [-0.65, 0.0, 0.1], [0.1, 0.0, -0.2]]
    torch.testing.assert_close(r, torch.tensor(expected_r, dtype=torch.float64), atol=1e-7, rtol=0)
    hist = required_bias_histogram(SCORES, bias, top_k=1, bins=4)
    # bins [-1, -0.5), [-0.5, 0), [0, 0.5), [0.5, 1]
    assert hist.tolist() == [[1, 2, 1, 0], [0, 0, 4, 0], [0, 1, 3, 0]]
    # Target T*K/E = 4/3 tokens an expert. Expert 0: cumulative 1, 3 -> bin 1, (4/3 - 1)/2 of
    # it: -1 + 0.5 * (1 + 1/6) = -5/12. Expert 1: bin 2, (4/3)/4 of it: 1/6. Expert 2: bin 2,
    # (4/3 - 1)/3 of it: 1/18. Mean -7/108; centred: -38/108, 25/108, 13/108.
    got = quantile_bias(hist, bias, torch.tensor(4.0))
    torch.testing.assert_close(got, torch.tensor([-38, 25, 13], dtype=torch.float64) / 108)
    # Routing the same tokens with the new bias: loads 1, 2, 1 (they were 3, 0, 1).
    chosen = (SCORES + got.float()).argmax(-1)
    assert torch.bincount(chosen, minlength=3).tolist() == [1, 2, 1]


def test_padding_is_left_out_and_no_tokens_leave_the_bias() -> None:
    bias = torch.tensor([0.1, -0.2, 0.1])
    valid = torch.tensor([True, False, True, False])
    hist = required_bias_histogram(SCORES, bias, 1, 8, valid)
    assert hist.sum(1).tolist() == [2, 2, 2]
    empty = torch.zeros(3, 8)
    assert quantile_bias(empty, bias, torch.tensor(0.0)).float().tolist() == bias.tolist()


def _skewed_scores(T: int, E: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) + torch.linspace(2.0, -2.0, E)  # expert 0 first
    return torch.sigmoid(logits)


def test_the_estimate_is_the_exact_quantile_to_within_a_bin() -> None:
    T, E, K, bins = 4096, 8, 2, 1000
    scores = _skewed_scores(T, E)
    bias = torch.linspace(-0.3, 0.2, E)
    hist = required_bias_histogram(scores, bias, K, bins)
    got = quantile_bias(hist, bias, torch.tensor(float(T * K)))
    exact = torch.quantile(required_bias(scores, bias, K), K / E, dim=0)
    width = (bias.max() - bias.min() + 2).item() / bins
    assert (got - (exact - exact.mean())).abs().max().item() <= 2 * width


def test_counts_add_up_exactly_whatever_the_split() -> None:
    """What every layout relies on: the histograms of any split of the tokens sum to the
    whole batch's, bit for bit (integer counts)."""
    scores, bias = _skewed_scores(600, 8, seed=1), torch.randn(8) * 0.1
    whole = required_bias_histogram(scores, bias, 2, 100)
    for parts in (2, 3, 5):
        split = sum(required_bias_histogram(c, bias, 2, 100) for c in scores.chunk(parts))
        assert torch.equal(split, whole)


def test_one_update_balances_a_skewed_router() -> None:
    T, E, K = 8192, 8, 2
    scores, bias = _skewed_scores(T, E, seed=2), torch.zeros(E)

    def max_over_mean(b: torch.Tensor) -> float:
        load = torch.bincount(torch.topk(scores + b, K).indices.reshape(-1), minlength=E)
        return (load.max() / load.float().mean()).item()

    before = max_over_mean(bias)
    for _ in range(3):
        bias = quantile_bias(required_bias_histogram(scores, bias, K, 1000), bias,
                             torch.tensor(float(T * K))).float()  # fmt: skip
    assert before > 2.0 and max_over_mean(bias) < 1.1, (before, max_over_mean(bias))


def _layer(**overrides: object) -> MoELayer:
    cfg = MoEConfig(num_experts=3, top_k=1, expert_ffn_dim=8, kernels="torch",
                    quantile_balancing=True, quantile_balancing_bins=4, **overrides)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(3, cfg).train()
    with torch.no_grad():  # the identity gate: the input is the logits
        layer.router.gate.weight.copy_(torch.eye(3))
    return layer


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_the_layer_counts_its_forwards_and_updates_its_bias(ema: float) -> None:
    layer = _layer(quantile_balancing_ema=ema, score_func="softmax")
    logits = SCORES.log()  # softmax(log p) = p
    with torch.no_grad():
        layer(logits[None, :2])
        layer(logits[None, 2:])  # two micro-batches
    stats = layer.pop_stats()
    assert stats["qb_hist"].tolist() == [[1, 2, 1, 0], [0, 0, 4, 0], [0, 1, 3, 0]]
    assert stats["assignments"].item() == 4
    layer.update_expert_bias(stats["tokens_per_expert"], stats["qb_hist"], stats["assignments"])
    expected = (1 - ema) * torch.tensor([-38, 25, 13]) / 108
    torch.testing.assert_close(layer.router.expert_bias, expected.float())
    assert layer.pop_stats()["qb_hist"].sum().item() == 0  # reset by the pop


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["moe.expert_bias_rate=0.01"], "choose one"),
        (["moe.n_groups=2", "moe.topk_groups=1"], "group-limited routing"),
        (["moe.top_k=4", "moe.num_experts=4"], "top_k < moe.num_experts"),
        (["moe.quantile_balancing_ema=1.0"], r"in \[0, 1\)"),
        (["moe.quantile_balancing_bins=1"], ">= 2"),
    ],
)
def test_the_config_refuses_what_it_cannot_balance(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["moe.quantile_balancing=true", *overrides])
