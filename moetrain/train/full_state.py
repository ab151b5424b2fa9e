"""Full-size gathers of the engine's state on every rank: parameters, reduced gradients and
AdamW moments under the single-process names, as CPU tensors (collectives). The layout oracle
compares them with one process; export and tools read the parameters.

``FullStateGather`` is a collaborator of ``moetrain.train.engine.Engine``, handed what it
reads: the rank's model chunks and expert parameters, the EP (and expert-TP) meshes, the step's
groups, ZeRO-1's gradient sync and a function returning the optimizer state (the checkpoint
views').
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from moetrain.parallel.data_parallel import GradientSync
from moetrain.parallel.expert_parallel import (
    gather_expert_tensors,
    gather_experts,
)
from moetrain.train.step_groups import StepGroups
from moetrain.train.tensors import MOMENTS, fqn, full_cpu, like_param, local


class FullStateGather:
    """Full-size gathers of a rank's model chunks (``parts``). ``zero1``: ZeRO-1's gradient
    sync when the gradients live in its reduce-scattered slices; ``optimizer_state``: the
    flattened optimizer state under full-model names (``CheckpointViews.optimizer_state``)."""

    def __init__(
        self,
        parts: list[nn.Module],
        expert_params: list[nn.Parameter],
        ep_mesh: Any,
        etp_mesh: Any,
        groups: StepGroups,
        zero1: GradientSync | None,
        optimizer_state: Callable[[], dict[str, Any]],
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.expert_params = expert_params
        self.ep_mesh = ep_mesh
        self.etp_mesh = etp_mesh
        self.groups = groups
        self.zero1 = zero1
        self.optimizer_state = optimizer_state
        self.device = device

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and persistent buffers as CPU tensors, gathered over
        every dimension (collective; every rank gets it). For tests and tools."""
        mine: dict[str, torch.Tensor] = {}
        for part in self.parts:
            sd = get_model_state_dict(
                part, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
            )
            mine.update({k: local(v).detach().cpu().clone() for k, v in sd.items()})
            if self.expert_params:  # the experts, gathered over EP (and TP under expert TP)
                full = gather_experts(part, self.ep_mesh, self.etp_mesh)
                mine.update({fqn(k): v.cpu().clone() for k, v in full.items()})
        return self.groups.merge_stages(mine)

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient (the global-batch mean loss's), gathered to full
        size as CPU tensors under the single-process names (collective: every rank calls it
        and gets it). Valid between the reduction and the optimizer step (``grad_hook``)."""
        mine: dict[str, torch.Tensor] = {}
        zero1: dict[int, torch.Tensor] = {}
        if self.zero1 is not None:
            for shard in self.zero1.shards:  # ZeRO-1 holds reduce-scattered slices only
                if not shard.params:
                    continue
                mine_flat = shard.grad_shard
                if mine_flat is None:
                    mine_flat = torch.zeros(shard.size, device=self.device)
                pieces = shard.gather_flat(mine_flat, self.zero1.shard_group)
                for p, piece in zip(shard.params, pieces, strict=True):
                    zero1[id(p)] = piece.view_as(local(p))
        expert_ids = {id(p) for p in self.expert_params}
        for part in self.parts:
            experts: dict[str, torch.Tensor] = {}
            for name, p in part.named_parameters():
                if id(p) in expert_ids:
                    experts[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                    continue
                g = zero1.get(id(p), p.grad)
                if g is None:
                    g = torch.zeros_like(local(p))
                mine[fqn(name)] = full_cpu(like_param(g, p))
            if experts:  # gathered over EP (and TP under expert TP), like the weights
                full = gather_expert_tensors(experts, self.ep_mesh, self.etp_mesh)
                mine.update({fqn(k): full_cpu(v) for k, v in full.items()})
        return self.groups.merge_stages(mine)

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's ``exp_avg`` and ``exp_avg_sq`` of every parameter, full size, on CPU, keyed
        ``<single-process name>.<moment>`` (collective; every rank gets it)."""
        state = self.optimizer_state()
        mine: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith("state.") or not key.endswith(MOMENTS):
                continue
            if isinstance(value, torch.Tensor):
                mine[fqn(key.removeprefix("state."))] = full_cpu(value)
        return self.groups.merge_stages(mine)
