"""ZeRO-1's optimizers and their checkpoint shadows.

Under ZeRO-1 each data-parallel rank steps an AdamW over its flat slices of the non-expert
parameters (``GradientSync``'s shards) and, with expert parallelism, a second AdamW over its
whole experts (they already hold 1 / ep of the experts; their state is not sharded over dp).
Checkpoints must not depend on that layout, so saving builds *shadows*: full-size AdamW
optimizers per model chunk holding the gathered state, which DCP saves exactly like every
other stage's; loading fills the shadows and slices them back.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import OptimConfig
from moetrain.parallel.data_parallel import GradientSync
from moetrain.parallel.expert_parallel import is_expert_param
from moetrain.train.optim import adamw, build_optimizer
from moetrain.train.tensors import MOMENTS, local


def build_zero1_optimizers(
    grad_sync: GradientSync, expert_params: list[nn.Parameter], cfg: OptimConfig
) -> list[torch.optim.Optimizer]:
    """One AdamW over this rank's slices (decay, no-decay views), and a second one over the
    expert parameters whole, with the same two groups, when there are any."""
    groups = [grad_sync.optimizer_groups()]
    if expert_params:
        groups.append(
            (
                [p for p in expert_params if p.ndim >= 2],
                [p for p in expert_params if p.ndim < 2],
            )
        )
    return [adamw(decay, no_decay, cfg) for decay, no_decay in groups]


def zero1_shadow(
    grad_sync: GradientSync,
    optimizers: list[torch.optim.Optimizer],
    parts: list[nn.Module],
    cfg: OptimConfig,
    device: torch.device,
) -> list[torch.optim.Optimizer]:
    """Full-size AdamW optimizers per chunk holding the gathered state (collective)."""
    sharded = optimizers[0]
    shadows = [build_optimizer(part, cfg) for part in parts]
    if len(optimizers) > 1:  # the experts' optimizer is whole: its state as it is
        experts = optimizers[1]
        for shadow in shadows:
            for group in shadow.param_groups:
                for p in group["params"]:
                    if p in experts.state:
                        shadow.state[p] = {k: v.clone() for k, v in experts.state[p].items()}
    for shadow in shadows:  # lr, initial_lr (the scheduler's), betas...: the live values
        for group, live in zip(shadow.param_groups, sharded.param_groups, strict=True):
            group.update({k: v for k, v in live.items() if k != "params"})
    owner = {}
    for shadow in shadows:
        for group in shadow.param_groups:
            for p in group["params"]:
                owner[id(p)] = shadow
    step = None
    for v in (v for s in grad_sync.shards for v in s.views):
        if v in sharded.state:
            step = sharded.state[v]["step"]
            break
    dtype = getattr(sharded, "moments_dtype", None) or torch.float32
    for shard in grad_sync.shards:
        for key in MOMENTS:
            mine = torch.zeros(shard.size, device=device, dtype=dtype)
            pos = 0
            for v in shard.views:
                if v in sharded.state:
                    mine[pos : pos + v.numel()] = sharded.state[v][key]
                pos += v.numel()
            pieces = shard.gather_flat(mine, grad_sync.shard_group)
            for p, piece in zip(shard.params, pieces, strict=True):
                st = owner[id(p)].state.setdefault(p, {})
                st[key] = torch.zeros_like(p, dtype=dtype)
                local(st[key]).view(-1).copy_(piece)
                st["step"] = (
                    step.clone() if step is not None else torch.zeros((), dtype=torch.float32)
                )
    return shadows


def zero1_restore(
    grad_sync: GradientSync,
    optimizers: list[torch.optim.Optimizer],
    shadows: list[torch.optim.Optimizer],
) -> None:
    """Slice loaded shadows back into this rank's ZeRO-1 optimizers."""
    sharded = optimizers[0]
    owner = {id(p): sh for sh in shadows for g in sh.param_groups for p in g["params"]}
    for group, loaded in zip(sharded.param_groups, shadows[0].param_groups, strict=True):
        group.update({k: v for k, v in loaded.items() if k != "params"})
    if len(optimizers) > 1:
        experts = optimizers[1]
        for group, loaded in zip(experts.param_groups, shadows[0].param_groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        for shadow in shadows:
            for p, st in shadow.state.items():
                if is_expert_param(p):
                    experts.state[p] = {k: v.clone() for k, v in st.items()}
    for shard in grad_sync.shards:
        for v, (i, start, length) in zip(shard.views, shard.pieces, strict=True):
            p = shard.params[i]
            st = owner[id(p)].state[p]
            sharded.state[v] = {
                "step": st["step"].clone(),
                **{k: local(st[k]).reshape(-1)[start : start + length].clone() for k in MOMENTS},
            }
