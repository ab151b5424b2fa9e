"""FP8 in the model (``train.fp8``, ``moetrain.model.fp8``): which modules convert, and the
emulated FP8 MoE layer and transformer against the same modules in high precision, forward
and every gradient, within the bound stated once below. The quantization itself is checked
against a hand reference in tests/kernels/test_kernels_fp8.py.

Shape legend: B batch, S sequence, D model dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model import build_model
from moetrain.model.fp8 import Fp8Linear, convert_to_fp8
from moetrain.model.moe import MoELayer

# Relative error (||fp8 - hp|| / ||hp||) of a whole MoE layer or transformer in FP8 against
# the same module in fp32, per recipe: outputs and every parameter's gradient. Each GEMM adds
# 2-4 % (tests/kernels/test_kernels_fp8.py), 6 % with e5m2 gradients, and a gradient summed over
# tokens with cancelling signs (a norm's weight) keeps the error while its magnitude shrinks.
# Measured: MoE layer output 0.063 / 0.072, gradients <= 0.086 / 0.100; transformer logits
# <= 0.013, gradients <= 0.29 (a norm weight; matrices 0.22) / 0.12 (tensorwise / rowwise).
MODULE_BOUND = {"tensorwise": 0.4, "rowwise": 0.2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _moe_layer() -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, num_shared_experts=1,
                    capacity_factor=None, aux_loss_coef=0.0, z_loss_coef=0.0)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(32, cfg).train()
    with torch.no_grad():
        layer.router.gate.weight.normal_(std=0.5)
    return layer


def _grads(module: nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = run(module)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * dout).sum().backward()
    return out.detach(), {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in module.named_parameters()
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_moe_layer_within_the_bound_forward_and_every_gradient(recipe) -> None:
    hp = _moe_layer()
    fp8 = copy.deepcopy(hp)
    conv = convert_to_fp8(nn.ModuleDict({"0": fp8}), recipe)
    assert conv.expert_layers == ["layers.0.experts"]
    assert sorted(conv.linears) == [f"layers.0.shared_experts.w{i}" for i in (1, 2, 3)]
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    out_hp, g_hp = _grads(hp, lambda m: m(x))
    out_fp8, g_fp8 = _grads(fp8, lambda m: m(x))
    assert 0 < _rel(out_fp8, out_hp) <= MODULE_BOUND[recipe]
    assert set(g_fp8) == set(g_hp)
    for name, g in g_hp.items():
        err = _rel(g_fp8[name], g)
        assert err <= MODULE_BOUND[recipe], (name, err)
        assert err > 0, (name, "unchanged: not computed in FP8")


def _tiny(recipe: str | None, experts: bool = True, **model):
    cfg = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16,
                      tie_embeddings=False, **model)  # fmt: skip
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32, every_n_layers=2,
                    capacity_factor=None, num_shared_experts=1,
                    shared_expert_gate=True)  # fmt: skip
    m = build_model(cfg, moe, seed=0)
    conv = convert_to_fp8(m, recipe, experts) if recipe else None
    return m, conv


def test_conversion_keeps_router_gates_embeddings_head_and_norms_in_high_precision() -> None:
    hp, _ = _tiny(None)
    m, conv = _tiny("rowwise")
    assert m.state_dict().keys() == hp.state_dict().keys()  # checkpoints see nothing new
    for a, b in zip(m.state_dict().values(), hp.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, Fp8Linear)}
    assert fp8 == set(conv.linears)
    assert fp8 == {
        *(f"layers.{i}.attention.w{p}" for i in (0, 1) for p in "qkvo"),
        *(f"layers.0.ffn.w{i}" for i in (1, 2, 3)),
        *(f"layers.1.ffn.shared_experts.w{i}" for i in (1, 2, 3)),
    }
    assert conv.expert_layers == ["layers.1.ffn.experts"] and conv.unaligned == []
    for name in ("layers.1.ffn.router.gate", "layers.1.ffn.shared_expert_gate", "output"):
        assert type(m.get_submodule(name)) is nn.Linear, name
    _, no_experts = _tiny("tensorwise", experts=False)
    assert no_experts.expert_layers == [] and len(no_experts.linears) == len(conv.linears)


def test_conversion_skips_linears_whose_widths_an_fp8_gemm_cannot_take() -> None:
    """MLA with a 24-wide query bottleneck: wq_a (32 -> 24) and wq_b (24 -> ...) stay."""
    m, conv = _tiny("tensorwise", attention="mla", q_lora_rank=24, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
    assert {"layers.0.attention.wq_a", "layers.0.attention.wq_b"} <= set(conv.unaligned)
    assert "layers.0.attention.wkv_b" in conv.linears
    assert type(m.get_submodule("layers.0.attention.wq_a")) is nn.Linear


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_transformer_within_the_bound_of_high_precision(recipe) -> None:
    hp, _ = _tiny(None)
    fp8, _ = _tiny(recipe)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    out_hp, g_hp = _grads(hp, lambda m: m(tokens))
    out_fp8, g_fp8 = _grads(fp8, lambda m: m(tokens))
    assert 0 < _rel(out_fp8, out_hp) <= MODULE_BOUND[recipe]
    for name, g in g_hp.items():
        assert _rel(g_fp8[name], g) <= MODULE_BOUND[recipe], (name, _rel(g_fp8[name], g))


def test_the_module_bound_catches_gradients_dropped_in_fp8() -> None:
    """The check can fail: a conversion that lost the weight gradient (detached weights)."""
    layer = _moe_layer()
    fp8 = copy.deepcopy(layer)
    convert_to_fp8(nn.ModuleDict({"0": fp8}), "rowwise")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    _, g_hp = _grads(layer, lambda m: m(x))
    w = fp8.shared_experts.w1
    w.forward = lambda t: Fp8Linear.forward(w, t).detach() + 0 * t.sum()  # type: ignore[method-assign]
    _, g_bad = _grads(fp8, lambda m: m(x))
    assert _rel(g_bad["shared_experts.w1.weight"], g_hp["shared_experts.w1.weight"]) > 0.9
