"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model splits into ``pp * pp_virtual_stages`` stages of equal layer counts; stage s runs
on pp rank ``s % pp`` (the looped placement the interleaved schedules expect), so a rank with
v virtual stages holds chunks r, r + pp, r + 2 pp, ... Each chunk is a deep copy of the full
model with the layers it does not own deleted (torchtitan-style): names stay as in the full
model, so checkpoints do not depend on the layout. The first stage keeps the embedding, the
last the final norm and output.

The split happens before the other ``apply_*`` steps (a sharded module cannot be deep
copied); the ``PipelineStage`` objects and the schedule are built last, around the final
modules (``build_pipeline``).

Losses: the schedule runs ``loss_fn`` on the last stage for every micro-batch; it returns
the micro-batch's mean cross-entropy divided by the micro-batch count (``scale_grads=False``)
so the summed gradients are the step's mean, exactly as gradient accumulation does. The MoE
balancing losses of every stage ride on their layers' outputs (``AuxLossInjector``) with
scale 1 / micro-batches, so stages other than the last need nothing more.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetrain.config import ParallelConfig

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}


def stage_layers(n_layers: int, num_stages: int, stage: int) -> list[int]:
    """Layer indices of ``stage`` (equal, contiguous blocks)."""
    per = n_layers // num_stages
    return list(range(stage * per, (stage + 1) * per))


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages pp rank ``pp_rank`` runs, in order (looped placement)."""
    return [pp_rank + i * pp for i in range(virtual_stages)]


def pipeline_split(
    model: nn.Module, pp_rank: int, cfg: ParallelConfig
) -> tuple[list[nn.Module], list[int]]:
    """This pp rank's model chunks (deep copies of ``model`` without the other stages'
    layers) and their stage indices. pp=1: ``[model]`` itself."""
    if cfg.pp == 1:
        return [model], [0]
    num_stages = cfg.pp * cfg.pp_virtual_stages
    n_layers = len(model.layers)
    parts, ids = [], stage_ids(pp_rank, cfg.pp, cfg.pp_virtual_stages)
    for s in ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in stage_layers(n_layers, num_stages, s)}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if s != 0:
            part.tok_embeddings = None
        if s != num_stages - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts, ids


def build_pipeline(
    parts: list[nn.Module],
    ids: list[int],
    pp_group: Any,
    device: torch.device,
    cfg: ParallelConfig,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """``PipelineStage`` per chunk and the configured schedule around them."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    num_stages = cfg.pp * cfg.pp_virtual_stages
    stages = [
        PipelineStage(part, s, num_stages, device, group=pp_group)
        for part, s in zip(parts, ids, strict=True)
    ]
    cls = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
    if cfg.pp_schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
