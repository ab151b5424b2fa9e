"""Optimizer groups, the learning-rate schedule against hand-computed values, clipping."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from moetrain.config import OptimConfig
from moetrain.train.optim import (
    WarmupCosine,
    build_optimizer,
    build_scheduler,
    clip_grad_norm_,
)

pytestmark = pytest.mark.timeout(60)


class TinyMoE(nn.Module):
    """Every kind of tensor the real model has: embedding, norm, linear with bias, expert
    weights (3-D), a router gate, an expert-bias buffer and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 3, bias=False)
        self.experts_w = nn.Parameter(torch.randn(3, 4, 5))
        self.register_buffer("expert_bias", torch.zeros(3))
        self.frozen = nn.Parameter(torch.ones(2, 2), requires_grad=False)


def _run_steps(sched: torch.optim.lr_scheduler.LambdaLR, n: int) -> list[float]:
    """The lr each of the next ``n`` optimizer steps uses (read before the step, as the
    optimizer does)."""
    lrs = []
    for _ in range(n):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    return lrs


def _sched(**kw) -> torch.optim.lr_scheduler.LambdaLR:
    total = kw.pop("total_steps")
    cfg = OptimConfig(**kw)
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    return build_scheduler(opt, cfg, total_steps=total)


def test_param_groups_membership() -> None:
    model = TinyMoE()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    ids = lambda group: {id(p) for p in group["params"]}
    assert ids(decay) == {
        id(model.embed.weight),
        id(model.proj.weight),
        id(model.gate.weight),
        id(model.experts_w),
    }
    assert ids(no_decay) == {id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert id(model.frozen) not in ids(decay) | ids(no_decay)
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["lr"] == 3e-3


def test_expert_biases_and_sinks_are_not_decayed_whatever_their_shape() -> None:
    """The routed experts' biases are (E, F) and (E, D): biases, exempt from weight decay
    like every other bias and norm (as in Megatron-Core and torchtitan); their weights are
    decayed. Built from the real model with gpt-oss's options."""
    from moetrain.config import ModelConfig, MoEConfig
    from moetrain.model.transformer import Transformer

    model = Transformer(
        ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32,
                    attention_sinks=True, qkv_bias=True),
        MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, expert_ffn_bias=True,
                  router_bias=True),
    )  # fmt: skip
    decay, no_decay = build_optimizer(model, OptimConfig()).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    experts = "layers.0.ffn.experts."
    assert {experts + b for b in ("b1", "b3", "b2")} <= kept
    assert {experts + w for w in ("w1", "w3", "w2")} <= decayed
    assert all(n.endswith(("bias", "b1", "b3", "b2", "weight", "sinks")) for n in kept)
    assert not any(n.endswith(("bias", "b1", "b3", "b2", "norm.weight", "sinks"))
                   for n in decayed)  # fmt: skip
    assert all(p.ndim == 1 or names[id(p)].startswith(experts) for p in no_decay["params"])


def test_tied_parameter_appears_once_and_empty_group_kept() -> None:
    emb = nn.Embedding(7, 3)
    head = nn.Linear(3, 7, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = build_optimizer(model, OptimConfig())
    assert [len(g["params"]) for g in opt.param_groups] == [1, 0]


def test_weight_decay_only_hits_matrices() -> None:
    # With a zero gradient AdamW's update is exactly the decoupled decay p *= 1 - lr * wd.
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    cfg = OptimConfig(lr=0.5, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(model.weight, torch.full((2, 3), 1.0 - 0.5 * 0.1))
    torch.testing.assert_close(model.bias, torch.ones(2))


def test_warmup_cosine_values() -> None:
    # lr 1.0, warmup 4, total 14, min ratio 0.1: warm-up (s+1)/5, then cosine over 10 steps.
    sched = _sched(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = _run_steps(sched, 17)
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-12)
    # s = 9: progress 0.5 -> 0.1 + 0.9 * 0.5 = 0.55.
    assert lrs[9] == pytest.approx(0.55, abs=1e-12)
    # s = 6: progress 0.2 -> 0.1 + 0.9 * (1 + cos(0.2 pi)) / 2 = 0.1 + 0.45 * 1.809017 = 0.9140576
    assert lrs[6] == pytest.approx(0.9140576, abs=1e-6)
    # s = 14 = total: exactly the floor, and it stays there.
    assert lrs[14] == pytest.approx(0.1, abs=1e-12)
    assert lrs[16] == pytest.approx(0.1, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))


def test_constant_and_no_warmup() -> None:
    lrs = _run_steps(_sched(lr=2.0, warmup_steps=2, total_steps=10, schedule="constant"), 6)
    assert lrs == pytest.approx([2.0 / 3, 4.0 / 3, 2.0, 2.0, 2.0, 2.0], abs=1e-12)
    lrs = _run_steps(_sched(lr=1.0, warmup_steps=0, total_steps=2, min_lr_ratio=0.0), 3)
    assert lrs == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)


