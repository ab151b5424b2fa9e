"""The model formula's training FLOPs per token, by layer, class and pipeline stage: what
MFU counts, and what the plan scales by the census of the code's step
(``moetrain.plan.stepmix``, ``moetrain.plan.estimate``)."""

from __future__ import annotations

from moetrain.config import JobConfig
from moetrain.model.transformer import is_moe_layer
from moetrain.parallel.dims import ParallelDims

CLASSES = ("experts", "attention", "matmul")
"""The routed experts' GEMMs, attention's scores and values, every other matmul."""


def layer_flops_by_class(cfg: JobConfig, layer: int, tp: int) -> dict[str, float]:
    """Training FLOPs (forward + backward: 6 per parameter use) one token costs in ``layer``
    on one tp rank, by class: ``attention`` the scores and their product with the values
    (causal: half the sequence on average, or the window), ``experts`` the routed experts'
    GEMMs (top-k of them), ``matmul`` every other matmul (projections, dense or shared FFN,
    router)."""
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
    out = {"attention": 12 * width * pairs / tp, "matmul": 6 * attn / tp, "experts": 0.0}
    if is_moe_layer(layer, mo):
        routed = mo.top_k * 3 * D * mo.expert_ffn_dim
        shared = 3 * D * (mo.shared_expert_ffn_dim or mo.num_shared_experts * mo.expert_ffn_dim)
        split = tp if cfg.parallel.expert_tp else 1
        out["experts"] = 6 * routed / split
        out["matmul"] += 6 * shared / split + 6 * D * mo.num_experts  # + the router
    else:
        out["matmul"] += 6 * 3 * D * m.ffn_dim / tp
    return out


def layer_flops_per_token(cfg: JobConfig, layer: int, tp: int) -> float:
    """Training FLOPs one token costs in ``layer`` on one tp rank, attention scores included
    (``layer_flops_by_class`` summed)."""
    return sum(layer_flops_by_class(cfg, layer, tp).values())


def stage_flops_by_class(cfg: JobConfig, dims: ParallelDims) -> list[dict[str, float]]:
    """Training FLOPs one token costs on each pipeline stage (on one tp rank), by class
    (``layer_flops_by_class``): its layers, and on the last stage the output head and the
    multi-token-prediction modules (each a block, its input projection ``eh_proj`` and the
    head again), both other matmuls. The stages' contents are ``stage_modules``'s, the
    pipeline split's own."""
    from moetrain.parallel.pipeline import stage_modules

    m = cfg.model
    head = 6 * m.dim * (m.vocab_size or 0) / dims.tp
    eh_proj = 6 * 2 * m.dim * m.dim / dims.tp
    out = []
    for s in range(dims.num_stages):
        blocks, _, last = stage_modules(
            m.n_layers, m.mtp_depth, dims.num_stages, s, cfg.parallel.pp_stage_layers
        )
        flops = dict.fromkeys(CLASSES, 0.0)
        for i in blocks:
            for cls, f in layer_flops_by_class(cfg, i, dims.tp).items():
                flops[cls] += f
        if last:
            flops["matmul"] += head + m.mtp_depth * (head + eh_proj)
        out.append(flops)
    return out


def stage_flops_per_token(cfg: JobConfig, dims: ParallelDims) -> list[float]:
    """Training FLOPs one token costs on each pipeline stage (on one tp rank): the classes
    of ``stage_flops_by_class`` summed."""
    return [sum(f.values()) for f in stage_flops_by_class(cfg, dims)]
