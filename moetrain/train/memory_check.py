"""The memory check before a start (``train.memory_check``): this rank's planned peak
against the memory it has, refused with both figures and the plan's advice."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from moetrain.config import ConfigError, JobConfig
from moetrain.parallel.dims import ParallelDims

log = logging.getLogger("moetrain")


def check_memory(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> None:
    """Refuse a start whose planned peak on this rank exceeds the memory it has
    (``train.memory_check``): the plan (``moetrain.plan``) of this rank -- the model built
    on the meta device under a fake process group, the real parallelize and optimizers --
    against ``train.memory_per_rank_gb`` or what the device has. Skipped, with a line in
    the log, in a process that already started a process group (the plan needs one of its
    own): tests and tools that drive the trainer in-process."""
    if dist.is_available() and dist.is_initialized():
        log.info("memory check skipped: this process already has a process group")
        return
    from moetrain.plan.planner import available_memory, plan
    from moetrain.plan.report import advice
    from moetrain.train.engine import build_optimizers

    rank = int(os.environ.get("RANK", "0"))
    planned = plan(cfg, dims.world_size, build_optimizers, device_type=device.type, ranks=[rank])
    need = planned.peak()
    gb = cfg.train.memory_per_rank_gb
    have, source = (gb * 1e9, "train.memory_per_rank_gb") if gb else available_memory(device)
    r = planned.ranks[0]
    if need <= have:
        if r.staging and device.type != "cpu":
            _check_host_staging(r.staging)
        if need + r.dropless_worst > have:
            _warn_dropless(rank, need, r.dropless_worst, have, source)
        return
    on_device = planned.staging_on_device(r)
    staged = f", checkpoint staging {on_device / 1e9:.3g}" if on_device else ""
    tips = "; ".join(t.rstrip(".") for t in advice(planned, have / 1e9)[:-1])
    raise ConfigError(
        f"train.memory_check: rank {rank} needs about {need / 1e9:.3g} GB (start-up "
        f"{planned.start_up_of(r) / 1e9:.3g} GB: its shards and one init block; step peak "
        f"{r.steady / 1e9:.3g} GB: model state {r.state.model_state / 1e9:.3g}, activations "
        f"{(r.activations + r.recompute) / 1e9:.3g}"
        f"{staged}) but has {have / 1e9:.3g} GB ({source}). "
        f"{tips + '. ' if tips else ''}`moetrain plan --config ... --world {dims.world_size}` "
        "shows every figure and --search the layouts that fit; train.memory_check=false starts "
        "anyway (docs/plan.md)"
    )


def _warn_dropless(rank: int, need: float, worst: float, have: float, source: str) -> None:
    """Dropless expert parallelism sizes each layer's receive buffer by the routing: warn
    when the step that sends one layer's every token to this rank would not fit."""
    log.warning(
        "train.memory_check: rank %d fits balanced routing (%.3g GB of %.3g GB, %s), but "
        "dropless expert parallelism sizes each MoE layer's receive buffer by the routing: "
        "a step whose routing sends one layer's every token of the EP group to this rank "
        "needs %.3g GB more, %.3g GB in all. A capacity factor (moe.capacity_factor) bounds "
        "it; moe/layer{L}/recv_rows_max_over_mean shows how close the run comes "
        "(docs/expert_parallel.md)", rank, need / 1e9, have / 1e9, source, worst / 1e9,
        (need + worst) / 1e9)  # fmt: skip


def _check_host_staging(per_rank: int) -> None:
    """A GPU's ranks stage their asynchronous checkpoints in pinned host memory: refuse a
    start whose node's ranks would need more than the host has available."""
    from moetrain.plan.planner import host_memory_available

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    have = host_memory_available()
    if per_rank * local <= have:
        return
    raise ConfigError(
        f"train.checkpoint_async: the {local} rank(s) of this node stage "
        f"{per_rank / 1e9:.3g} GB each of parameters and optimizer state in pinned host "
        f"memory, {per_rank * local / 1e9:.3g} GB, but the host has {have / 1e9:.3g} GB "
        "available (MemAvailable); set train.checkpoint_async=false to save synchronously, "
        "or shard the state over more ranks (docs/checkpoints.md)"
    )
