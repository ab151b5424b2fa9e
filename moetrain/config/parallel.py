"""The ``parallel`` section: the layout over the torchrun world (data, ZeRO, tensor,
sequence, context, pipeline and expert parallelism, activation checkpointing). Checks that
span sections run in ``ParallelDims.validate`` (moetrain/parallel/dims.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.errors import _fail

V_SCHEDULES = ("zbv", "dualpipev")
"""Pipeline schedules with the V-shaped stage placement (two stages per rank)."""


@dataclass
class ParallelConfig:
    """Parallel layout over the ``torchrun`` world: pp x dp_replicate x dp_shard x cp x tp
    ranks.

    Rank order (``moetrain.parallel.dims``): tp varies fastest, then cp, dp_shard,
    dp_replicate, and pp slowest, so tensor-parallel groups are consecutive ranks (one node)
    and pipeline stages are the farthest apart. The data-parallel degree is what the world
    size leaves (``dp_shard: -1``), as in Fast-LLM. The cross-section checks (heads, layers,
    batch) run before any process group exists, in ``ParallelDims.validate``.
    """

    dp_replicate: int = 1
    """Data-parallel replica groups: gradients are all-reduced across them (HSDP's outer
    dimension when zero_stage >= 1)."""
    dp_shard: int = -1
    """Data-parallel ranks within a replica group, over which ZeRO shards optimizer state,
    gradients and parameters (together with the cp ranks). -1: world size / (pp *
    dp_replicate * cp * tp)."""
    cp: int = 1
    """Context-parallel degree: every sequence is split over cp ranks along the sequence,
    load-balanced for the causal mask (rank c holds chunks c and 2 cp - 1 - c of 2 cp equal
    chunks); attention all-gathers keys and values over the cp ranks, MoE layers gather the
    routing decisions so that capacity and the balancing losses stay those of whole
    sequences. Parameters are replicated over cp and their gradients averaged with dp
    (docs/parallel.md). data.seq_len must divide into 2 cp chunks."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and SwiGLU split column/row-wise, vocabulary-
    parallel embedding and loss. Must divide model.n_heads and the kv heads."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism: norms and residuals hold 1/tp of the sequence
    (needs tp > 1 and data.seq_len divisible by tp)."""
    pp: int = 1
    """Pipeline-parallel stages (physical, one per pp rank)."""
    pp_schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "looped_bfs", "zbv", "dualpipev"
    ] = "interleaved_1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (Megatron's, the default),
    zero_bubble (interleaved zero-bubble, ZB-H1-style split of the weight gradients),
    looped_bfs (breadth-first: every micro-batch through a rank's first chunk before its
    next), zbv (zero-bubble V: two chunks per rank placed in a V) or dualpipev (DeepSeek's
    DualPipe-V: the same V placement, a forward and a backward overlapped in steady state).
    zbv and dualpipev need pp_virtual_stages = 2."""
    pp_microbatches: int | None = None
    """Pipeline micro-batches per step and data-parallel rank. null: global_batch_size /
    (dp * micro_batch_size); otherwise it sets the micro-batch size to global_batch_size /
    (dp * pp_microbatches). Needs pp > 1."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules); the model splits into
    pp * pp_virtual_stages stages, of equal layer counts unless pp_stage_layers says
    otherwise. Looped placement (rank r holds stages r, r + pp, ...) except zbv and
    dualpipev: V placement (rank r holds r and 2 pp - 1 - r)."""
    pp_stage_layers: list[int] | None = None
    """Transformer layers of each pipeline stage, in stage order (stage s on the rank the
    schedule's placement gives it), one count per stage: pp * pp_virtual_stages of them,
    summing to model.n_layers; each stage takes the next layers in order. The first stage
    also holds the embedding and the last the final norm and output head (and the
    multi-token-prediction modules), so published recipes give them fewer layers: DeepSeek-V3
    on PP16 x 2 stages, [1, 2, ..., 2, 0] (Megatron-Core's layout "Et|(tt|)*30mL"). The first
    and the last stage may hold 0 layers (the embedding alone, the head alone); a stage in
    between may not (it would only pass its input on). null: equal stages
    (model.n_layers / stages each, which must divide). Needs pp > 1."""
    breadth_first_micro_batches: int | None = None
    """Micro-batches that one pass holds in flight (Fast-LLM's key of that name): with pp > 1
    the micro-batches of one run of the pipeline schedule, without a pipeline micro-batches
    whose forwards all run before their backwards. null: all of a step's micro-batches with
    pp > 1, 1 without (or the step's micro-batches / depth_first_micro_batches)."""
    depth_first_micro_batches: int | None = None
    """Passes per optimizer step, one after the other, gradients accumulated between them
    (Fast-LLM's key of that name): breadth_first_micro_batches * depth_first_micro_batches
    = the step's micro-batches per data-parallel rank. null: whatever breadth-first leaves."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0: replicas with gradient all-reduce; 1: optimizer state sharded over dp_shard;
    2: gradients too (FSDP2, reshard_after_forward=False); 3: parameters too (FSDP2)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (the attention of every block), or
    full (every block)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over ep data-parallel ranks
    (ep innermost among them), tokens travel to their experts and back. Must divide
    moe.num_experts and dp_replicate * dp_shard (docs/expert_parallel.md)."""
    ep_dispatcher: Literal["all_to_all", "all_gather"] = "all_to_all"
    """How tokens reach their experts under ep > 1: all_to_all (sends the rows routed to
    another rank: dropless exactly those, with one host sync per layer for the split sizes;
    with a capacity factor every expert's capacity, static sizes, no host sync) or
    all_gather (every rank gathers the EP group's tokens, static shapes, no host sync; ep x
    the MoE input memory: for ep = 2 or tiny batches)."""
    expert_tp: bool = True
    """With tp > 1 (any ep): split every expert's FFN width, routed and shared, over the
    tensor-parallel ranks (expert tensor parallelism, Megatron-Core's default), so that each
    expert row is computed once per tp group; the partial outputs are summed once per layer.
    false: every tp rank holds whole experts and computes all of them on all of its tokens
    (tp x the expert FLOPs, no expert communication). No effect with tp = 1.
    moe.expert_ffn_dim (and the shared experts' width) must divide by tp."""
    overlap_shared_experts: bool = False
    """Compute the shared experts while the expert-parallel all-to-all carries the routed
    tokens to their experts (an asynchronous all_to_all_single, waited for after the shared
    experts), instead of while it brings the experts' outputs back (their place otherwise).
    The same numbers in another order; needs ep > 1, the all_to_all dispatcher and
    moe.num_shared_experts > 0. Under parallel.ep_overlap=halves leave it off: the return
    trip of a block's second half is the transfer nothing else covers."""
    ep_dropless_transport: Literal["exact", "slots"] = "exact"
    """How dropless routing's rows travel under the all_to_all dispatcher. exact: the rows
    kept, with uneven split sizes the host reads once per MoE layer (a synchronisation on a
    GPU). slots: every expert's segment in one slot per token (the most it can receive), so
    the sizes are static and nothing waits on the host, for E / top_k times the bytes and
    the receive buffer of exact's balanced routing (docs/expert_parallel.md). Only with
    moe.capacity_factor=null (a capacity factor's segments already travel in slots)."""
    ep_overlap: Literal["none", "halves"] = "none"
    """Hide the expert-parallel all-to-alls behind computation. halves: every block cuts its
    micro-batch into two halves of its sequences and interleaves their phases, so that one
    half's rows travel while the other half computes its attention or experts, forward and
    backward (docs/expert_parallel.md). The same operations on half the rows: equal to
    training without it up to rounding. Needs ep > 1, the all_to_all dispatcher, an even
    micro-batch, moe.token_group_seqs dividing half of it; not with train.compile."""

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "pp_virtual_stages", "ep", "pp_microbatches",
                     "cp", "breadth_first_micro_batches", "depth_first_micro_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                _fail(f"parallel.{name}", f"must be >= 1, got {value}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            _fail("parallel.dp_shard", f"must be >= 1 or -1 (derived), got {self.dp_shard}")
        if self.sequence_parallel and self.tp == 1:
            _fail("parallel.sequence_parallel", "needs parallel.tp > 1, got parallel.tp=1")
        if self.pp_microbatches is not None and self.pp == 1:
            _fail("parallel.pp_microbatches", f"{self.pp_microbatches} set but parallel.pp=1; "
                  "without a pipeline use train.micro_batch_size")
        if self.ep_dispatcher not in ("all_to_all", "all_gather"):
            _fail("parallel.ep_dispatcher", "expected all_to_all or all_gather, got "
                  f"{self.ep_dispatcher!r}")
        if self.pp_virtual_stages > 1 and self.pp_schedule in ("gpipe", "1f1b"):
            _fail("parallel.pp_virtual_stages", f"{self.pp_virtual_stages} needs an interleaved "
                  f"schedule; parallel.pp_schedule={self.pp_schedule!r} runs one stage per rank")
        if self.pp > 1 and self.pp_schedule in V_SCHEDULES and self.pp_virtual_stages != 2:
            _fail("parallel.pp_virtual_stages", f"{self.pp_virtual_stages}, but parallel."
                  f"pp_schedule={self.pp_schedule!r} places exactly 2 stages on each rank in a V "
                  "(rank r holds stages r and 2 pp - 1 - r): set parallel.pp_virtual_stages=2")
        if self.pp_stage_layers is not None:
            self._validate_stage_layers(self.pp_stage_layers)
        if self.ep_dropless_transport not in ("exact", "slots"):
            _fail("parallel.ep_dropless_transport", "expected exact or slots, got "
                  f"{self.ep_dropless_transport!r}")
        if self.ep_dropless_transport == "slots" and (
                self.ep == 1 or self.ep_dispatcher != "all_to_all"):
            _fail("parallel.ep_dropless_transport", "slots shapes the expert-parallel "
                  "all-to-all: needs parallel.ep > 1 and parallel.ep_dispatcher=all_to_all, got "
                  f"parallel.ep={self.ep}, parallel.ep_dispatcher={self.ep_dispatcher}")
        if self.ep_overlap not in ("none", "halves"):
            _fail("parallel.ep_overlap", f"expected none or halves, got {self.ep_overlap!r}")
        if self.ep_overlap != "none" and (self.ep == 1 or self.ep_dispatcher != "all_to_all"):
            _fail("parallel.ep_overlap", "hides the expert-parallel all-to-all behind "
                  "computation: needs parallel.ep > 1 and parallel.ep_dispatcher=all_to_all, got "
                  f"parallel.ep={self.ep}, parallel.ep_dispatcher={self.ep_dispatcher}")
        if self.overlap_shared_experts and (self.ep == 1 or self.ep_dispatcher != "all_to_all"):
            _fail("parallel.overlap_shared_experts", "overlaps the shared experts with the "
                  "expert-parallel all-to-all: needs parallel.ep > 1 and parallel.ep_dispatcher="
                  f"all_to_all, got parallel.ep={self.ep}, parallel.ep_dispatcher="
                  f"{self.ep_dispatcher}")


    def _validate_stage_layers(self, counts: list[int]) -> None:
        """``pp_stage_layers`` on its own: one count per stage, none negative, 0 only at
        either end (the layers' total is checked against model.n_layers in
        ``ParallelDims.validate``)."""
        key = "parallel.pp_stage_layers"
        if self.pp == 1:
            _fail(key, f"{counts} set but parallel.pp=1: without a pipeline every rank holds "
                  "every layer; set parallel.pp_stage_layers=null")
        stages = self.pp * self.pp_virtual_stages
        if len(counts) != stages:
            _fail(key, f"{len(counts)} counts {counts}, but parallel.pp * parallel."
                  f"pp_virtual_stages = {self.pp} * {self.pp_virtual_stages} = {stages} "
                  "stages: give one layer count per stage")
        if any(c < 0 for c in counts):
            _fail(key, f"layer counts must be >= 0, got {counts}")
        empty = [s for s, c in enumerate(counts) if c == 0 and 0 < s < stages - 1]
        if empty:
            _fail(key, f"stages {empty} of {counts} hold no layer: only the first stage (the "
                  "embedding) and the last (the output head) may be empty; a stage in between "
                  "would only pass its input on")


V_SCHEDULES = ("zbv", "dualpipev")
"""Pipeline schedules with the V-shaped stage placement (two stages per rank)."""
