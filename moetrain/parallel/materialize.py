"""A parallelized meta-device model made real on this rank: storage for its own shards only,
each initialised in the region of the full tensor it holds.

    parallelize(meta model) -> materialize(parts, device, model cfg, seed, expert layouts)

``torch.nn.Module.to_empty`` gives every parameter and buffer of this rank's chunks their
storage (DTensor local shards, FSDP2's padded shards, this rank's experts, whole replicated
tensors), then each parameter is filled with its region of the layout-independent initial
value (``moetrain.model.init``) and every buffer is recomputed. Where a parameter's region
lies in the full tensor comes from its placements, as DCP reads them for checkpoints: a
DTensor's own (TP, FSDP, both), the EP mesh's for the expert slices of expert parallelism
(``expert_layouts``), the whole tensor for everything else.

A rank's start-up memory is then its parameters and buffers plus one generator block of
the initialisation (``init_workspace``: what ``moetrain plan`` reports as the start-up).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from moetrain.config import ModelConfig
from moetrain.model.init import (
    Slice,
    init_buffers,
    init_parameters,
    largest_block,
    named_inits,
    to_empty,
)

ExpertLayouts = dict[str, tuple[Any, tuple[Any, ...]]]
"""Full-model name -> (mesh, placements) of each expert slice this rank holds
(``moetrain.parallel.expert_parallel.expert_layouts``)."""


def local_slice(name: str, p: torch.Tensor, layouts: ExpertLayouts | None = None) -> Slice:
    """(the tensor this rank holds of parameter ``name``, the full shape, its offsets)."""
    if isinstance(p, DTensor):
        mesh, placements, local = p.device_mesh, p.placements, p.to_local()
        shape = tuple(p.shape)
    elif layouts and name in layouts:
        mesh, placements = layouts[name]
        local = p
        shape = tuple(DTensor.from_local(p.detach(), mesh, placements, run_check=False).shape)
    else:
        return p, tuple(p.shape), (0,) * p.dim()
    local_shape, offsets = _compute_local_shape_and_global_offset(
        shape, mesh.shape, _coordinate(mesh), placements
    )
    if tuple(local_shape) != tuple(local.shape):
        raise RuntimeError(f"{name}: this rank holds {tuple(local.shape)} of {shape}, but its "
                           f"placements {placements} give {tuple(local_shape)}")  # fmt: skip
    return local, shape, tuple(offsets)


def _coordinate(mesh: Any) -> list[int]:
    """This process's coordinate in ``mesh``, from the global rank: what DTensor's
    ``compute_local_shape_and_global_offset`` reads off the mesh, without the mesh's cached
    coordinate (a plan builds ranks one after the other in one process, and a sub-mesh
    cached under an earlier rank's fake world keeps that rank's coordinate)."""
    import torch.distributed as dist

    where = (mesh.mesh == dist.get_rank()).nonzero()
    if len(where) != 1:
        raise RuntimeError(f"rank {dist.get_rank()} is not in {mesh}")
    return [int(i) for i in where[0]]


def materialize(
    parts: list[nn.Module],
    device: torch.device,
    cfg: ModelConfig,
    seed: int,
    layouts: ExpertLayouts | None = None,
    skip: Collection[str] = (),
) -> int:
    """Give this rank's chunks (parallelized on the meta device) storage on ``device`` and
    their initial values from ``seed``, the same under every layout. ``skip``: full-model
    names whose random initialisation is left out (a start loads them next). Returns the
    elements of the largest generator block drawn."""
    where = functools.partial(local_slice, layouts=layouts)
    largest = 0
    for part in parts:
        to_empty(part, device)
        largest = max(largest, init_parameters(part, cfg, seed, where, skip))
        init_buffers(part)
    return largest


def init_workspace(
    parts: list[nn.Module], cfg: ModelConfig, layouts: ExpertLayouts | None = None
) -> int:
    """Elements of the largest generator block ``materialize`` draws on this rank: read off
    the chunks' shapes and placements (meta tensors do), nothing drawn."""
    out = 0
    for part in parts:
        for name, p, rule in named_inits(part, cfg):
            local, shape, offsets = local_slice(name, p, layouts)
            out = max(out, largest_block(shape, rule, offsets, tuple(local.shape)))
    return out
