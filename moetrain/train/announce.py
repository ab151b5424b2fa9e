"""What a run says once its start is accepted: the model, the layout, the data's unigram
entropy and the MFU denominator in the log; the config, the entropy and a benchmark run's
marks in TensorBoard; a warning when the warm-up outlasts the run."""

from __future__ import annotations

import logging

import torch

from moetrain.config import JobConfig, config_to_yaml
from moetrain.parallel.dims import ParallelDims
from moetrain.train.metrics import MetricsWriter

log = logging.getLogger("moetrain")

BENCHMARK_TAG = "BENCHMARK: forced balanced routing"
"""Marks every log line and the TensorBoard run of a ``moe.force_load_balancing`` run."""


def announce_start(
    cfg: JobConfig,
    dims: ParallelDims,
    writer: MetricsWriter,
    step: int,
    *,
    params: int,
    active_params: int,
    moe_layers: int,
    device: torch.device,
    dtype: torch.dtype,
    entropy: float,
    peak_flops: float,
    peak_source: str,
    resumed: bool,
) -> None:
    """Log and record the start of a run at ``step`` (``resumed``: from a checkpoint)."""
    log.info(
        "model: %.2fM params (%.2fM active per token), %d MoE layers, device %s %s",
        params / 1e6,
        active_params / 1e6,
        moe_layers,
        device,
        str(dtype).removeprefix("torch."),
    )
    d = dims
    log.info(
        "layout: world %d = pp %d x dp_replicate %d x dp_shard %d x cp %d x tp %d; "
        "zero_stage %d, sequence_parallel %s, %d micro-batches of %d per dp rank%s%s",
        d.world_size,
        d.pp,
        d.dp_replicate,
        d.dp_shard,
        d.cp,
        d.tp,
        cfg.parallel.zero_stage,
        cfg.parallel.sequence_parallel,
        d.microbatches(cfg),
        d.micro_batch_size(cfg),
        f", schedule {cfg.parallel.pp_schedule} x {d.virtual_stages} virtual stages"
        if d.pp > 1
        else "",
        # expert parallelism (ep)
        f", ep {d.ep} x edp {d.dp_cp // d.ep} ({cfg.parallel.ep_dispatcher}"
        f"{', expert_tp' if cfg.parallel.expert_tp else ''})"
        if d.ep > 1
        else "",
    )
    log.info(
        "data: unigram entropy of the training tokens %.3f nats/token; MFU against "
        "%.1f GFLOP/s (%s)",
        entropy,
        peak_flops / 1e9,
        peak_source,
    )
    tcfg = cfg.train
    if 0 < tcfg.steps <= cfg.optim.warmup_steps and not resumed:
        log.warning("optim.warmup_steps=%d >= train.steps=%d: the learning rate rises for "
                    "the whole run and never reaches optim.lr=%g", cfg.optim.warmup_steps,
                    tcfg.steps, cfg.optim.lr)  # fmt: skip
    writer.text("config", "```\n" + config_to_yaml(cfg) + "\n```")
    writer.scalars({"data/unigram_entropy": entropy}, step)
    if cfg.moe.force_load_balancing:
        # A benchmark run (train.benchmark): say so where anyone reading the run looks.
        log.warning(
            "%s: every token is routed by its position, not by the router; the model "
            "this run trains is useless (a speed benchmark)",
            BENCHMARK_TAG,
        )
        writer.text(
            "benchmark",
            f"**{BENCHMARK_TAG}**: routing forced to perfect balance "
            "(moe.force_load_balancing); not a model to use.",
        )
        writer.scalars({"benchmark/forced_load_balancing": 1.0}, step)
