"""Activation memory of a planned rank: the tensors autograd keeps for backward, per
micro-batch and chunk, and the pipeline schedule's peak of micro-batches in flight.

What a block keeps is read off moetrain's own code (every figure below names the tensor),
for the tokens a rank holds (T = micro-batch x seq_len / cp; norms under sequence
parallelism 1/tp of them), its local heads and expert widths, with routing perfectly
balanced (``moe.force_load_balancing``: every expert receives T K / E rows per micro-batch,
under expert parallelism every rank T K). ``e`` is the bytes of a compute element (4 fp32,
2 bf16), ``r`` of the residual stream (fp32 in every layout: the compute-dtype policy of
``moetrain.model.precision`` looks the embeddings up in fp32). Per block:

    norm (x2)        its input in fp32 (4 T D), 1/rms (4 T), its output (r T D)
    GQA attention    input (e T D), q, k, v (k and v repeated to the query heads), output
                     (e T h Dh each, k and v over the whole sequence L under cp), logsumexp
                     (4 b h s); + q/k norms, clamping; the score matrix (e b h s L) where
                     SDPA runs its math path (on a CPU when q/k and v widths differ)
    MLA              the latent and query-bottleneck norms and projections, q and k
                     (e T h (nope + rope)), v, output, logsumexp
    dense FFN        input (e T D), 4 e T F/tp (w1 and w3 outputs, silu, their product)
    MoE              input (e T D; fp32 4 T D for the router), router logits and scores
                     (8 T E), ids and weights (T K: 8 + 4 + 4 + 8 for the permute's
                     destinations), rows in and out of the experts (2 e N D, N = T K),
                     4 e N F_e, shared experts 4 e T F_s
    once per forward the token ids (8 b s), the final norm, the output's input (e T D),
                     log-softmax of the logits (4 T V/tp); cos/sin of RoPE (their buffer,
                     or the rank's rows under cp)

Activation checkpointing keeps a block's input only (full) or the attention's input in place
of the attention's tensors (selective); the recomputation in backward holds one block's
tensors at a time (``recompute``, not counted in ``per_microbatch``: what
``SavedActivations`` measures is what autograd keeps, as here).

Checked against ``moetrain.parallel.accounting.SavedActivations`` on real runs, fp32 on CPU
(tests/plan/test_exact.py) within the accounting's tolerance; bf16 and the GPU's kernels
(Triton's grouped GEMM, fused router) keep about the same tensors: an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.config import JobConfig
from moetrain.parallel.dims import ParallelDims
from moetrain.plan.build import Chunk, Layer


@dataclass(frozen=True)
class Shapes:
    """The sizes one rank's blocks see per micro-batch."""

    b: int  # sequences per micro-batch
    s: int  # positions a rank holds (seq_len / cp)
    L: int  # positions keys and values span (the whole sequence)
    T: int  # tokens per micro-batch on this rank: b s
    T_norm: int  # tokens the norms hold (T / tp under sequence parallelism)
    tp: int
    ep: int
    e: int  # bytes of a compute element
    r: int  # bytes of a residual-stream element
    fused_attention: bool  # SDPA keeps logsumexp, not the score matrix
    explicit_mask: bool  # a boolean mask per layer (documents, windows, cp)


def shapes(cfg: JobConfig, dims: ParallelDims, dtype: torch.dtype, device_type: str) -> Shapes:
    b, S, cp, tp = dims.micro_batch_size(cfg), cfg.data.seq_len, dims.cp, dims.tp
    s = S // cp
    e = torch.tensor([], dtype=dtype).element_size()
    m = cfg.model
    if m.attention == "mla":
        same_width = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0) == m.v_head_dim
    else:
        same_width = True
    return Shapes(
        b=b,
        s=s,
        L=S,
        T=b * s,
        T_norm=b * s // tp if cfg.parallel.sequence_parallel else b * s,
        tp=tp,
        ep=dims.ep,
        e=e,
        r=4,
        fused_attention=device_type == "cuda" or same_width,
        explicit_mask=cp > 1 or m.document_mask or m.sliding_window is not None,
    )


def _norm(n: int, width: int, r: int) -> int:
    """RMSNorm (moetrain.model.norm): x in fp32, 1/rms, the normalised output."""
    return 4 * n * width + 4 * n + r * n * width


