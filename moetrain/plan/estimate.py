"""A step-time and MFU estimate for a planned rank on a named GPU (an estimate: every input is
stated, docs/plan.md).

    work      what this rank's step computes: per class (routed-expert GEMMs, attention,
              other matmuls) the model formula's FLOPs of its layers per token it processes
              (``layer_flops_by_class``: its tp share; routed experts at K / E of theirs, tp
              x theirs when parallel.expert_tp is off; causal attention; on the last stage
              the output head and the multi-token-prediction modules), times what the
              census of the code's step says it computes for them (``moetrain.plan.stepmix``:
              computed / formula FLOPs, and the share in each dtype: fp32 GEMMs where
              autocast does not reach them); the bytes its other ops move (activation traffic
              per byte of saved activations, parameter casts per parameter and micro-batch,
              the optimizer's bytes per byte of its state, all from the same census); + the
              recomputed forward under activation checkpointing
    compute   each class's FLOPs in each dtype at its rate (``hardware.rates``: measured
              rows of this GPU's architecture where they exist, each named), + the bytes at
              the copy bandwidth
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
    optimizer the optimizer step's bytes at the copy bandwidth, plus Muon's Newton-Schulz
              FLOPs at the matmul rate of its dtype (``optim.name=muon``)

    step = (compute + exposed tp, cp, ep, pp) x (1 + bubble) + exposed dp, edp, muon
           + optimizer
    MFU  = model FLOPs (no recomputation) / (step x bf16 peak)

Unequal stages (``parallel.pp_stage_layers``; the head's work on the last stage; experts'
all-to-all on some stages only) set the pace by the slowest: it idles least, the others
wait for it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from moetrain.config import JobConfig
from moetrain.parallel.dims import ParallelDims
from moetrain.plan.build import RankState
from moetrain.plan.flops import (
    layer_flops_by_class,
    layer_flops_per_token,
    stage_flops_by_class,
    stage_flops_per_token,
)
from moetrain.plan.hardware import GPU, OVERLAP, Rate, rate_of, rates
from moetrain.plan.stepmix import StepMix
from moetrain.plan.traffic import Axis

__all__ = ["Estimate", "estimate", "estimate_ranks", "layer_flops_by_class",
           "layer_flops_per_token", "rank_times", "rank_work", "stage_flops_by_class",
           "stage_flops_per_token"]  # fmt: skip

PARTS = ("expert GEMMs", "attention", "other matmuls", "elementwise and copies")
"""The compute's parts, as ``tools/bench_e2e.py`` reads them off a profile (with the
optimizer, a part of the step of its own)."""
_PART = {"experts": "expert GEMMs", "attention": "attention", "matmul": "other matmuls"}

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
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of each part of the compute (``PARTS``): ``compute_s`` is their sum."""
    flops: dict[str, float] = field(default_factory=dict)
    """FLOPs the step computes per "<class>/<dtype>" (recomputation included)."""
    bytes: dict[str, float] = field(default_factory=dict)
    """Bytes the other ops move: "activations", "weights", "optimizer"."""
    rates: dict[str, Rate] = field(default_factory=dict)
    """The rate each "<class>/<dtype>" and "copy" was priced at, with its source."""

    @property
    def busy_s(self) -> float:
        """Seconds of the rank's pipelined work per step: compute and the exposed tp, cp,
        ep and pp communication (dp's comes after the passes)."""
        exposed = sum(v for k, v in self.exposed_s.items() if k not in AFTER_PASSES)
        return self.compute_s + exposed

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / 1e12


def rank_work(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    mix: StepMix,
    device_type: str = "cuda",
) -> tuple[float, dict[str, float], dict[str, float]]:
    """(model FLOPs, FLOPs computed per "<class>/<dtype>", bytes moved per kind) of this
    rank's step: the model formula's FLOPs per class scaled by what the census says the code
    computes for them (recomputation included); traffic scaled from the census per byte of
    saved activations, per parameter and per byte of optimizer state. On a GPU attention
    is priced as its fused kernel runs it (the formula's FLOPs in the compute dtype); the
    census's CPU may take SDPA's math path."""
    from moetrain.model.precision import Precision
    from moetrain.plan import activations as act

    tokens = cfg.train.global_batch_size * cfg.data.seq_len / (dims.dp * dims.cp)
    per_stage = stage_flops_by_class(cfg, dims)
    redo = 1 + _recompute(cfg)
    compute = Precision.choose(cfg.train.dtype, device_type).dtype  # the trainer's
    dtype = str(compute).removeprefix("torch.")
    model = 0.0
    flops: dict[str, float] = {}
    for c in state.chunks:
        for cls, f in per_stage[c.stage].items():
            model += f * tokens
            if cls == "attention" and device_type == "cuda":
                ratio, shares = 1.0, {dtype: 1.0}
            else:
                ratio, shares = mix.ratio(cls), mix.shares(cls) or {dtype: 1.0}
            for dt, share in shares.items():
                key = f"{cls}/{dt}"
                flops[key] = flops.get(key, 0.0) + f * tokens * ratio * share * redo
    micro = dims.microbatches(cfg)
    plain = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, activation_checkpointing="none")
    )
    sh = act.shapes(cfg, dims, compute, device_type)
    saved = sum(act.chunk_bytes(plain, sh, c) for c in state.chunks)
    traffic = {
        "activations": mix.traffic_per_saved_byte * saved * micro * redo,
        "weights": mix.per_param("weights") * state.param_elements * micro,
        "optimizer": mix.per_state_byte("optimizer") * state.optim,
    }
    return model, flops, traffic


