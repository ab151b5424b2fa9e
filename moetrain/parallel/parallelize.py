"""The one ordering function: a single-device model in, this rank's distributed pieces out.

    pipeline_split (module tree only) -> per chunk: TP/SP -> CP -> EP -> activation
    checkpointing -> compile -> FSDP/ZeRO -> pipeline stages + schedule

The split of the module tree comes first because a sharded module cannot be deep-copied (as
in torchtitan); the pipeline itself (``PipelineStage`` per chunk and the schedule) is built
last, around the final modules. Each step is a small ``apply_*`` taking (module, mesh, its
config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moetrain.config import ParallelConfig
from moetrain.model.precision import Precision
from moetrain.parallel.activation_checkpoint import apply_ac, apply_compile
from moetrain.parallel.context_parallel import apply_cp
from moetrain.parallel.data_parallel import apply_ddp, apply_fsdp
from moetrain.parallel.dims import Meshes, ParallelDims
from moetrain.parallel.pipeline import build_pipeline, forward_only, pipeline_split
from moetrain.parallel.tensor_parallel import apply_tp


@dataclass
class ParallelModel:
    """This rank's model chunks (one unless pipelined), their stage indices, the schedule."""

    parts: list[nn.Module]
    stage_ids: list[int]
    schedule: Any = None
    eval_schedule: Any = None
    """A second schedule around the same chunks for forward-only passes (evaluation, the
    global balancing loss's counting pass): a schedule switched between training and
    forward-only steps infers its stages' shapes again at every switch, with an extra forward
    of each stage (torch 2.13) that MoE layers would count; one schedule per mode never
    switches."""
    expert_params: list[nn.Parameter] = field(default_factory=list)
    """This rank's expert parameters (ep > 1): kept out of the dp reduction, reduced over
    the expert-data-parallel group by the engine (``reduce_expert_grads``)."""
    seq_shard: Any = None
    """Context parallelism (cp > 1): the ``ContextShard`` of this rank's positions of every
    sequence, for the model's step context (``StepContext.seq_shard``); None at cp = 1."""


def expert_parallel_hook(
    model: nn.Module, meshes: Meshes | None, cfg: ParallelConfig
) -> list[nn.Parameter]:
    """Expert parallelism (``moetrain.parallel.expert_parallel.apply_ep``): keep this rank's
    experts, install the EP dispatcher, return the expert parameters. A no-op at ep=1."""
    if cfg.ep == 1:
        return []
    if meshes is None or meshes.ep is None:
        raise ValueError("parallel.ep > 1 needs the EP meshes (ParallelDims.build_mesh)")
    from moetrain.parallel.expert_parallel import apply_ep

    return apply_ep(model, meshes, cfg)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    meshes: Meshes | None,
    cfg: ParallelConfig,
    *,
    pp_rank: int = 0,
    compile: bool = False,
    precision: Precision | None = None,
    device: torch.device | None = None,
    n_microbatches: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    seq_len: int = 0,
) -> ParallelModel:
    """Apply the layout ``dims`` to ``model`` (built identically on every rank).
    ``precision``: the run's policy, whose FSDP2 mixed-precision policies ZeRO-2/3 applies
    (None: fp32).
    ``n_microbatches``: micro-batches of one pass of the pipeline schedule; ``seq_len``:
    the sequence length context parallelism splits."""
    parts, ids = pipeline_split(model, pp_rank, cfg)
    expert_params: list[nn.Parameter] = []
    seq_shard = None
    for part in parts:
        if meshes is not None:
            apply_tp(part, meshes.tp, cfg)
            seq_shard = apply_cp(part, meshes.cp, seq_len) or seq_shard
        experts = expert_parallel_hook(part, meshes, cfg)
        expert_params += experts
        apply_ac(part, cfg.activation_checkpointing)
        apply_compile(part, compile)
        # Gradients are averaged over dp x cp (cp ranks hold other tokens of the same
        # sequences); ZeRO shards over dp_shard x cp.
        if meshes is not None and dims.dp_cp > 1:
            if cfg.zero_stage >= 2:
                shard_dim = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
                dp_mesh = (
                    meshes.dp_shard_cp
                    if dims.dp_replicate == 1
                    else meshes.world["dp_replicate", shard_dim]
                )
                apply_fsdp(part, dp_mesh, cfg.zero_stage, precision, ignored=experts)
            else:
                apply_ddp(part, meshes.dp_cp, cfg.zero_stage)
    schedule = eval_schedule = None
    if dims.pp > 1:
        assert meshes is not None and loss_fn is not None and device is not None
        schedule, eval_schedule = (
            build_pipeline(parts, ids, meshes.pp.get_group(), device, cfg, n_microbatches, loss_fn)
            for _ in range(2)
        )
        forward_only(eval_schedule)
    return ParallelModel(parts, ids, schedule, eval_schedule, expert_params, seq_shard)