def attention_bytes(cfg: JobConfig, sh: Shapes, layer: int) -> int:
    """The attention of one block, per micro-batch (its input counted here)."""
    m = cfg.model
    T, e, b, s, tp = sh.T, sh.e, sh.b, sh.s, sh.tp
    h = m.n_heads // tp
    out = e * T * m.dim  # the (gathered, under SP) input of the projections
    if m.attention == "mla":
        dk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        dv = m.v_head_dim or 0
        if m.q_lora_rank:
            out += _norm(T, m.q_lora_rank, sh.e) + e * T * m.q_lora_rank
        out += _norm(T, m.kv_lora_rank or 0, sh.e) + e * T * (m.kv_lora_rank or 0)
        kv_rep = h  # MLA's keys and values have every head
    else:
        dk = dv = m.attn_head_dim
        hkv = m.kv_heads // tp
        kv_rep = h
        if m.qk_norm == "head":
            out += _norm(T * h, dk, e) + _norm(T * hkv, dk, e)
        elif m.qk_norm == "full":
            out += _norm(T, h * dk, e) + _norm(T, hkv * dk, e)
        if m.clip_qkv is not None:
            out += e * T * (h + 2 * hkv) * dk
    out += e * T * h * dk  # q
    out += e * b * sh.L * kv_rep * (dk + dv) if sh.L != s else e * T * kv_rep * (dk + dv)
    if sh.fused_attention:
        out += e * T * h * dv + 4 * b * h * s  # output (also wo's input), logsumexp
    else:
        out += e * b * h * s * sh.L + e * T * h * dv  # scores, wo's input (a copy)
    if sh.explicit_mask and cfg.model.attention_backend == "sdpa":
        out += b * s * sh.L if sh.L != s or cfg.model.document_mask else s * sh.L
    return out


