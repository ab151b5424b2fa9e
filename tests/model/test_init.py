"""The sliceable initialisation (``moetrain.model.init``): any region of a parameter drawn on
its own equals that region of the whole, buffers are recomputed after a meta-device build,
the rules (std, norms, biases, ties) hold, and materialising keeps parameter identities.

The layouts themselves (tp, ep, pp, ZeRO-3, cp against one process, bit for bit) are
tests/parallel/test_init_layouts.py. Cost: under 2 s in all.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model import build_model, empty_model, meta_model
from moetrain.model import init as I
from moetrain.model.rope import ROPE_ROWS, fill_rope_tables, rope_inv_freq
from moetrain.model.transformer import Transformer


def cfgs(**model) -> tuple[ModelConfig, MoEConfig]:
    m = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    max_seq_len=ROPE_ROWS + 7, qkv_bias=True, out_bias=True,
                    attention_sinks=True, mtp_depth=1, **model)  # fmt: skip
    e = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, every_n_layers=1,
                  num_shared_experts=1, router_bias=True, expert_ffn_bias=True,
                  expert_bias_rate=0.01)  # fmt: skip
    return m, e


def test_any_region_drawn_alone_equals_that_region_of_the_whole(monkeypatch) -> None:
    # Small blocks, so that every tensor has several and regions straddle their boundaries.
    monkeypatch.setattr(I, "INIT_BLOCK_NUMEL", 100)
    rules = {
        "dense": (I.ParamInit("normal", 0.02), (37, 11)),  # 9 rows a block
        "experts": (I.ParamInit("normal", 0.02, expert_blocks=True), (5, 6, 7)),
    }
    for name, (rule, shape) in rules.items():
        whole = torch.empty(shape)
        largest = I.fill_slice(whole, name, rule, shape, (0,) * len(shape), seed=3)
        per = rule.block_rows(shape)
        assert largest == min(per, shape[0]) * math.prod(shape[1:])
        assert not torch.equal(whole[:per], whole[per : 2 * per])  # each block its own draw
        # Row ranges of FSDP-like chunks, column ranges of TP-like shards, both at once.
        for rows in ((0, 4), (4, 13), (13, shape[0]), (shape[0] - 1, shape[0])):
            for cols in ((0, shape[1]), (2, 5)):
                region = (slice(*rows), slice(*cols))
                out = torch.full(whole[region].shape, float("nan"))
                offsets = (rows[0], cols[0]) + (0,) * (len(shape) - 2)
                drawn = I.fill_slice(out, name, rule, shape, offsets, seed=3)
                assert torch.equal(out, whole[region]), (name, rows, cols)
                # Only the covering blocks, and never more than one at a time.
                assert drawn == I.largest_block(shape, rule, offsets, tuple(out.shape)) <= largest
    # An expert is one block: a rank holding experts 2..3 draws exactly those.
    rule, shape = rules["experts"]
    assert [b for b, _, _ in I.covering_blocks(rule, shape, 2, 2)] == [2, 3]


def test_values_depend_on_seed_name_and_block_only() -> None:
    rule, shape = I.ParamInit("normal", 1.0), (4, 8)
    a, b, c = (torch.empty(shape) for _ in range(3))
    I.fill_slice(a, "layers.0.w", rule, shape, (0, 0), seed=0)
    I.fill_slice(b, "layers.1.w", rule, shape, (0, 0), seed=0)
    I.fill_slice(c, "layers.0.w", rule, shape, (0, 0), seed=1)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert I.block_seed(0, "x", 1) != I.block_seed(0, "x", 2)
    torch.manual_seed(123)  # the global generator plays no part
    I.fill_slice(b, "layers.0.w", rule, shape, (0, 0), seed=0)
    assert torch.equal(a, b)


def test_the_rules() -> None:
    m, e = cfgs(tie_embeddings=True)
    model = build_model(m, e, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    out_std = m.init_std / math.sqrt(2 * m.n_layers)
    rules = {name: rule for name, _, rule in I.named_inits(model, m)}
    assert "output.weight" not in rules  # the tie: one tensor, initialised as the embedding
    for name, p in model.named_parameters():
        rule = rules[name]
        if name.endswith(("norm.weight",)):
            assert rule.fill == "ones" and torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("bias", ".b1", ".b3", ".b2", "sinks")):
            assert rule.fill == "zeros" and not p.any(), name
        else:
            want = out_std if name.endswith(I.RESIDUAL_OUTPUTS) else m.init_std
            assert rule.fill == "normal" and rule.std == want, name
            assert rule.expert_blocks == (".experts." in name), name
    assert not model.layers["0"].ffn.router.expert_bias.any()


def test_every_buffer_is_recomputed_after_a_meta_build() -> None:
    m, e = cfgs()
    eager = Transformer(m, e)  # buffers as the constructor computes them
    model = I.to_empty(meta_model(m, e), "cpu")
    for b in model.buffers():
        b.fill_(float("nan") if b.is_floating_point() else -7)  # garbage, as to_empty leaves
    I.init_buffers(model)
    want = dict(eager.named_buffers())
    got = dict(model.named_buffers())
    assert got.keys() == want.keys() and len(got) > 10
    for name, b in got.items():
        assert torch.equal(b, want[name]), name


def test_a_module_with_buffers_but_no_init_buffers_is_refused() -> None:
    model = empty_model(*cfgs())
    model.layers["0"].attention.register_buffer("scratch", torch.zeros(3))
    with pytest.raises(TypeError, match=r"Attention layers\.0\.attention owns buffers"):
        I.init_buffers(model)


def test_to_empty_keeps_identities_ties_and_marks() -> None:
    m, e = cfgs(tie_embeddings=True)
    model = meta_model(m, e)
    w1 = model.layers["1"].ffn.experts.w1
    w1.a_mark = True  # an attribute someone set on it (FSDP sets its own)
    before = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    I.to_empty(model, "cpu")
    after = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    assert before == after and not w1.is_meta and w1.a_mark
    assert model.output.weight is model.tok_embeddings.weight


def test_rope_tables_in_chunks_equal_the_formula() -> None:
    m, _ = cfgs(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=64)
    inv_R, factor = rope_inv_freq(m)
    angles = torch.outer(torch.arange(m.max_seq_len, dtype=torch.float64), inv_R)
    cos, sin = (torch.empty(m.max_seq_len, m.rope_dim // 2) for _ in range(2))
    fill_rope_tables(m, cos, sin)
    assert torch.equal(cos, (angles.cos() * factor).float())
    assert torch.equal(sin, (angles.sin() * factor).float())


def test_build_model_is_a_meta_build_materialised() -> None:
    """The single process's model is the trainer's way in one process: meta, to_empty,
    init; an unknown parameter gets no silent rule."""
    m, e = cfgs()
    model = build_model(m, e, seed=5)
    assert all(not p.is_meta for p in model.parameters())
    model.layers["0"].extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="no initialisation rule for parameter layers.0.extra"):
        model.init_weights(5)


def test_what_a_start_loads_is_not_drawn_but_nan_until_loaded() -> None:
    """``skip`` (the names a start fills next): no generator drawn for them, NaN until the
    start writes them, so that an element it misses shows; the others as without skip."""
    m, e = cfgs()
    want = build_model(m, e, seed=5).state_dict()
    skip = {"tok_embeddings.weight", "layers.1.ffn.experts.w1"}
    model = I.to_empty(meta_model(m, e), "cpu")
    I.init_parameters(model, m, 5, skip=skip)
    for name, p in model.named_parameters():
        if name in skip:
            assert p.isnan().all(), name
        else:
            assert torch.equal(p, want[name]), name
