"""Full-size gathers of the engine's state on every rank: parameters, reduced gradients and
AdamW moments under the single-process names, as CPU tensors (collectives). The layout oracle
compares them with one process; export and tools read the parameters.

``FullStateGather`` is a mixin of ``moetrain.train.engine.Engine`` (its parts, meshes, groups,
ZeRO-1 gradient shards and ``app_state``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from moetrain.parallel.expert_parallel import (
    gather_expert_tensors,
    gather_experts,
    is_expert_param,
)
from moetrain.train.tensors import MOMENTS, fqn, full_cpu, like_param, local


class FullStateGather:
    """Full-state gathers of ``Engine``."""

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
        if self.pp_group is None:
            return mine
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient (the global-batch mean loss's), gathered to full
        size as CPU tensors under the single-process names (collective: every rank calls it
        and gets it). Valid between the reduction and the optimizer step (``grad_hook``)."""
        mine: dict[str, torch.Tensor] = {}
        zero1: dict[int, torch.Tensor] = {}
        if self.zero_stage == 1:
            assert self.grad_sync is not None
            for shard in self.grad_sync.shards:  # ZeRO-1 holds reduce-scattered slices only
                if not shard.params:
                    continue
                mine_flat = shard.grad_shard
                if mine_flat is None:
                    mine_flat = torch.zeros(shard.size, device=self.device)
                pieces = shard.gather_flat(mine_flat, self.grad_sync.shard_group)
                for p, piece in zip(shard.params, pieces, strict=True):
                    zero1[id(p)] = piece.view_as(local(p))
        for part in self.parts:
            experts: dict[str, torch.Tensor] = {}
            for name, p in part.named_parameters():
                if is_expert_param(p):
                    experts[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                    continue
                g = zero1.get(id(p), p.grad)
                if g is None:
                    g = torch.zeros_like(local(p))
                mine[fqn(name)] = full_cpu(like_param(g, p))
            if experts:  # gathered over EP (and TP under expert TP), like the weights
                full = gather_expert_tensors(experts, self.ep_mesh, self.etp_mesh)
                mine.update({fqn(k): full_cpu(v) for k, v in full.items()})
        return self._merge_stages(mine)

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's ``exp_avg`` and ``exp_avg_sq`` of every parameter, full size, on CPU, keyed
        ``<single-process name>.<moment>`` (collective; every rank gets it)."""
        state = self.app_state()["optim"]
        self._shadows = None
        mine: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith("state.") or not key.endswith(MOMENTS):
                continue
            if isinstance(value, torch.Tensor):
                mine[fqn(key.removeprefix("state."))] = full_cpu(value)
        return self._merge_stages(mine)

    def _merge_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.pp_group is None:
            return mine
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}