def ffn_bytes(cfg: JobConfig, sh: Shapes, moe: bool) -> int:
    """The FFN of one block (dense SwiGLU or MoE layer), per micro-batch, its input included."""
    m, mo = cfg.model, cfg.moe
    T, e, tp = sh.T, sh.e, sh.tp
    if not moe:
        return e * T * m.dim + 4 * e * T * (m.ffn_dim // tp)
    D, E, K = m.dim, mo.num_experts, mo.top_k
    out = max(e, 4) * T * D  # the input; the router reads it in fp32
    out += 8 * T * E + 4 * T  # logits, scores, logsumexp
    out += 8 * T * K + 4 * T + 4 * T * K + 4 * T * K  # ids, the weights' sum, scores, weights
    if mo.renormalize is False:
        out -= 4 * T + 4 * T * K
    out += 8 * T * K  # the permute's destinations
    out += rows(cfg, sh) * expert_row_bytes(cfg, sh)
    if mo.num_shared_experts:
        width = mo.shared_expert_ffn_dim or mo.num_shared_experts * mo.expert_ffn_dim
        out += 4 * e * T * (width // tp if cfg.parallel.expert_tp else width)
    return out


def rows(cfg: JobConfig, sh: Shapes) -> int:
    """Rows of one rank's expert buffer per micro-batch under balanced routing: every
    token's K assignments (under expert parallelism each rank receives as many as it sends),
    fewer when capacity is below 1, an expert's capacity each when padded to it. Under
    expert parallelism with a capacity factor every expert's segment travels in as many rows
    as it can hold -- its capacity in every token group, at most a row a token -- whatever
    was kept (static split sizes: ``AllToAllDispatcher``), and is received so; dropless with
    ``parallel.ep_dropless_transport=slots``, one slot per token."""
    mo, p = cfg.moe, cfg.parallel
    N = sh.T * mo.top_k
    a2a = sh.ep > 1 and p.ep_dispatcher == "all_to_all"
    if mo.capacity_factor is None:
        # parallel.ep_dropless_transport=slots: one slot per token for every expert
        return mo.num_experts * sh.T if a2a and p.ep_dropless_transport == "slots" else N
    groups = max(sh.b // (mo.token_group_seqs or sh.b), 1)
    per_group = sh.T // groups
    cap = int(-(-mo.capacity_factor * per_group * mo.top_k // mo.num_experts))
    if mo.pad_to_capacity:
        return groups * mo.num_experts * cap
    if a2a:
        return mo.num_experts * min(groups * cap, sh.T)
    if mo.capacity_factor < 1:
        return groups * mo.num_experts * min(cap, per_group * mo.top_k // mo.num_experts)
    return N


def expert_row_bytes(cfg: JobConfig, sh: Shapes) -> int:
    """Bytes one row of the experts' buffer leaves per MoE layer and micro-batch: the row in
    and out and the experts' SwiGLU (its FFN width split over tp under expert TP)."""
    mo = cfg.moe
    F_e = mo.expert_ffn_dim // sh.tp if cfg.parallel.expert_tp else mo.expert_ffn_dim
    return 2 * sh.e * cfg.model.dim + 4 * sh.e * F_e


def dropless_worst_rows(cfg: JobConfig, sh: Shapes) -> int:
    """Rows one rank's experts receive in one MoE layer and micro-batch when every token of
    its expert-parallel group picks them: each of the ep ranks sends each of its T tokens
    min(K, E / ep) times (a token picks K distinct experts, at most all of this rank's).
    Dropless all-to-all sizes its receive buffer by the routing, so this is what an
    unlucky step can ask for; balanced routing asks ``rows``. 0 when nothing bounds it
    less (a capacity factor, one rank, the all-gather dispatcher's or the slots transport's
    static buffers)."""
    mo, p = cfg.moe, cfg.parallel
    if mo.capacity_factor is not None or sh.ep == 1 or p.ep_dispatcher != "all_to_all":
        return 0
    if p.ep_dropless_transport == "slots":
        return 0
    return sh.ep * sh.T * min(mo.top_k, mo.num_experts // sh.ep)


def block_bytes(cfg: JobConfig, sh: Shapes, layer: Layer) -> int:
    """One block's activations per micro-batch without checkpointing."""
    D = cfg.model.dim
    return (
        2 * _norm(sh.T_norm, D, sh.r)
        + attention_bytes(cfg, sh, layer.index)
        + ffn_bytes(cfg, sh, layer.moe)
    )


def _checkpointed(cfg: JobConfig, sh: Shapes, layer: Layer) -> int:
    """What a block keeps under ``parallel.activation_checkpointing``."""
    mode = cfg.parallel.activation_checkpointing
    D = cfg.model.dim
    if mode == "full":
        return sh.r * sh.T_norm * D  # the block's input
    if mode == "selective":  # the attention's input in place of its tensors
        return 2 * _norm(sh.T_norm, D, sh.r) + sh.r * sh.T_norm * D + ffn_bytes(cfg, sh, layer.moe)
    return block_bytes(cfg, sh, layer)


def rope_bytes(cfg: JobConfig, sh: Shapes) -> int:
    """cos and sin: their whole buffer (every layer's rows are views of it), or under cp the
    rows of this rank's positions, per micro-batch."""
    m = cfg.model
    half = (m.qk_rope_head_dim if m.attention == "mla" else m.rope_dim) // 2
    return 2 * 4 * half * (sh.s if sh.L != sh.s else m.max_seq_len)


def chunk_bytes(cfg: JobConfig, sh: Shapes, chunk: Chunk) -> int:
    """A chunk's activations per micro-batch, as autograd keeps them (checkpointing as
    configured), rope tables left out (``rope_bytes``: shared across micro-batches unless
    cp)."""
    V = cfg.model.vocab_size or 0
    out = sum(_checkpointed(cfg, sh, layer) for layer in chunk.layers)
    if chunk.embedding:
        out += 8 * sh.T
    if chunk.output:
        D = cfg.model.dim
        out += _norm(sh.T_norm, D, sh.r) + sh.e * sh.T * D + 4 * sh.T * (V // sh.tp) + 8 * sh.T
    return out


def input_only_bytes(cfg: JobConfig, sh: Shapes, chunk: Chunk) -> int:
    """The part of a chunk's activations (per micro-batch) that only the input gradient reads:
    the attention core's tensors, the norms' fp32 input and 1/rms, the router's logits and
    scores, the permute's destinations, the loss's log-softmax. Under the zero-bubble
    schedules torch's input-gradient action keeps the graph for the weight-gradient action
    (``retain_graph``) and the weight-gradient action frees only its own part: these stay
    until the step ends (measured, torch 2.13). 0 under activation checkpointing, whose
    blocks keep their input only, and for the first stage, which has no input gradient (its
    weight-gradient action is its whole backward)."""
    if cfg.parallel.activation_checkpointing != "none" or chunk.embedding:
        return 0
    m, mo = cfg.model, cfg.moe
    out = 0
    T, e, K = sh.T, sh.e, mo.top_k
    for layer in chunk.layers:
        out += 2 * (4 * sh.T_norm * m.dim + 4 * sh.T_norm)  # the norms' x and 1/rms
        out += attention_bytes(cfg, sh, layer.index) - e * T * m.dim  # not its input
        if layer.moe:
            out += 8 * T * mo.num_experts + 4 * T + 8 * T * K
            if chunk.output:
                # On the last stage (its input gradient starts from the loss) the weight-
                # gradient action leaves the experts' SwiGLU products, their returned rows and
                # the combine weights too (measured, torch 2.13).
                N = rows(cfg, sh)
                F_e = mo.expert_ffn_dim // (sh.tp if cfg.parallel.expert_tp else 1)
                out += 3 * e * N * F_e + e * N * m.dim + 8 * T * K + 4 * T
                if mo.num_shared_experts:
                    width = mo.shared_expert_ffn_dim or mo.num_shared_experts * mo.expert_ffn_dim
                    out += 3 * e * T * (width // (sh.tp if cfg.parallel.expert_tp else 1))
    if chunk.output:
        V = cfg.model.vocab_size or 0
        out += 4 * sh.T_norm * m.dim + 4 * sh.T_norm + 4 * sh.T * (V // sh.tp)
    return out


def recompute_bytes(cfg: JobConfig, sh: Shapes, chunks: list[Chunk]) -> int:
    """The largest block's tensors, held while activation checkpointing recomputes it in
    backward (0 without checkpointing)."""
    mode = cfg.parallel.activation_checkpointing
    if mode == "none":
        return 0
    layers = [layer for c in chunks for layer in c.layers]
    if mode == "full":
        return max((block_bytes(cfg, sh, layer) for layer in layers), default=0)
    return max((attention_bytes(cfg, sh, layer.index) for layer in layers), default=0)


def peak_in_flight(
    cfg: JobConfig,
    dims: ParallelDims,
    pp_rank: int,
    stage_ids: list[int],
    per_mb: list[int],
    input_only: list[int] | None = None,
) -> tuple[int, list[int]]:
    """The most activation bytes this rank holds at once, and each chunk's micro-batches in
    flight at that moment, from the pipeline schedule's action list (torch's
    ``pipeline_order`` for this pp rank): a forward adds one micro-batch's tensors of its
    chunk (``per_mb``); a full backward removes them; under a schedule that splits the
    backward (input gradient, then weight gradient: zero_bubble, zbv, dualpipev) the
    weight-gradient action removes all but ``input_only``, which stays to the end of the
    step. Without a pipeline, the breadth-first micro-batches of one pass."""
    if dims.pp == 1:
        n = dims.breadth_first(cfg)
        return n * per_mb[0], [n]
    from moetrain.parallel.pipeline import schedule_actions

    p = cfg.parallel
    order = schedule_actions(p.pp_schedule, dims.pp, dims.virtual_stages, dims.breadth_first(cfg))
    actions = _flat(order[pp_rank])
    split = any(a.computation_type.value == "I" for a in actions)
    weight = dict(zip(stage_ids, per_mb, strict=True))
    kept = dict(zip(stage_ids, input_only or [0] * len(stage_ids), strict=True))
    counts = dict.fromkeys(stage_ids, 0)
    best, best_counts, live = 0, dict(counts), 0
    for a in actions:
        kind, stage = a.computation_type.value, a.stage_index
        if stage not in counts:
            continue
        if kind == "F":
            counts[stage] += 1
            live += weight[stage]
        elif kind == "B" or (kind == "W" and not split):
            counts[stage] -= 1
            live -= weight[stage]
        elif kind == "W":
            counts[stage] -= 1
            live -= weight[stage] - kept[stage]
        if live > best:
            best, best_counts = live, dict(counts)
    return best, [best_counts[s] for s in stage_ids]


def _flat(actions: list) -> list:
    out = []
    for a in actions:
        if a is None:
            continue
        out.extend(a.sub_actions if getattr(a, "sub_actions", None) else [a])
    return out