def test_scheduler_applies_to_both_groups() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=1)
    opt = build_optimizer(TinyMoE(), cfg)
    build_scheduler(opt, cfg, total_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]


def test_scheduler_state_round_trip_weights_only() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=3, min_lr_ratio=0.2)
    sched = build_scheduler(build_optimizer(nn.Linear(2, 2), cfg), cfg, total_steps=20)
    _run_steps(sched, 7)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    # A run resumed with a different configuration continues the saved schedule.
    other = OptimConfig(lr=5.0, warmup_steps=0, schedule="constant")
    resumed = build_scheduler(build_optimizer(nn.Linear(2, 2), other), other, total_steps=50)
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 7
    assert _run_steps(resumed, 5) == pytest.approx(_run_steps(sched, 5), abs=1e-15)
    assert resumed.lr_lambdas[0].total_steps == 20


def test_warmup_cosine_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        WarmupCosine(0, 0, 0.1)
    with pytest.raises(ValueError, match="schedule"):
        WarmupCosine(0, 10, 0.1, "linear")  # type: ignore[arg-type]


def _with_grads(values: list[list[float]]) -> list[nn.Parameter]:
    params = []
    for v in values:
        p = nn.Parameter(torch.zeros(len(v)))
        p.grad = torch.tensor(v)
        params.append(p)
    return params


def test_clip_grad_norm() -> None:
    params = _with_grads([[3.0, 0.0], [0.0, 4.0]])  # global norm 5
    assert clip_grad_norm_(params, 1.0) == pytest.approx(5.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([0.0, 0.8]), atol=1e-6, rtol=0)

    params = _with_grads([[3.0, 0.0], [0.0, 4.0]])
    assert clip_grad_norm_(params, None) == pytest.approx(5.0)
    assert clip_grad_norm_(params, 10.0) == pytest.approx(5.0)
    torch.testing.assert_close(params[1].grad, torch.tensor([0.0, 4.0]))

    no_grad = nn.Parameter(torch.zeros(2))
    assert clip_grad_norm_([no_grad], 1.0) == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clip_grad_norm_non_finite_left_alone(bad: float) -> None:
    params = _with_grads([[bad, 1.0], [2.0, 0.0]])
    norm = clip_grad_norm_(params, 1.0)
    assert not math.isfinite(norm)
    torch.testing.assert_close(params[1].grad, torch.tensor([2.0, 0.0]))


# ----------------------------------------------------------------------------- bf16 moments


def _adam_pair(moments: str, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyMoE()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta2=0.95, moments_dtype=moments)
    return model, build_optimizer(model, cfg)


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1)