def rank_times(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    axes: list[Axis],
    hw: GPU,
    mix: StepMix,
    overlap: dict[str, float] | None = None,
    device_type: str = "cuda",
) -> Estimate:
    """A rank's compute and communication per step, without the pipeline's idle time
    (``step_s`` and ``mfu`` as if the schedule had no bubble: ``with_pipeline`` adds it)."""
    from moetrain.model.precision import Precision

    ov = {**OVERLAP, **(overlap or {})}
    compute = Precision.choose(cfg.train.dtype, device_type).dtype
    model_flops, flops, moved = rank_work(cfg, dims, state, mix, device_type)
    table = rates(hw, moe_shape(cfg, dims), cfg.moe.kernels)
    parts = dict.fromkeys(PARTS, 0.0)
    used: dict[str, Rate] = {}
    for key, f in flops.items():
        cls, dtype = key.split("/")
        r = used[key] = rate_of(table, cls, dtype)
        parts[_PART[cls]] += f / (r.value * 1e12)
    used["copy"] = table["copy"]
    copy_bps = table["copy"].value * 1e9
    parts["elementwise and copies"] = (moved["activations"] + moved["weights"]) / copy_bps
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
        if a.name == "ep" and cfg.moe.num_shared_experts:  # the shared experts run during
            hidden = max(hidden, 0.5)  # the dispatch's trip (overlap_shared_experts) or the
            # combine's (MoELayer.end): one of the two, forward and backward
        if a.name == "ep" and cfg.parallel.ep_overlap == "halves" and t > 0:
            micro = dims.microbatches(cfg)
            blocks = sum(len(c.layers) for c in state.chunks) * micro
            moe_blocks = sum(1 for c in state.chunks for layer in c.layers if layer.moe) * micro
            phases = half_phases(cfg, dims, parts, blocks, moe_blocks, copy_bps,
                                 compute.itemsize)  # fmt: skip
            left = moe_blocks * halves_exposed(t / (8 * moe_blocks), phases)
            hidden = max(hidden, 1 - left / t)
        exposed[a.name] = t * (1 - hidden)
    optimizer_s = moved["optimizer"] / copy_bps
    if state.muon_flops:  # Muon's Newton-Schulz: matmuls at the dense rate of its dtype
        ns_dtype = "bfloat16" if cfg.optim.muon_ns_dtype == "bf16" else "float32"
        r = used[f"muon/{ns_dtype}"] = rate_of(table, "matmul", ns_dtype)
        optimizer_s += state.muon_flops / (r.value * 1e12)
    e = Estimate(
        gpu=hw.name,
        step_s=0.0,
        compute_s=sum(parts.values()),
        model_flops=model_flops,
        mfu=0.0,
        bubble=0.0,
        optimizer_s=optimizer_s,
        comm_s=comm,
        exposed_s=exposed,
        parts=parts,
        flops=flops,
        bytes=moved,
        rates=used,
    )
    return with_pipeline(e, e.busy_s, hw)


@dataclass(frozen=True)
class HalfPhases:
    """The forward seconds of one half of a micro-batch in a block with an MoE layer under
    ``parallel.ep_overlap=halves`` (``TransformerBlock._forward_halves``), between the
    points where its transfers are issued and awaited: ``attention`` up to its rows leaving
    (norms, attention, router, permute), ``experts`` from the rows' arrival to the outputs
    leaving, ``combine`` from the outputs' arrival to the block's end (the weighted sum of
    the K rows per token and the residual)."""

    attention: float
    experts: float
    combine: float

    def schedule(self) -> tuple[tuple[str, float, str | None, str | None], ...]:
        """The block's phases in the order they run, each (name, seconds, the transfer it
        waits for first, the transfer it issues last). Forward: each half's attention
        issues its rows; each half's experts wait for its rows and issue its outputs; each
        combine waits for them. Backward runs the autograd nodes in reverse: the combines
        issue the outputs' gradients, the experts wait for them and issue the rows', the
        attentions wait for those. A matmul phase's backward takes twice its forward; a
        combine's backward moves the same rows again (once)."""
        a, x, c = self.attention, self.experts, self.combine
        return (
            ("attention 0", a, None, "rows 0"), ("attention 1", a, None, "rows 1"),
            ("experts 0", x, "rows 0", "outputs 0"), ("experts 1", x, "rows 1", "outputs 1"),
            ("combine 0", c, "outputs 0", None), ("combine 1", c, "outputs 1", None),
            ("combine 1'", c, None, "outputs 1'"), ("combine 0'", c, None, "outputs 0'"),
            ("experts 1'", 2 * x, "outputs 1'", "rows 1'"),
            ("experts 0'", 2 * x, "outputs 0'", "rows 0'"),
            ("attention 1'", 2 * a, "rows 1'", None), ("attention 0'", 2 * a, "rows 0'", None),
        )  # fmt: skip


