"""The census of a step the plan prices (moetrain.plan.stepmix): every matmul in its class,
forward and backward, against the model's own FLOP formula; the bytes of the other ops by
what they serve, on hand-computed programs; the proxy of every shipped config runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrain.config import load_config
from moetrain.plan.stepmix import (
    CLASSES,
    MatmulLabels,
    StepMix,
    StepMixCensus,
    census_step,
    proxy_config,
)
from moetrain.train.engine import build_optimizers

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_dim=128", "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2",
         "moe.expert_ffn_dim=48", "data.seq_len=32", "model.vocab_size=256",
         "moe.token_group_seqs=null"]  # fmt: skip


def _small(*extra: str):
    return load_config(None, [*SMALL, *extra])


def test_every_matmul_lands_in_its_class_forward_and_backward():
    """A dropless step, not proxied: the experts' computed FLOPs equal the formula's routed
    experts (6 K 3 D F per token: forward, dgrad and wgrad all classed), attention equals
    the formula's causal scores; the rest (projections, router, head) is the formula's rest
    and the combine's weighted sum (a bmm of T K D on the torch path, which the formula
    leaves out: 0.4% here)."""
    cfg = _small()
    mix = census_step(cfg, torch.bfloat16, build_optimizers, proxy=False)
    assert mix.ratio("experts") == 1.0 and mix.ratio("attention") == 1.0, mix.flops
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size
    routed = 6 * 2 * 3 * 64 * 48 * tokens * cfg.model.n_layers
    assert sum(mix.flops["experts"].values()) == routed
    combine = 2 * (2 * tokens * 2 * 64) * cfg.model.n_layers  # two bmm of 2 T K D a layer
    assert sum(mix.flops["matmul"].values()) == mix.model_flops["matmul"] + combine
    assert abs(sum(mix.shares("matmul").values()) - 1) < 1e-12
    assert mix.flops["matmul"]["bfloat16"] > 0  # projections under autocast
    # fp32 by the compute-dtype policy (moetrain.model.precision): the routers' gates, forward
    # and both gradients (3 x 2 T D E per layer), and the combine's weighted sum (its two bmm).
    gates = 3 * 2 * tokens * 64 * 4 * cfg.model.n_layers
    assert mix.flops["matmul"]["float32"] == gates + combine
    assert mix.optim_state == 8 * mix.params  # AdamW's fp32 moments


def test_capacity_padding_shows_as_more_expert_flops_than_the_formula():
    """Capacity 2 with padding to capacity: the expert GEMMs run every slot, padded or not:
    the census counts what runs, the formula T K rows."""
    cfg = _small("moe.capacity_factor=2.0", "moe.pad_to_capacity=true")
    mix = census_step(cfg, torch.float32, build_optimizers, proxy=False)
    assert mix.ratio("experts") == pytest.approx(2.0)
    assert mix.shares("experts") == {"float32": 1.0}


def test_traffic_is_counted_by_what_it_serves():
    """x + y moves three tensors; a view moves nothing; a parameter's cast is weights'
    traffic, an activation's cast activations', anything in the optimizer phase the
    optimizer's; matmuls are FLOPs, not traffic."""
    p = torch.nn.Parameter(torch.randn(16, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    census = StepMixCensus({p.untyped_storage().data_ptr()})
    with census:
        z = x + y  # 3 x 32 floats
        z.t()  # a view
        p.to(torch.bfloat16)  # 128 floats read, 128 bf16 written
        x.to(torch.bfloat16)
        z @ p.t()  # a matmul
        census.phase = "optimizer"
        p.data.mul_(0.5)  # read and write 128 floats
    assert census.traffic == {
        "activations": 3 * 32 * 4 + 32 * (4 + 2),
        "weights": 128 * (4 + 2),
        "optimizer": 2 * 128 * 4,
    }
    assert census.class_flops == {("matmul", torch.float32): 2 * 4 * 8 * 16}


def test_proxy_of_every_shipped_config_censuses():
    """Every config's proxy builds (widths divided, 8 layers at most, experts and heads kept);
    the shares of each class sum to one. The 671B DeepSeek-V3 proxy is a few M parameters."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path, ["model.vocab_size=4096"] if "vocab_size" not in
                          path.read_text() else [])  # fmt: skip
        proxy = proxy_config(cfg)
        assert proxy.model.n_layers == min(cfg.model.n_layers, 8), path.name
        assert proxy.moe.num_experts == cfg.moe.num_experts, path.name
        assert proxy.model.dim <= cfg.model.dim and proxy.data.seq_len <= 128, path.name
    cfg = load_config(REPO / "configs" / "deepseek_v3.yaml")
    mix = census_step(cfg, torch.bfloat16, build_optimizers)
    assert mix.params < 2e7
    for cls in CLASSES:
        assert sum(mix.shares(cls).values()) == pytest.approx(1.0), cls
    # Its MLA attention takes SDPA's math path on a CPU (q/k and v widths differ): the
    # full square, classed as attention all the same.
    assert mix.ratio("attention") == pytest.approx(2.0)
    assert mix.ratio("experts") == pytest.approx(1.0)


def test_stepmix_round_trips_through_json():
    mix = census_step(_small(), torch.bfloat16, build_optimizers, proxy=False)
    assert StepMix.from_json(mix.to_json()) == mix


def test_matmul_labels_name_each_class_in_a_profile():
    """Each matmul runs inside a ``moetrain::<class>`` range: the profile's table splits
    GEMM time by class (tools/bench_e2e.py reads it)."""
    from torch.profiler import ProfilerActivity, profile

    from moetrain.model.transformer import Transformer

    cfg = _small()
    model = Transformer(cfg.model, cfg.moe)
    tokens = torch.randint(0, 256, (1, 32))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with MatmulLabels([model]):
            model(tokens).float().sum().backward()
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("moetrain::")}
    # Experts: 3 GEMMs forward, 6 backward, per layer; attention: SDPA forward and backward.
    assert calls["moetrain::experts"] == 9 * cfg.model.n_layers, calls
    assert calls["moetrain::attention"] == 2 * cfg.model.n_layers, calls
    assert calls["moetrain::matmul"] > 0
