"""ZeRO-1's optimizers and their checkpoint shadows.

Under ZeRO-1 each data-parallel rank steps an optimizer over its flat slices of the non-expert
parameters (``GradientSync``'s shards) and, with expert parallelism, a second one over its
whole experts (they already hold 1 / ep of the experts; their state is not sharded over dp).
Muon's matrices need whole matrices: ``Zero1Matrices`` all-gathers the Muon group's flat
update and orthogonalizes the matrices this rank's slice touches (Moonlight's distributed
Muon). Checkpoints must not depend on that layout, so saving builds *shadows*: full-size
optimizers per model chunk holding the gathered state, which DCP saves exactly like every
other stage's; loading fills the shadows and slices them back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.config import OptimConfig
from moetrain.parallel.data_parallel import GradientSync
from moetrain.train.muon import gather_costs, newton_schulz, ns_flops, whole
from moetrain.train.optim import build_from_groups, build_optimizer
from moetrain.train.tensors import ADAM_MOMENTS, MUON_MOMENTS, local


def build_zero1_optimizers(
    grad_sync: GradientSync,
    expert_groups: list[list[nn.Parameter]],
    cfg: OptimConfig,
    whole_matrices: Any = None,
) -> list[torch.optim.Optimizer]:
    """One optimizer over this rank's slices (the views of ``GradientSync``'s groups), and a
    second one over the expert parameters whole (``expert_groups``: the same groups), when
    there are any. ``whole_matrices``: Muon's for the experts (their EP layouts)."""
    flat: dict[str, Any] = {}
    if cfg.name == "muon":
        flat["whole_matrices"] = Zero1Matrices(grad_sync.shards[-1], grad_sync.shard_group)
    out = [build_from_groups(grad_sync.optimizer_groups(), cfg, **flat)]
    if any(expert_groups):
        muon = {"whole_matrices": whole_matrices} if cfg.name == "muon" else {}
        out.append(build_from_groups(expert_groups, cfg, **muon))
    return out


def _state_keys(optimizer: torch.optim.Optimizer, index: int) -> tuple[str, ...]:
    """The state tensors of group ``index``'s parameters."""
    return MUON_MOMENTS if optimizer.param_groups[index].get("muon") else ADAM_MOMENTS


class Zero1Matrices:
    """Muon's whole matrices from ZeRO-1's flat slices (``moetrain.train.muon``): the Muon
    group's updates all-gathered flat over the shard group once, in the Newton-Schulz dtype
    (``_FlatShard.gather_flat``); each matrix this rank's slice touches made whole over the
    other dims it is split on (tp), orthogonalized, and cut back to the slice."""

    def __init__(self, shard: Any, group: Any) -> None:
        """``shard``: the Muon group's ``_FlatShard``; ``group``: the shard group."""
        self.shard, self.group = shard, group

    def _owners(self, views: list[torch.Tensor]) -> list[nn.Parameter]:
        owner = {id(v): p for v, p in zip(self.shard.views, self.shard.owners, strict=True)}
        return [owner[id(v)] for v in views]

    def shapes(self, views: list[torch.Tensor]) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self._owners(views)]

    def costs(self, views: list[torch.Tensor], steps: int, dtype) -> tuple[int, int]:
        """(bytes this rank sends, Newton-Schulz FLOPs) of one step: the flat all-gather of
        the group, then each touched matrix made whole over tp."""
        n = dist.get_world_size(self.group) if self.group is not None else 1
        sent, flops = self.shard.size * (n - 1) * dtype.itemsize, 0
        for p in self._owners(views):
            layout = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
            b, shape = gather_costs(p, layout, dtype.itemsize)
            sent, flops = sent + b, flops + ns_flops(shape, steps)
        return sent, flops

    def __call__(
        self, views: list[torch.Tensor], updates: list[torch.Tensor], steps: int, dtype
    ) -> list[torch.Tensor]:
        shard = self.shard
        given = {id(v): u for v, u in zip(views, updates, strict=True)}
        mine = torch.zeros(shard.size, dtype=dtype, device=updates[0].device)
        pos = 0
        for v in shard.views:
            if id(v) in given:
                mine[pos : pos + v.numel()] = given[id(v)]
            pos += v.numel()
        pieces = shard.gather_flat(mine, self.group)
        out = {}
        for v, (i, start, length) in zip(shard.views, shard.pieces, strict=True):
            p = shard.params[i]
            layout = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
            w, back = whole(pieces[i].view(local(p).shape), layout, dtype)
            o = back(newton_schulz(w, steps, dtype))
            out[id(v)] = o.reshape(-1)[start : start + length]
        return [out[id(v)] for v in views]


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
    for index, shard in enumerate(grad_sync.shards):
        keys = _state_keys(sharded, index)
        for key in keys:
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
    if len(optimizers) > 1:  # the experts' own optimizer: its parameters are the experts
        experts = optimizers[1]
        expert_ids = {id(p) for g in experts.param_groups for p in g["params"]}
        for group, loaded in zip(experts.param_groups, shadows[0].param_groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        for shadow in shadows:
            for p, st in shadow.state.items():
                if id(p) in expert_ids:
                    experts.state[p] = {k: v.clone() for k, v in st.items()}
    for index, shard in enumerate(grad_sync.shards):
        keys = _state_keys(sharded, index)
        for v, (i, start, length) in zip(shard.views, shard.pieces, strict=True):
            p = shard.params[i]
            st = owner[id(p)].state[p]
            sharded.state[v] = {
                "step": st["step"].clone(),
                **{k: local(st[k]).reshape(-1)[start : start + length].clone() for k in keys},
            }
