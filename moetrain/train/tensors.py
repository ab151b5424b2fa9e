"""Small helpers for the tensors the engine holds under any layout: DTensor or plain, wrapped
or not. Shared by the step (``engine``), the checkpoint views (``state_views``), the full-state
gathers (``full_state``) and the ZeRO-1 shadows (``zero1_state``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from moetrain.model.init import fqn  # noqa: F401 (re-exported: the engine and tests use it)

# AdamW's two moments: the optimizer state every checkpoint and oracle reads.
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# Muon's one state tensor (moetrain.train.muon).
MUON_MOMENTS = ("momentum_buffer",)
# Every optimizer state tensor shaped like its parameter.
MOMENTS = ADAM_MOMENTS + MUON_MOMENTS


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, or ``t`` itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``g``, this rank's local piece of a tensor laid out like parameter ``p`` (its gradient),
    as a DTensor with ``p``'s mesh, placements, global shape and stride; ``g`` itself when
    ``p`` is no DTensor. The shape is given, not inferred: ``DTensor.from_local`` alone assumes
    even shards, so a dimension of odd size split over 2 ranks (FSDP's dim-0 shards) would be
    taken for a different size on each rank, and gathering it is a collective mismatch."""
    if not isinstance(p, DTensor) or isinstance(g, DTensor):
        return g
    return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())  # fmt: skip


def process_group(mesh: Any) -> Any:
    """The process group of a 1-D mesh, or None when there is nothing to communicate with."""
    return mesh.get_group() if mesh is not None and mesh.size() > 1 else None


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to full size (collective), or a plain tensor, as a CPU fp32 copy."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def shard_dims(t: torch.Tensor) -> list[str]:
    """The mesh dims a DTensor is sharded over (none for a plain tensor)."""
    if not isinstance(t, DTensor):
        return []
    names = t.device_mesh.mesh_dim_names or ()
    out = []
    for name, placement in zip(names, t.placements, strict=True):
        if placement.is_partial():
            raise RuntimeError(f"gradient with a Partial placement on mesh dim {name!r}")
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over a TP shard
            out.append(name)
    return out