def test_bf16_moments_are_torch_adamw_rounded_each_step() -> None:
    """optim.moments_dtype=bf16 against torch.optim.AdamW whose moments are rounded to bf16
    (nearest) after each of its steps: the same parameters and moments, step after step."""
    ours_model, ours = _adam_pair("bf16")
    ref_model, _ = _adam_pair("fp32")
    ref = torch.optim.AdamW(
        [{"params": [p for p in ref_model.parameters() if p.requires_grad and p.ndim >= 2],
          "weight_decay": 0.1},
         {"params": [p for p in ref_model.parameters() if p.requires_grad and p.ndim < 2],
          "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    for step in range(6):
        _grads(ours_model, step)
        _grads(ref_model, step)
        ours.step()
        ref.step()
        with torch.no_grad():
            for st in ref.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key].copy_(st[key].bfloat16().float())
    for p, q in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        if not p.requires_grad:
            continue
        st, rst = ours.state[p], ref.state[q]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert p.dtype == torch.float32  # the master weights stay fp32
        torch.testing.assert_close(st["exp_avg"].float(), rst["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(st["exp_avg_sq"].float(), rst["exp_avg_sq"], rtol=0, atol=0)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert float(st["step"]) == float(rst["step"]) == 6


def test_bf16_moments_differ_from_fp32_moments() -> None:
    """The reference above can fail: fp32 moments (no rounding) end elsewhere."""
    bf16_model, bf16 = _adam_pair("bf16")
    fp32_model, fp32 = _adam_pair("fp32")
    for step in range(6):
        for m, opt in ((bf16_model, bf16), (fp32_model, fp32)):
            _grads(m, step)
            opt.step()
    p, q = bf16_model.experts_w, fp32_model.experts_w
    assert not torch.equal(bf16.state[p]["exp_avg"].float(), fp32.state[q]["exp_avg"])


def test_bf16_moments_refuse_betas_whose_decay_rounds_away() -> None:
    from moetrain.config import ConfigError

    OptimConfig(moments_dtype="bf16", beta2=0.99).validate()
    with pytest.raises(ConfigError, match=r"^optim\.beta2: 0\.999 with optim\.moments_dtype=bf16"):
        OptimConfig(moments_dtype="bf16", beta2=0.999).validate()
    # The reason, shown: a moment decaying by 1 - 0.999 per step stays where it is in bf16.
    v = torch.tensor([1.0, 1.5, 1.99], dtype=torch.bfloat16)
    assert torch.equal((v.float() * 0.999).bfloat16(), v)
    assert not torch.equal((v.float() * 0.99).bfloat16(), v)


# ----------------------------------------------------------------------------- fused AdamW


def test_the_fused_step_is_chosen_where_every_tensor_is_on_a_cuda_device() -> None:
    """``fused_applies``: CUDA tensors only (the meta device ``moetrain plan`` builds on and
    the CPU keep torch's default foreach step); fp32 moments only (the bf16 variant has a
    batched step of its own)."""
    from types import SimpleNamespace

    from moetrain.train.adamw import fused_applies, torch_kwargs

    def on(kind: str, floating: bool = True) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(kind), dtype=torch.float32,
                               is_floating_point=lambda: floating)

    assert fused_applies([on("cuda"), on("cuda")])
    assert not fused_applies([on("cuda"), on("cpu")])
    assert not fused_applies([on("cuda", floating=False)])
    assert not fused_applies([torch.zeros(2), torch.zeros(2, device="meta")])
    mixed = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32,
                            is_floating_point=lambda: True,
                            device_mesh=object())  # a DTensor-like beside plain tensors
    assert not fused_applies([on("cuda"), mixed])
    assert not fused_applies([])
    cfg = OptimConfig()
    assert torch_kwargs(cfg, [on("cuda")], "fp32")["fused"] is True
    assert "fused" not in torch_kwargs(cfg, [on("cuda")], "bf16")
    assert "fused" not in torch_kwargs(cfg, [torch.zeros(2)], "fp32")
    assert "fused" not in build_optimizer(TinyMoE(), cfg).defaults or not build_optimizer(
        TinyMoE(), cfg).defaults["fused"]


def _fused_on_shards(rank: int, world: int) -> dict:
    """torch's fused AdamW step (its CPU kernel: the same ``_fused_adamw_`` operator the CUDA
    path runs) against the default foreach step, over what moetrain hands it: DTensor shards
    (FSDP2, TP) and a flat slice of several parameters (ZeRO-1), three steps with weight
    decay: the largest difference of each parameter and moment, relative to its size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(8, 6, generator=gen), torch.randn(6, generator=gen),
            torch.randn(4, 4, generator=gen)]  # fmt: skip
    grads = [[torch.randn(t.shape, generator=gen) for t in full] for _ in range(3)]
    placements = [[Shard(0)], [Replicate()], [Shard(1)]]
    out = {}
    for fused in (False, True):
        params = [nn.Parameter(distribute_tensor(t.clone(), mesh, pl))
                  for t, pl in zip(full, placements, strict=True)]  # fmt: skip
        flat = nn.Parameter(torch.cat([t.reshape(-1) for t in full])[rank::world].clone())
        opt = torch.optim.AdamW([{"params": params, "weight_decay": 0.1},
                                 {"params": [flat], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), fused=fused or None)  # fmt: skip
        for step in grads:
            for p, g, pl in zip(params, step, placements, strict=True):
                p.grad = distribute_tensor(g, mesh, pl)
            flat.grad = torch.cat([g.reshape(-1) for g in step])[rank::world].clone()
            opt.step()
        out[fused] = [p.to_local() for p in params] + [flat.detach()] + [
            s["exp_avg_sq"].to_local() if hasattr(s["exp_avg_sq"], "to_local")
            else s["exp_avg_sq"] for s in opt.state.values()]  # fmt: skip
    return {"diff": [((a - b).abs().max() / b.abs().max()).item()
                     for a, b in zip(out[False], out[True], strict=True)],
            "moved": not torch.equal(out[True][0], full[0].chunk(world)[rank])}  # fmt: skip


@pytest.mark.multirank
def test_the_fused_step_equals_the_foreach_step_on_shards_and_flat_slices() -> None:
    """The contract the CUDA path relies on, checked where CI runs: torch's fused AdamW
    accepts moetrain's DTensor parameters and ZeRO-1 slices and computes what its default
    step computes, parameters and moments, up to fp32 rounding (its kernel fuses the
    moments' multiply-adds: a last-bit difference seen in a second moment on this CPU)."""
    from harness import run_ranks

    for r in run_ranks(_fused_on_shards, 2):
        assert r["moved"] and max(r["diff"]) < 1e-6, r["diff"]
