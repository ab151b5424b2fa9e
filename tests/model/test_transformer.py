"""Transformer: causality, GQA, tied embeddings, MoE layer placement, parameter counts, init."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.moe import MoELayer
from moetrain.model.transformer import FeedForward, build_model, is_moe_layer

V = 32


def tiny_cfgs(**model_overrides) -> tuple[ModelConfig, MoEConfig]:
    model = {
        "vocab_size": V,
        "dim": 16,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 24,
        "max_seq_len": 16,
        **model_overrides,
    }
    # Dropless: with capacity, a later token could displace an earlier one from an expert.
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, every_n_layers=1, kernels="torch")
    return ModelConfig(**model), moe


def test_causal(assert_close):
    model = build_model(*tiny_cfgs(), seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, V, (2, 10), generator=gen)
    changed_BS = tokens_BS.clone()
    changed_BS[:, 6] = (changed_BS[:, 6] + 1) % V

    with torch.no_grad():
        logits_BSV = model(tokens_BS)
        changed_logits_BSV = model(changed_BS)

    assert_close(changed_logits_BSV[:, :6], logits_BSV[:, :6], what="logits before the change")
    # The change is visible from its own position on: the check above can fail.
    diff_BS = (changed_logits_BSV - logits_BSV).abs().amax(-1)
    assert (diff_BS[:, 6:] > 1e-3).all()


def test_gqa_equals_repeated_kv_heads(assert_close):
    gqa_model = build_model(*tiny_cfgs(n_kv_heads=2), seed=0).eval()
    mha_model = build_model(*tiny_cfgs(n_kv_heads=None), seed=0).eval()
    head_dim, n_rep = 16 // 4, 4 // 2
    state = gqa_model.state_dict()
    for name, w in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # (Hkv * Dh, D) -> query head h reads kv head h // n_rep
            w_HkvDhD = w.view(-1, head_dim, w.shape[1])
            state[name] = w_HkvDhD.repeat_interleave(n_rep, dim=0).reshape(-1, w.shape[1])
    mha_model.load_state_dict(state)
    tokens_BS = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        assert_close(gqa_model(tokens_BS), mha_model(tokens_BS), what="GQA vs repeated kv")
    assert gqa_model.layers["0"].attention.wk.weight.shape == (2 * head_dim, 16)


def test_tied_embeddings_share_storage():
    tied = build_model(*tiny_cfgs(tie_embeddings=True), seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    with torch.no_grad():
        tied.tok_embeddings.weight[3, 5] = 7.0
    assert tied.output.weight[3, 5].item() == 7.0

    untied = build_model(*tiny_cfgs(tie_embeddings=False), seed=0)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize(
    ("n_layers", "every_n_layers", "num_experts", "moe_layers"),
    [
        (4, 1, 4, [0, 1, 2, 3]),
        (6, 2, 4, [1, 3, 5]),
        (6, 3, 4, [2, 5]),
        (5, 3, 4, [2]),
        (4, 1, 0, []),  # num_experts 0: all dense
    ],
)
def test_every_n_layers_placement(n_layers, every_n_layers, num_experts, moe_layers):
    model_cfg = ModelConfig(vocab_size=V, dim=16, n_layers=n_layers, n_heads=4, ffn_dim=24)
    moe_cfg = MoEConfig(
        num_experts=num_experts,
        top_k=min(2, num_experts) or 1,
        expert_ffn_dim=8,
        every_n_layers=every_n_layers,
    )
    model = build_model(model_cfg, moe_cfg, seed=0)

    found = [int(i) for i, block in model.layers.items() if isinstance(block.ffn, MoELayer)]
    assert found == moe_layers
    dense = [int(i) for i, block in model.layers.items() if isinstance(block.ffn, FeedForward)]
    assert dense == [i for i in range(n_layers) if i not in moe_layers]
    assert [i for i in range(n_layers) if is_moe_layer(i, moe_cfg)] == moe_layers
    assert list(model.moe_layers()) == moe_layers


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_hand_count(tie):
    model_cfg = ModelConfig(
        vocab_size=11,
        dim=8,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=12,
        max_seq_len=8,
        tie_embeddings=tie,
    )
    moe_cfg = MoEConfig(
        num_experts=4, top_k=2, every_n_layers=2, expert_ffn_dim=6, num_shared_experts=1
    )
    model = build_model(model_cfg, moe_cfg, seed=0)

    embedding = 11 * 8  # 88
    output = 0 if tie else 11 * 8
    # per block: 2 norms (8 each), wq 8x8, wk and wv 8x(1 kv head * head dim 4), wo 8x8
    attention_block = 8 + 8 + 64 + 32 + 32 + 64  # 208
    dense_ffn = 3 * 8 * 12  # layer 0: 288
    gate = 4 * 8  # layer 1 router: 32
    experts = 3 * 4 * 8 * 6  # 576, of which a token uses top_k / E = 2 / 4
    shared = 3 * 8 * 6  # one shared expert of width 6: 144
    final_norm = 8
    base = embedding + output + 2 * attention_block + dense_ffn + gate + shared + final_norm

    assert model.num_params() == base + experts
    assert model.num_params(active=True) == base + 288
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    # Training FLOPs: 6 per active matmul parameter (the input embedding is a lookup; tied, the
    # shared matrix still does the output projection) + causal attention 6 * L * D * S.
    seq_len = 8
    matmul_active = base + 288 - (0 if tie else embedding)
    assert model.flops_per_token(seq_len) == 6 * matmul_active + 6 * 2 * 8 * seq_len


def test_the_step_contexts_aux_loss_scale_reaches_every_moe_layer(assert_close):
    """Every MoE layer reads the model's one step context: the balancing losses' injected
    gradient of each layer's router follows the context's ``aux_loss_scale``."""
    model_cfg, moe_cfg = tiny_cfgs(n_layers=3)
    model = build_model(model_cfg, moe_cfg, seed=0).train()
    layers = model.moe_layers()
    assert all(m.step_context is model.step_context for m in layers.values())
    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = {}
    for scale in (1.0, 0.25):
        model.zero_grad()
        model.step_context.aux_loss_scale = scale
        (model(tokens) * 0).sum().backward()  # the balancing losses' gradient alone
        grads[scale] = {i: m.router.gate.weight.grad.clone() for i, m in layers.items()}
    assert sorted(grads[1.0]) == [0, 1, 2]
    for i, g in grads[1.0].items():
        assert g.abs().max() > 0, f"layer {i}: no balancing-loss gradient"
        assert_close(grads[0.25][i], 0.25 * g, dtype=torch.float32, what=f"layer {i}'s gate")


def test_init_is_deterministic_in_seed():
    cfgs = tiny_cfgs()
    a = build_model(*cfgs, seed=0).state_dict()
    b = build_model(*cfgs, seed=0).state_dict()
    c = build_model(*cfgs, seed=1).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between two builds with seed 0"
    random_init = [n for n, t in a.items() if t.dim() >= 2 and t.is_floating_point()]
    assert any(name.endswith("experts.w1") for name in random_init)
    for name in random_init:
        assert not torch.equal(a[name], c[name]), f"{name} is the same with seeds 0 and 1"


def test_init_std_as_documented():
    # Normal(0, init_std) everywhere; residual output projections (attention wo, every w2)
    # get init_std / sqrt(2 * n_layers); norm weights stay at one.
    model_cfg = ModelConfig(
        vocab_size=64,
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_dim=64,
        init_std=0.02,
        tie_embeddings=False,
    )
    # 64 experts: the gate too has 64 x 64 samples.
    moe_cfg = MoEConfig(
        num_experts=64, top_k=2, every_n_layers=2, expert_ffn_dim=64, num_shared_experts=1
    )
    model = build_model(model_cfg, moe_cfg, seed=0)
    out_std = 0.02 / (2 * 2) ** 0.5
    checked = 0
    for name, p in model.named_parameters():
        if p.dim() < 2:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        residual = name.endswith(("attention.wo.weight", "w2.weight", "experts.w2"))
        expected = out_std if residual else 0.02
        # >= 4096 samples: the sample std is within 5% of the true one with margin to spare.
        assert abs(p.std().item() / expected - 1) < 0.05, (name, p.std().item(), expected)
        assert abs(p.mean().item()) < 0.1 * expected, name
        checked += 1
    assert checked == 2 + 2 * 4 + 3 + 1 + 3 + 3  # emb, output, attn, dense, gate, experts, shared
