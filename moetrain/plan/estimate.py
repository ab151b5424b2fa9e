"""A step-time and MFU estimate for a planned rank on a named GPU (an estimate: every input is
stated, docs/plan.md).

    compute   this rank's training FLOPs / (bf16 peak x matmul_efficiency): 6 x the active
              parameters of its layers (its tp share; routed experts at K / E of theirs, tp x
              theirs when parallel.expert_tp is off) + causal attention, per token it
              processes, + the recomputed forward under activation checkpointing
    comm      per axis, bytes / (link bandwidth x comm_efficiency), NVLink within a node, the
              network across; the part not hidden behind computation (``OVERLAP``)
    pipeline  the schedule's action list (``moetrain.parallel.pipeline.simulate_schedule``)
              run with every stage's own time: its rank's compute and exposed tp / cp / ep /
              pp communication, shared among the rank's stages by their FLOPs
              (``stage_flops_per_token``: the layers, and on the last stage the output head
              and the multi-token-prediction modules). Every rank's passes end with the
              schedule's makespan; bubble = makespan / this rank's busy time - 1. Planning
              one rank alone (the others' communication unknown), every stage's time is its
              FLOPs stretched by this rank's ratio of (compute + exposed) to compute.
    optimizer reading and writing the model state once in HBM, plus Muon's Newton-Schulz
              FLOPs at the matmul rate (``optim.name=muon``)

    step = (compute + exposed tp, cp, ep, pp) x (1 + bubble) + exposed dp, edp, muon
           + optimizer
    MFU  = model FLOPs (no recomputation) / (step x bf16 peak)

Unequal stages (``parallel.pp_stage_layers``; the head's work on the last stage; experts'
all-to-all on some stages only) set the pace by the slowest: it idles least, the others
wait for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moetrain.config import JobConfig
from moetrain.model.transformer import is_moe_layer
from moetrain.parallel.dims import ParallelDims
from moetrain.plan.build import RankState
from moetrain.plan.hardware import GPU, OVERLAP
from moetrain.plan.traffic import Axis

AFTER_PASSES = ("dp", "edp", "muon")
"""Axes whose traffic comes after the pipeline passes: the gradient reduction and Muon's
gathers in the optimizer step."""


@dataclass
class Estimate:
    gpu: str
    step_s: float
    compute_s: float
    model_flops: float
    """FLOPs of this rank's share of the model per step (what MFU counts)."""
    mfu: float
    bubble: float
    optimizer_s: float
    comm_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each axis's communication, before overlap."""
    exposed_s: dict[str, float] = field(default_factory=dict)
    """Seconds of each axis's communication left after overlap."""

    @property
    def busy_s(self) -> float:
        """Seconds of the rank's pipelined work per step: compute and the exposed tp, cp,
        ep and pp communication (dp's comes after the passes)."""
        exposed = sum(v for k, v in self.exposed_s.items() if k not in AFTER_PASSES)
        return self.compute_s + exposed

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / 1e12


def layer_flops_per_token(cfg: JobConfig, layer: int, tp: int) -> float:
    """Training FLOPs (forward + backward: 6 per parameter use) one token costs in ``layer``
    on one tp rank, attention scores included (causal: half the sequence on average)."""
    m, mo = cfg.model, cfg.moe
    D = m.dim
    if m.attention == "mla":
        qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        attn = D * (m.q_lora_rank or 0) + (m.q_lora_rank or D) * m.n_heads * qk
        attn += D * ((m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0))
        attn += (
            (m.kv_lora_rank or 0) * m.n_heads * ((m.qk_nope_head_dim or 0) + (m.v_head_dim or 0))
        )
        attn += m.n_heads * (m.v_head_dim or 0) * D
        width = m.n_heads * (qk + (m.v_head_dim or 0)) / 2
    else:
        dh = m.attn_head_dim
        attn = D * (m.n_heads + 2 * m.kv_heads) * dh + m.n_heads * dh * D
        width = m.n_heads * dh
    window = m.window(layer)
    S = cfg.data.seq_len
    pairs = S / 2 if window is None or window >= S else window * (1 - window / (2 * S))
    flops = (6 * attn + 12 * width * pairs) / tp
    if is_moe_layer(layer, mo):
        routed = mo.top_k * 3 * D * mo.expert_ffn_dim
        shared = 3 * D * (mo.shared_expert_ffn_dim or mo.num_shared_experts * mo.expert_ffn_dim)
        split = tp if cfg.parallel.expert_tp else 1
        flops += 6 * (routed + shared) / split + 6 * D * mo.num_experts  # + the router
    else:
        flops += 6 * 3 * D * m.ffn_dim / tp
    return flops