def halves_exposed(transfer_s: float, phases: HalfPhases) -> float:
    """Seconds of expert all-to-all left exposed per block and micro-batch under
    ``parallel.ep_overlap=halves``: ``HalfPhases.schedule`` run on a timeline, each of its
    8 transfers arriving ``transfer_s`` after its issue and each phase starting when the
    previous one ended and its transfer arrived; what is left is the timeline's length
    less the phases' own. A wait that is exposed also delays the phases after it, which
    gives the transfers already in flight that much longer. Without the schedule the
    block's 4 transfers (twice the bytes each) are all exposed."""
    t = busy = 0.0
    arrival: dict[str, float] = {}
    for _, seconds, waits, issues in phases.schedule():
        if waits is not None:
            t = max(t, arrival[waits])
        t += seconds
        busy += seconds
        if issues is not None:
            arrival[issues] = t + transfer_s
    return t - busy


def half_phases(cfg: JobConfig, dims: ParallelDims, parts: dict[str, float], blocks: int,
                moe_blocks: int, copy_bps: float, element_bytes: int) -> HalfPhases:
    """The plan's ``HalfPhases`` from its compute parts: a block's forward is a third of
    its share of the compute (``blocks`` per step), a half's is half that; its experts
    phase is that share of the expert GEMMs (``moe_blocks`` per step); its combine reads K
    rows and the residual and writes one row per token at the copy bandwidth; its attention
    phase is the rest."""
    half_fwd = sum(parts.values()) / max(blocks, 1) / 6
    experts = parts["expert GEMMs"] / max(moe_blocks, 1) / 6
    shape = moe_shape(cfg, dims)
    tokens = shape.tokens // 2 if shape is not None else 0
    combine = tokens * cfg.model.dim * (cfg.moe.top_k + 2) * element_bytes / copy_bps
    return HalfPhases(max(half_fwd - experts - combine, 0.0), experts, combine)


def moe_shape(cfg: JobConfig, dims: ParallelDims) -> Any:
    """The shape an MoE layer of this layout sees (``moetrain.kernels.selection.MoEShape``:
    what the measured rates are looked up by), None without experts."""
    from moetrain.kernels.selection import MoEShape

    m = cfg.moe
    if not m.num_experts:
        return None
    tokens = dims.micro_batch_size(cfg) * cfg.data.seq_len // dims.cp
    return MoEShape(tokens, cfg.model.dim, m.expert_ffn_dim, m.num_experts, m.top_k,
                    m.score_func)  # fmt: skip


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
    mix: StepMix,
    overlap: dict[str, float] | None = None,
    device_type: str = "cuda",
) -> Estimate:
    """One rank's estimate, planned alone: the other stages' times are their FLOPs at this
    rank's pace (its compute and exposed communication per FLOP)."""
    e = rank_times(cfg, dims, state, axes, hw, mix, overlap, device_type)
    if dims.pp == 1:
        return e
    flops = stage_flops_per_token(cfg, dims)
    mine = sum(flops[c.stage] for c in state.chunks)
    if mine == 0:  # no computing stage of its own: the others at the dense matmul's rate
        table = rates(hw, moe_shape(cfg, dims), cfg.moe.kernels)
        pace = (1 + _recompute(cfg)) / (table["matmul/bfloat16"].value * 1e12)
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
    mix: StepMix,
    overlap: dict[str, float] | None = None,
    device_type: str = "cuda",
) -> list[Estimate]:
    """The estimates of planned ranks. When they include every pipeline rank, each stage's
    time is its own rank's (compute and exposed communication, shared among the rank's
    stages by FLOPs) and one simulation of the schedule gives every rank the same makespan;
    otherwise each rank is estimated alone (``estimate``)."""
    if dims.pp == 1 or {s.coords["pp"] for s, _ in ranks} != set(range(dims.pp)):
        return [estimate(cfg, dims, s, a, hw, mix, overlap, device_type) for s, a in ranks]
    out = [rank_times(cfg, dims, s, a, hw, mix, overlap, device_type) for s, a in ranks]
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
