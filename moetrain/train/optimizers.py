"""The optimizers of a rank's model chunks, as the layout needs them (``build_optimizers``):
the trainer's engine steps them, and ``moetrain plan`` builds the same ones on the meta
device to read the state they create. Imported from ``moetrain.train.engine`` too.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import JobConfig
from moetrain.parallel.data_parallel import GradientSync
from moetrain.parallel.dims import Meshes, ParallelDims
from moetrain.train.muon_owners import expert_matrices
from moetrain.train.optim import build_optimizer, optimizer_groups
from moetrain.train.tensors import process_group
from moetrain.train.zero1_state import build_zero1_optimizers


def build_optimizers(
    cfg: JobConfig,
    dims: ParallelDims,
    meshes: Meshes | None,
    parts: list[nn.Module],
    expert_params: list[nn.Parameter],
) -> tuple[GradientSync | None, list[torch.optim.Optimizer]]:
    """The optimizer(s) of this rank's model chunks (``parallelize``'s parts): one AdamW (or
    Muon + AdamW, ``optim.name``) per chunk (state dicts are per module), or for ZeRO stages
    0/1 a ``GradientSync`` and, for ZeRO-1, one optimizer over this rank's slices (and one
    over its experts). The engine steps
    them; ``moetrain plan`` builds the same ones on the meta device and reads the state they
    create (the optimizer decides its states' shapes and dtypes, not a formula)."""
    zero_stage = cfg.parallel.zero_stage if dims.dp_cp > 1 else 0
    grad_sync: GradientSync | None = None
    # optimizer_groups of every chunk, merged by index, experts apart (reduced over edp)
    groups: list[list[nn.Parameter]] = []
    expert_groups: list[list[nn.Parameter]] = []
    experts = {id(p) for p in expert_params}
    for part in parts:
        for i, group in enumerate(optimizer_groups(part, cfg.optim)):
            if i == len(groups):
                groups.append([])
                expert_groups.append([])
            groups[i] += [p for p in group if id(p) not in experts]
            expert_groups[i] += [p for p in group if id(p) in experts]
    if zero_stage <= 1 and meshes is not None:
        grad_sync = GradientSync(
            groups,
            zero_stage,
            process_group(meshes.dp_cp),
            process_group(meshes.dp_shard_cp),
            process_group(meshes.dp_replicate),
        )
    # Muon: where each expert slice sits in its full tensor (moetrain.train.muon)
    muon = {}
    if cfg.optim.name == "muon":
        muon["whole_matrices"] = expert_matrices(parts, meshes, cfg)
    if zero_stage == 1:
        assert grad_sync is not None
        return grad_sync, build_zero1_optimizers(grad_sync, expert_groups, cfg.optim, **muon)
    return grad_sync, [build_optimizer(part, cfg.optim, **muon) for part in parts]