def stage_flops_per_token(cfg: JobConfig, dims: ParallelDims) -> list[float]:
    """Training FLOPs one token costs on each pipeline stage (on one tp rank): its layers
    (``layer_flops_per_token``), and on the last stage the output head and the multi-token-
    prediction modules (each a block, its input projection ``eh_proj`` and the head again).
    The stages' contents are ``stage_modules``'s, the pipeline split's own."""
    from moetrain.parallel.pipeline import stage_modules

    m = cfg.model
    head = 6 * m.dim * (m.vocab_size or 0) / dims.tp
    eh_proj = 6 * 2 * m.dim * m.dim / dims.tp
    out = []
    for s in range(dims.num_stages):
        blocks, _, last = stage_modules(
            m.n_layers, m.mtp_depth, dims.num_stages, s, cfg.parallel.pp_stage_layers
        )
        flops = sum(layer_flops_per_token(cfg, i, dims.tp) for i in blocks)
        if last:
            flops += head + m.mtp_depth * (head + eh_proj)
        out.append(flops)
    return out


def rank_times(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    axes: list[Axis],
    hw: GPU,
    overlap: dict[str, float] | None = None,
) -> Estimate:
    """A rank's compute and communication per step, without the pipeline's idle time
    (``step_s`` and ``mfu`` as if the schedule had no bubble: ``with_pipeline`` adds it)."""
    ov = {**OVERLAP, **(overlap or {})}
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / (dims.dp * dims.cp)
    per_stage = stage_flops_per_token(cfg, dims)
    model_flops = sum(per_stage[c.stage] for c in state.chunks) * tokens
    peak = hw.bf16_tflops * 1e12
    compute_s = model_flops * (1 + _recompute(cfg)) / (peak * hw.matmul_efficiency)
    comm, exposed = {}, {}
    for a in axes:
        bw = hw.nvlink_gbs if a.nodes == 1 else hw.ib_gbs
        if a.name == "ep" and a.nodes > 1:  # an all-to-all: each share on its own link
            t = a.bytes * (a.inter_fraction / hw.ib_gbs + (1 - a.inter_fraction) / hw.nvlink_gbs)
        else:
            t = a.bytes / bw
        t /= 1e9 * hw.comm_efficiency
        comm[a.name] = t
        key = "dp_fsdp" if a.name == "dp" and cfg.parallel.zero_stage >= 2 else a.name
        hidden = ov.get(key, ov.get(a.name, 0.0))
        if a.name == "ep" and cfg.parallel.overlap_shared_experts:
            hidden = max(hidden, 0.5)
        exposed[a.name] = t * (1 - hidden)
    opt_s = 2 * state.model_state / (hw.hbm_tbs * 1e12)
    # Muon's Newton-Schulz: matmuls at the dense rate (bf16; fp32 runs slower: an estimate)
    opt_s += state.muon_flops / (peak * hw.matmul_efficiency)
    e = Estimate(
        gpu=hw.name,
        step_s=0.0,
        compute_s=compute_s,
        model_flops=model_flops,
        mfu=0.0,
        bubble=0.0,
        optimizer_s=opt_s,
        comm_s=comm,
        exposed_s=exposed,
    )
    return with_pipeline(e, e.busy_s, hw)


