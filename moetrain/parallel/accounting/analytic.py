"""The analytic model of memory, communication and expert FLOPs that the measurements are
checked against (tests/parallel/test_accounting.py, docs/accounting.md) and that
``moetrain plan`` prices layouts with (derived in ``docs/parallel.md``).

Model state: with fp32 training a parameter costs 4 (weights, their own master copy) + 4
(gradient) + 8 (Adam m, v) = 16 bytes, the same 16 as mixed precision's 2 + 2 + 12, split
replicated/sharded the same way:

    zero 0: 16      zero 1: 8 + 8/N      zero 2: 4 + 12/N      zero 3: 16/N

(mixed precision: 16, 4 + 12/N, 2 + 14/N, 16/N), N = dp_shard, per parameter this rank holds
before data-parallel sharding (its tensor-parallel shard and pipeline stage). The optimizer's
8 bytes are read from its real state's dtypes (``memory.optimizer_state_bytes_per_param``):
bf16 moments (``optim.moments_dtype``) make them 4, and DDP's 16 bytes 12.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetrain.config import JobConfig, ModelConfig
    from moetrain.parallel.dims import ParallelDims


def zero_bytes_per_param(
    zero_stage: int, n: int, mixed_precision: bool = False, optim_bytes: float = 8.0
) -> float:
    """Model-state bytes per parameter of the ZeRO formula (docs/parallel.md), N = shard
    degree, ``optim_bytes`` of optimizer state per parameter (Adam's fp32 moments: 8; bf16:
    4; ``optimizer_state_bytes_per_param`` reads it from the real state). fp32 training:
    weights 4 + gradients 4 + O; mixed precision: bf16 weights 2 + gradients 2 + fp32 master
    weights 4 + O (the ZeRO paper's 2 + 2 + 12 at O = 8)."""
    o = optim_bytes
    if mixed_precision:
        return {0: 8 + o, 1: 4 + (4 + o) / n, 2: 2 + (6 + o) / n, 3: (8 + o) / n}[zero_stage]
    return {0: 8 + o, 1: 8 + o / n, 2: 4 + (4 + o) / n, 3: (8 + o) / n}[zero_stage]



def full_sequence_kv_bytes(
    model_cfg: ModelConfig,
    dims: ParallelDims,
    micro_batch_size: int,
    seq_len: int,
    n_attention: int,
    checkpointing: str = "none",
    bytes_per_elem: int = 4,
) -> int:
    """Bytes of the keys and values of whole sequences that the attention of ``n_attention``
    layers keeps for backward on one rank (per micro-batch in flight): what context
    parallelism does not divide by cp (each rank attends its queries over the whole
    sequence's K and V, kept at full length with every query head's copy, as SDPA sees
    them), plus its (s x S) boolean causal mask. 0 when activation checkpointing recomputes
    the attention (``checkpointing`` selective or full): only its input is kept."""
    if checkpointing != "none":
        return 0
    h_local = model_cfg.n_heads // dims.tp
    if model_cfg.attention == "mla":
        dk = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim
        dv = model_cfg.v_head_dim
    else:
        dk = dv = model_cfg.attn_head_dim
    kv = micro_batch_size * seq_len * h_local * (dk + dv) * bytes_per_elem
    mask = (seq_len // dims.cp) * seq_len if dims.cp > 1 else 0
    return n_attention * (kv + mask)


def analytic_cp_activations(
    one_rank_cp1: float, kv_bytes_cp1: float, cp: int, kv_bytes_cp: float
) -> float:
    """Activation bytes per rank under context parallelism: everything but the whole
    sequence's keys and values scales with the tokens a rank holds (1/cp of every
    sequence), those stay whole: (A_1 - KV_1)/cp + KV_cp, with A_1 measured at cp = 1 on the
    same micro-batch and KV from ``full_sequence_kv_bytes``."""
    return (one_rank_cp1 - kv_bytes_cp1) / cp + kv_bytes_cp




def analytic_sent(
    cfg: JobConfig,
    dims: ParallelDims,
    params_per_rank: int,
    n_stage_layers: dict[str, int],
    bytes_per_elem: int = 4,
) -> dict[str, float]:
    """Analytic bytes one rank sends in one step, by axis (docs/parallel.md), for one micro-batch
    per data-parallel rank where FSDP is used (FSDP gathers and reduces per micro-batch).

    dp:  zero 0 all-reduce 2 Psi (d-1)/d; zero 1 and 2: reduce-scatter + all-gather
         2 Psi (n-1)/n; zero 3: 3 Psi (n-1)/n (+ the hybrid all-reduce of the 1/n shard).
    tp:  per micro-batch (b s h (t-1)/t) x (8 per dense layer, 6 per MoE layer with SP / 4
         without, + 2 each for the vocabulary-parallel embedding and output; with expert TP
         each MoE layer adds 4 + 2 K / h for its routed experts and 4 for shared experts).
    pp:  b s h (/t with SP) per micro-batch and stage boundary between ranks, forward and
         backward (summed over the pp ranks: 2 m (stages - 1) b s h; 2 m (stages - 2) b s h
         for the V placement, whose turn at the last rank stays on the rank).
    cp:  per micro-batch and attention layer the whole sequence's K and V, (cp-1)/cp of them
         all-gathered forward and reduce-scattered backward, plus the routing decisions of
         every MoE layer (``context_parallel.analytic_cp_bytes``). With cp, s above is the
         seq_len / cp positions a rank holds, and dp reduces over dp x cp ranks.
    """
    psi = params_per_rank * bytes_per_elem
    # Gradients are averaged over dp x cp; ZeRO shards over dp_shard x cp.
    n, r, d = dims.dp_shard * dims.cp, dims.dp_replicate, dims.dp * dims.cp
    zero = cfg.parallel.zero_stage if d > 1 else 0
    out: dict[str, float] = {}
    if d > 1:
        if zero == 0:
            out["dp"] = 2 * psi * (d - 1) / d
        else:
            out["dp"] = (3 if zero == 3 else 2) * psi * (n - 1) / n
            out["dp"] += 2 * (psi / n) * (r - 1) / r
    m = dims.microbatches(cfg)
    # A cp rank holds seq_len / cp positions of every sequence: tp and pp move 1/cp of it.
    b, s, h, t = dims.micro_batch_size(cfg), cfg.data.seq_len // dims.cp, cfg.model.dim, dims.tp
    bsh = b * s * h * bytes_per_elem
    if t > 1:
        moe_factor = 6 if cfg.parallel.sequence_parallel else 4
        if cfg.parallel.expert_tp and cfg.moe.num_experts:
            # Expert TP (ExpertTPDispatcher): the combined output all-reduced in forward, the
            # input's and the combine weights' (T x K) gradients in backward; the shared
            # experts column/row-wise: their output in forward, their input gradient back.
            moe_factor += 4 + 2 * cfg.moe.top_k / cfg.model.dim
            if cfg.moe.num_shared_experts:
                moe_factor += 4
        per_mb = (
            8 * n_stage_layers.get("dense", 0)
            + moe_factor * n_stage_layers.get("moe", 0)
            + 2 * n_stage_layers.get("boundary", 0)
        )
        out["tp"] = m * per_mb * bsh * (t - 1) / t
    if dims.pp > 1:
        act = bsh / (t if cfg.parallel.sequence_parallel else 1)
        # The V placement (zbv, dualpipev) holds stages pp - 1 and pp on one rank: that
        # boundary is crossed without a send.
        local = 1 if cfg.parallel.pp_schedule in ("zbv", "dualpipev") else 0
        out["pp_all_ranks"] = 2 * m * (dims.num_stages - 1 - local) * act
    if dims.cp > 1:
        from moetrain.parallel.context_parallel import analytic_cp_bytes

        mc, moe = cfg.model, cfg.moe
        if mc.attention == "mla":
            kv = (mc.qk_nope_head_dim + mc.qk_rope_head_dim + mc.v_head_dim) * mc.n_heads
        else:
            kv = 2 * mc.attn_head_dim * mc.kv_heads
        scores = moe.capacity_factor is not None and moe.drop_policy == "probs"
        ac = cfg.parallel.activation_checkpointing
        n_attn = n_stage_layers.get("dense", 0) + n_stage_layers.get("moe", 0)
        n_moe = n_stage_layers.get("moe", 0)
        out["cp"] = analytic_cp_bytes(
            dims.micro_batch_size(cfg),
            cfg.data.seq_len,
            dims.cp,
            kv // dims.tp,
            moe.top_k * (8 + (4 if scores else 0)),
            n_attn,
            n_moe,
            m,
            recomputed_attention=n_attn if ac != "none" else 0,
            recomputed_moe=n_moe if ac == "full" else 0,
            bytes_per_elem=bytes_per_elem,
        )
    return out


def analytic_expert_flops(cfg: JobConfig, dims: ParallelDims, n_moe_layers: int) -> float:
    """Forward FLOPs of routed experts per rank in one step if every token's top-k
    assignments are computed (no drops) and spread evenly: 6 D F per assignment, over the
    global batch's T K assignments per MoE layer, divided among the dp x cp ranks (each computes
    its share of the tokens' experts, under expert parallelism for its EP peers) and the tp
    ranks when ``parallel.expert_tp`` splits every expert's FFN width. With experts
    replicated over tp each tp rank computes all of its dp rank's: tp x this figure.
    ``n_moe_layers``: the MoE layers this rank's pipeline stages hold."""
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    per_assignment = 6 * cfg.model.dim * cfg.moe.expert_ffn_dim
    split = dims.dp * dims.cp * (dims.tp if cfg.parallel.expert_tp else 1)
    return per_assignment * tokens * cfg.moe.top_k * n_moe_layers / split
