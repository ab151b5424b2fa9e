"""Options no Hugging Face family exercises, against closed forms written from their
definitions (tests/references.py cites this file for them).

- linear RoPE scaling (``model.rope_scaling=linear``): position p rotates by p / factor,
  so the table at p is the unscaled one at the fractional position p / factor;
- the attention's output bias (``model.out_bias``): the output of the same weights without
  the bias, plus the bias.
"""

from __future__ import annotations

import torch

from moetrain.config import ModelConfig
from moetrain.model.attention import build_attention
from moetrain.model.rope import rope_tables


def test_linear_rope_scaling_divides_positions_by_the_factor(assert_close) -> None:
    factor, dim, theta = 4.0, 16, 10000.0
    cfg = ModelConfig(dim=64, n_heads=4, max_seq_len=32, rope_theta=theta,
                      rope_scaling="linear", rope_scaling_factor=factor)  # fmt: skip
    cos, sin = rope_tables(cfg)
    pos = torch.arange(32, dtype=torch.float64)[:, None] / factor
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert_close(cos, (pos * inv).cos(), dtype=torch.float32, what="cos")
    assert_close(sin, (pos * inv).sin(), dtype=torch.float32, what="sin")
    plain, _ = rope_tables(ModelConfig(dim=64, n_heads=4, max_seq_len=32, rope_theta=theta))
    assert (cos - plain).abs().max() > 0.1  # the option changes the table


def test_output_bias_adds_to_the_attention_output(assert_close) -> None:
    cfg = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16, out_bias=True)
    with_bias = build_attention(cfg, 0)
    torch.nn.init.normal_(with_bias.wo.bias, std=0.5, generator=torch.Generator().manual_seed(1))
    without = build_attention(ModelConfig(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16), 0)
    without.load_state_dict(
        {k: v for k, v in with_bias.state_dict().items() if k != "wo.bias"}, strict=True
    )
    assert without.wo.bias is None
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_tables(cfg)
    assert_close(with_bias(x, cos, sin), without(x, cos, sin) + with_bias.wo.bias, what="out")
