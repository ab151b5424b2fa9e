"""A step-time and MFU estimate for a planned rank on a named GPU (an estimate: every input is
stated, docs/plan.md).

    compute   this rank's training FLOPs / (bf16 peak x matmul_efficiency): 6 x the active
              parameters of its layers (its tp share; routed experts at K / E of theirs, tp x
              theirs when parallel.expert_tp is off) + causal attention, per token it
              processes, + the recomputed forward under activation checkpointing
    comm      per axis, bytes / (link bandwidth x comm_efficiency), NVLink within a node, the
              network across; the part not hidden behind computation (``OVERLAP``)
    bubble    the pipeline schedule's idle fraction from its action list
              (``moetrain.parallel.pipeline.simulate_schedule``), over compute and the
              per-micro-batch communication
    optimizer reading and writing the model state once in HBM

    step = (compute + exposed tp, cp, ep, pp) x (1 + bubble) + exposed dp + optimizer
    MFU  = model FLOPs (no recomputation) / (step x bf16 peak)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config import JobConfig
from moetrain.model.transformer import is_moe_layer
from moetrain.parallel.dims import ParallelDims
from moetrain.plan.build import RankState
from moetrain.plan.hardware import GPU, OVERLAP
from moetrain.plan.traffic import Axis


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


def estimate(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    axes: list[Axis],
    hw: GPU,
    overlap: dict[str, float] | None = None,
) -> Estimate:
    from moetrain.parallel.pipeline import schedule_actions, simulate_schedule

    ov = {**OVERLAP, **(overlap or {})}
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / (dims.dp * dims.cp)
    layers = [layer.index for c in state.chunks for layer in c.layers]
    per_token = sum(layer_flops_per_token(cfg, i, dims.tp) for i in layers)
    if any(c.output for c in state.chunks):
        per_token += 6 * cfg.model.dim * (cfg.model.vocab_size or 0) / dims.tp
    model_flops = per_token * tokens
    ac = cfg.parallel.activation_checkpointing
    recompute = {"none": 0.0, "selective": 1 / 12, "full": 1 / 3}[ac]
    peak = hw.bf16_tflops * 1e12
    compute_s = model_flops * (1 + recompute) / (peak * hw.matmul_efficiency)
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
    bubble = 0.0
    if dims.pp > 1:
        p = cfg.parallel
        order = schedule_actions(
            p.pp_schedule, dims.pp, dims.virtual_stages, dims.breadth_first(cfg)
        )
        bubble = simulate_schedule(order, dims.num_stages)["bubble"]
    per_mb = compute_s + sum(v for k, v in exposed.items() if k not in ("dp", "edp"))
    opt_s = 2 * state.model_state / (hw.hbm_tbs * 1e12)
    step = per_mb * (1 + bubble) + exposed.get("dp", 0.0) + exposed.get("edp", 0.0) + opt_s
    return Estimate(
        gpu=hw.name,
        step_s=step,
        compute_s=compute_s,
        model_flops=model_flops,
        mfu=model_flops / (step * peak),
        bubble=bubble,
        optimizer_s=opt_s,
        comm_s=comm,
        exposed_s=exposed,
    )