def with_pipeline(e: Estimate, pipeline_s: float, hw: GPU) -> Estimate:
    """``e`` with its passes taking ``pipeline_s`` seconds (busy + idle): step, bubble, MFU."""
    e.step_s = pipeline_s + sum(e.exposed_s.get(k, 0.0) for k in AFTER_PASSES)
    e.step_s += e.optimizer_s
    e.bubble = pipeline_s / e.busy_s - 1 if e.busy_s > 0 else math.inf
    e.mfu = e.model_flops / (e.step_s * hw.bf16_tflops * 1e12)
    return e


def schedule_makespan(
    cfg: JobConfig, dims: ParallelDims, stage_s: list[float]
) -> tuple[float, dict[str, Any]]:
    """Seconds of a step's passes of the pipeline schedule when stage s takes ``stage_s[s]``
    seconds per step (forward and backward of all its micro-batches), and the simulation."""
    from moetrain.parallel.pipeline import UNIT_COST, schedule_actions, simulate_schedule

    p = cfg.parallel
    m = dims.breadth_first(cfg)
    order = schedule_actions(p.pp_schedule, dims.pp, dims.virtual_stages, m)
    # A stage's forward + backward of one micro-batch costs (F + B) units of stage_cost.
    unit = UNIT_COST["F"] + UNIT_COST["B"]
    per_mb = [t / (dims.microbatches(cfg) * unit) for t in stage_s]
    sim = simulate_schedule(order, dims.num_stages, per_mb)
    return sim["makespan"] * dims.depth_first(cfg), sim


def estimate(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    axes: list[Axis],
    hw: GPU,
    overlap: dict[str, float] | None = None,
) -> Estimate:
    """One rank's estimate, planned alone: the other stages' times are their FLOPs at this
    rank's pace (its compute and exposed communication per FLOP)."""
    e = rank_times(cfg, dims, state, axes, hw, overlap)
    if dims.pp == 1:
        return e
    flops = stage_flops_per_token(cfg, dims)
    mine = sum(flops[c.stage] for c in state.chunks)
    if mine == 0:  # no computing stage of its own: the others at compute speed alone
        pace = (1 + _recompute(cfg)) / (hw.bf16_tflops * 1e12 * hw.matmul_efficiency)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len / (dims.dp * dims.cp)
        stage_s = [f * tokens * pace for f in flops]
    else:
        stage_s = [f / mine * e.busy_s for f in flops]
    makespan, _ = schedule_makespan(cfg, dims, stage_s)
    return with_pipeline(e, max(makespan, e.busy_s), hw)


def estimate_ranks(
    cfg: JobConfig,
    dims: ParallelDims,
    ranks: list[tuple[RankState, list[Axis]]],
    hw: GPU,
    overlap: dict[str, float] | None = None,
) -> list[Estimate]:
    """The estimates of planned ranks. When they include every pipeline rank, each stage's
    time is its own rank's (compute and exposed communication, shared among the rank's
    stages by FLOPs) and one simulation of the schedule gives every rank the same makespan;
    otherwise each rank is estimated alone (``estimate``)."""
    if dims.pp == 1 or {s.coords["pp"] for s, _ in ranks} != set(range(dims.pp)):
        return [estimate(cfg, dims, s, a, hw, overlap) for s, a in ranks]
    out = [rank_times(cfg, dims, s, a, hw, overlap) for s, a in ranks]
    flops = stage_flops_per_token(cfg, dims)
    stage_s = [0.0] * dims.num_stages
    seen: set[int] = set()
    for (state, _), e in zip(ranks, out, strict=True):
        if state.coords["pp"] in seen:
            continue  # the pipeline rank's first planned rank stands for its others
        seen.add(state.coords["pp"])
        mine = [flops[c.stage] for c in state.chunks]
        for c, f in zip(state.chunks, mine, strict=True):
            share = f / sum(mine) if sum(mine) > 0 else 1 / len(mine)
            stage_s[c.stage] = share * e.busy_s
    makespan, _ = schedule_makespan(cfg, dims, stage_s)
    return [with_pipeline(e, max(makespan, e.busy_s), hw) for e in out]


def _recompute(cfg: JobConfig) -> float:
    return {"none": 0.0, "selective": 1 / 12, "full": 1 / 3}[cfg.parallel.activation_checkpointing]
