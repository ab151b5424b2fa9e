"""The parallel layout: degrees derived from ``parallel.*`` and the world size, every check
that needs more than one config section, and the named ``DeviceMesh``.

Rank order. The mesh is ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]`` in row-major
order, so

    rank = (((pp_rank * dp_replicate + replicate_rank) * dp_shard + shard_rank) * cp
            + cp_rank) * tp + tp_rank

tensor-parallel groups are consecutive ranks (keep them inside one node: they talk every
layer), context-parallel groups next (they exchange keys and values every attention layer),
pipeline neighbours are ``world / pp`` ranks apart (they exchange one activation per
micro-batch and can span nodes), and the data-parallel ranks fill the middle. Flattened dims
are added: ``dp`` (dp_replicate x dp_shard, the ranks that see different data) and, with
cp > 1, ``dp_cp`` (dp x cp: the ranks over which gradients are averaged, since cp ranks hold
different tokens of the same sequences) and ``dp_shard_cp`` (what ZeRO shards over).

Everything here runs before any process group exists; each error names the keys and the
numbers (``ConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetrain.config import ConfigError, JobConfig, ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_MESHES: dict[tuple, Meshes] = {}  # build_mesh's cache: process groups are per process anyway

# Schedules that keep several micro-batches in flight need at least one per stage.
_NEEDS_MB_GE_PP = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# Schedules whose micro-batch count must be a multiple of pp (torch's interleaved runtime).
_NEEDS_MB_MULTIPLE_OF_PP = ("interleaved_1f1b", "zero_bubble")


@dataclass
class Meshes:
    """The world mesh and the 1-D sub-meshes the ``apply_*`` steps and the engine use."""

    world: Any
    dp: Any
    pp: Any
    tp: Any
    dp_shard: Any
    dp_replicate: Any
    ep: Any = None
    """Expert-parallel group (``ep`` consecutive dp ranks, same pp stage and tp index);
    None when parallel.ep = 1."""
    edp: Any = None
    """Expert-data-parallel group (dp ranks holding the same experts); None when ep = 1."""
    ep_root: Any = None
    """The ``(pp, edp, ep, tp)`` mesh the two above come from (None when ep = 1)."""
    cp: Any = None
    """Context-parallel group (the cp ranks holding parts of the same sequences); size 1
    when parallel.cp = 1."""
    dp_cp: Any = None
    """The ranks gradients are averaged over: ``dp`` itself when cp = 1, else the flattened
    (dp_replicate, dp_shard, cp)."""
    dp_shard_cp: Any = None
    """The ranks ZeRO shards over: ``dp_shard`` when cp = 1, else the flattened
    (dp_shard, cp)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one layout. ``dp`` = dp_replicate * dp_shard ranks see different data."""

    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    virtual_stages: int = 1
    cp: int = 1

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, pcfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Derive ``dp_shard`` (when -1) from the world size and check the product."""
        others = pcfg.pp * pcfg.dp_replicate * pcfg.cp * pcfg.tp
        dp_shard = pcfg.dp_shard
        # parallel.cp is named only where it is set, so that the common message stays short.
        cp_key, cp_val = (" * parallel.cp", f" * {pcfg.cp}") if pcfg.cp > 1 else ("", "")
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel.pp * parallel.dp_replicate{cp_key} * parallel.tp = {pcfg.pp} * "
                    f"{pcfg.dp_replicate}{cp_val} * {pcfg.tp} = {others} does not divide the "
                    f"world size {world_size}"
                )
            dp_shard = world_size // others
        elif others * dp_shard != world_size:
            raise ConfigError(
                f"parallel.pp * parallel.dp_replicate * parallel.dp_shard{cp_key} * parallel.tp"
                f" = {pcfg.pp} * {pcfg.dp_replicate} * {dp_shard}{cp_val} * {pcfg.tp} = "
                f"{others * dp_shard}, but the world size is {world_size}"
            )
        return cls(
            world_size,
            pcfg.pp,
            pcfg.dp_replicate,
            dp_shard,
            pcfg.tp,
            pcfg.ep,
            pcfg.pp_virtual_stages,
            pcfg.cp,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are averaged: dp x cp (a cp rank holds 1/cp of the
        tokens of its dp rank's sequences)."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    # ------------------------------------------------------------------ batch arithmetic

    def microbatches(self, cfg: JobConfig) -> int:
        """Micro-batches per step on one data-parallel rank (gradient accumulation steps)."""
        if self.pp > 1 and cfg.parallel.pp_microbatches is not None:
            return cfg.parallel.pp_microbatches
        return cfg.train.global_batch_size // (self.dp * cfg.train.micro_batch_size)

    def micro_batch_size(self, cfg: JobConfig) -> int:
        """Sequences per forward on one rank."""
        return cfg.train.global_batch_size // (self.dp * self.microbatches(cfg))

    def breadth_first(self, cfg: JobConfig) -> int:
        """Micro-batches one pass holds in flight (``parallel.breadth_first_micro_batches``):
        a run of the pipeline schedule, or forwards before backwards without a pipeline.
        Fast-LLM's defaults: all of the step's micro-batches with pp > 1, one without."""
        p, n = cfg.parallel, self.microbatches(cfg)
        if p.breadth_first_micro_batches is not None:
            return p.breadth_first_micro_batches
        if p.depth_first_micro_batches is not None:
            return max(n // p.depth_first_micro_batches, 1)
        return n if self.pp > 1 else 1

    def depth_first(self, cfg: JobConfig) -> int:
        """Passes per optimizer step (``parallel.depth_first_micro_batches``)."""
        return max(self.microbatches(cfg) // self.breadth_first(cfg), 1)

    # ------------------------------------------------------------------ validation

    def validate(self, cfg: JobConfig) -> ParallelDims:
        """Every check across sections; raises ConfigError naming keys and numbers."""
        p, m, t = cfg.parallel, cfg.model, cfg.train
        tp = self.tp
        if tp > 1:
            if m.n_heads % tp:
                raise ConfigError(
                    f"model.n_heads: {m.n_heads} is not divisible by parallel.tp="
                    f"{tp} (each tensor-parallel rank holds whole heads)"
                )
            if m.kv_heads % tp:
                raise ConfigError(
                    f"model.n_kv_heads: {m.kv_heads} kv heads are not divisible by parallel.tp={tp}"
                )
            if m.ffn_dim % tp:
                raise ConfigError(
                    f"model.ffn_dim: {m.ffn_dim} is not divisible by parallel.tp={tp}"
                )
            if m.vocab_size is not None and m.vocab_size % tp:
                raise ConfigError(
                    f"model.vocab_size: {m.vocab_size} is not divisible by "
                    f"parallel.tp={tp} (vocabulary-parallel embedding and loss)"
                )
            if p.sequence_parallel and cfg.data.seq_len % tp:
                raise ConfigError(
                    f"data.seq_len: {cfg.data.seq_len} is not divisible by "
                    f"parallel.tp={tp} (parallel.sequence_parallel splits it)"
                )
        if m.mtp_depth and self.cp > 1:
            raise ConfigError(
                f"model.mtp_depth: multi-token prediction is not supported with parallel.cp="
                f"{self.cp} (a module's input at a position is the embedding of the token k "
                "places ahead, which context parallelism's zig-zag chunks put on another rank; "
                "it runs under data, tensor, pipeline and expert parallelism); set "
                "model.mtp_depth=0 or parallel.cp=1"
            )
        if m.mtp_depth and tp > 1 and m.dim % tp:
            raise ConfigError(
                f"model.dim: {m.dim} is not divisible by parallel.tp={tp} (the multi-token-"
                "prediction projection eh_proj is split by output column)"
            )
        self._validate_stages(cfg)
        if self.pp > 1 and m.tie_embeddings:
            raise ConfigError(
                f"model.tie_embeddings: true cannot span pipeline stages (parallel.pp="
                f"{self.pp}: the embedding is on the first stage, the output on the last); "
                "set model.tie_embeddings=false"
            )
        # Batch: global = dp * microbatches * micro_batch_size.
        if p.pp_microbatches is not None and self.pp > 1:
            mb = p.pp_microbatches
            if t.global_batch_size % (self.dp * mb):
                raise ConfigError(
                    f"train.global_batch_size: {t.global_batch_size} is not divisible by dp * "
                    f"parallel.pp_microbatches = {self.dp} * {mb} = {self.dp * mb} "
                    f"(dp = world size {self.world_size} / (pp * cp * tp) = {self.dp})"
                )
        elif t.global_batch_size % (self.dp * t.micro_batch_size):
            raise ConfigError(
                f"train.global_batch_size: {t.global_batch_size} is not divisible by dp * "
                f"train.micro_batch_size = {self.dp} * {t.micro_batch_size} = "
                f"{self.dp * t.micro_batch_size} (dp = world size {self.world_size} / "
                f"(pp * cp * tp) = {self.dp})"
            )
        n_mb = self.microbatches(cfg)
        self._validate_passes(cfg, n_mb)
        # The pipeline's checks hold for the micro-batches of one pass of the schedule.
        n_pass = self.breadth_first(cfg)
        what = (
            f"{n_pass} micro-batches per pass of the schedule (parallel."
            f"breadth_first_micro_batches)"
            if n_pass != n_mb
            else f"{n_mb} micro-batches per step"
        )
        if self.pp > 1 and p.pp_schedule in _NEEDS_MB_GE_PP and n_pass < self.pp:
            raise ConfigError(
                f"parallel.pp_microbatches: {what} is fewer than "
                f"parallel.pp={self.pp} stages, which parallel.pp_schedule={p.pp_schedule!r} "
                "needs (raise train.global_batch_size or lower train.micro_batch_size)"
            )
        if self.pp > 1 and p.pp_schedule in _NEEDS_MB_MULTIPLE_OF_PP and (n_pass % self.pp):
            raise ConfigError(
                f"parallel.pp_microbatches: {what} is not a multiple of "
                f"parallel.pp={self.pp}, which parallel.pp_schedule={p.pp_schedule!r} needs"
            )
        if self.pp > 1 and p.pp_schedule == "dualpipev" and n_pass < self.num_stages:
            raise ConfigError(
                f"parallel.pp_microbatches: {what} is fewer than the {self.num_stages} "
                f"stages (parallel.pp * parallel.pp_virtual_stages = {self.pp} * "
                f"{self.virtual_stages}), which parallel.pp_schedule='dualpipev' needs"
            )
        self._validate_cp(cfg)
        mbs = self.micro_batch_size(cfg)
        groups = cfg.moe.token_group_seqs
        if cfg.moe.num_experts and groups is None and mbs != t.micro_batch_size:
            # Without fixed token groups, capacity and the balancing losses are taken per
            # micro-batch: re-cutting the micro-batches would change the training itself.
            raise ConfigError(
                f"parallel.pp_microbatches: {n_mb} pipeline micro-batches make micro-batches "
                f"of {mbs} sequences instead of train.micro_batch_size={t.micro_batch_size}, "
                "and moe.token_group_seqs=null takes MoE capacity and balancing statistics per "
                "micro-batch, so training would differ from the same job without a pipeline; "
                f"set moe.token_group_seqs to a divisor of {mbs}, or train.micro_batch_size="
                f"{mbs}"
            )
        if cfg.moe.num_experts and groups is not None and mbs % groups:
            raise ConfigError(
                f"moe.token_group_seqs: {groups} does not divide the per-rank micro-batch of "
                f"{mbs} sequences (train.global_batch_size={t.global_batch_size} / (dp={self.dp}"
                f" * micro-batches={n_mb})); token groups must not change with the layout"
            )
        moe = cfg.moe
        if p.expert_tp and tp > 1 and moe.num_experts:
            if moe.expert_ffn_dim % tp:
                raise ConfigError(
                    f"moe.expert_ffn_dim: {moe.expert_ffn_dim} is not divisible by "
                    f"parallel.tp={tp} (parallel.expert_tp splits every expert's FFN width; "
                    "parallel.expert_tp=false keeps the experts whole on every tp rank)"
                )
            shared = moe.shared_expert_ffn_dim or moe.num_shared_experts * moe.expert_ffn_dim
            if moe.num_shared_experts and shared % tp:
                raise ConfigError(
                    f"moe.shared_expert_ffn_dim: the shared experts' width {shared} is not "
                    f"divisible by parallel.tp={tp} (parallel.expert_tp splits it)"
                )
        if self.ep > 1:
            from moetrain.parallel.expert_parallel import check_ep_layout

            check_ep_layout(cfg.moe.num_experts, self.ep, self.dp, self.cp)
        if p.ep_overlap == "halves":
            self._validate_halves(cfg, mbs)
        if p.ep_dropless_transport == "slots" and moe.capacity_factor is not None:
            raise ConfigError(
                "parallel.ep_dropless_transport: slots is for dropless routing, but "
                f"moe.capacity_factor={moe.capacity_factor}: a capacity factor's segments "
                "already travel in static slots; set it to exact or the capacity factor to null")
        if p.overlap_shared_experts and not (moe.num_experts and moe.num_shared_experts):
            raise ConfigError(
                "parallel.overlap_shared_experts: overlaps the shared experts with the "
                "expert-parallel all-to-all, but moe.num_shared_experts="
                f"{moe.num_shared_experts} (moe.num_experts={moe.num_experts}): there is "
                "nothing to overlap"
            )
        return self

    def _validate_halves(self, cfg: JobConfig, mbs: int) -> None:
        """``parallel.ep_overlap=halves`` cuts every micro-batch into two halves of its
        sequences: they must exist, and hold whole token groups (capacity and the balancing
        losses are taken per group, so a group cut in two would change the training)."""
        key = "parallel.ep_overlap"
        if mbs % 2:
            raise ConfigError(
                f"{key}: halves cuts each micro-batch into two halves of its sequences, but a "
                f"micro-batch holds {mbs} (train.micro_batch_size, or the global batch over dp "
                "and the pipeline's micro-batches): make it even")
        groups = cfg.moe.token_group_seqs
        if groups is None or (mbs // 2) % groups:
            raise ConfigError(
                f"moe.token_group_seqs: {groups}, but parallel.ep_overlap=halves routes each "
                f"half of a {mbs}-sequence micro-batch on its own, and capacity and the "
                "balancing losses are taken per token group: set moe.token_group_seqs to a "
                f"divisor of {mbs // 2}")
        if cfg.train.compile:
            raise ConfigError(
                f"{key}: halves keeps all-to-alls in flight across a block's operations, "
                "which torch.compile of the block has not been shown to keep: not with "
                "train.compile=true")

    def _validate_stages(self, cfg: JobConfig) -> None:
        """The layers split into ``pp * pp_virtual_stages`` stages: as ``parallel.
        pp_stage_layers`` says (its counts summing to model.n_layers), or equally."""
        n, stages, counts = cfg.model.n_layers, self.num_stages, cfg.parallel.pp_stage_layers
        if counts is not None:
            if sum(counts) != n:
                raise ConfigError(
                    f"parallel.pp_stage_layers: {counts} sum to {sum(counts)} layers, but "
                    f"model.n_layers={n}"
                )
            return
        if n % stages == 0:
            return
        from moetrain.parallel.pipeline import suggested_stage_layers

        split = suggested_stage_layers(n, stages)
        hint = (
            f"; for uneven stages set parallel.pp_stage_layers to {stages} layer counts summing "
            f"to {n}, e.g. {split}"
            if split is not None
            else f" (and {n} layers are too few for {stages} stages of at least one layer "
            "between the first and the last)"
        )
        raise ConfigError(
            f"model.n_layers: {n} layers do not split into parallel.pp * "
            f"parallel.pp_virtual_stages = {self.pp} * {self.virtual_stages} = {stages} "
            f"equal stages{hint}"
        )

    def _validate_passes(self, cfg: JobConfig, n_mb: int) -> None:
        """``parallel.breadth_first_micro_batches`` x ``depth_first_micro_batches`` = the
        step's micro-batches per data-parallel rank."""
        p = cfg.parallel
        bf, df = p.breadth_first_micro_batches, p.depth_first_micro_batches
        if bf is not None and df is not None and bf * df != n_mb:
            raise ConfigError(
                f"parallel.breadth_first_micro_batches: {bf} * parallel."
                f"depth_first_micro_batches={df} = {bf * df}, but a step has {n_mb} "
                "micro-batches per data-parallel rank (train.global_batch_size / (dp * "
                "micro-batch size))"
            )
        for key, value in (("breadth_first_micro_batches", bf), ("depth_first_micro_batches", df)):
            if value is not None and n_mb % value:
                raise ConfigError(
                    f"parallel.{key}: {value} does not divide the {n_mb} micro-batches of a "
                    "step per data-parallel rank"
                )

    def _validate_cp(self, cfg: JobConfig) -> None:
        """Context parallelism: the sequence splits into 2 cp equal chunks (each rank an
        early and a late one), and with sequence parallelism a rank's 1/cp of it splits
        over tp."""
        if self.cp == 1:
            return
        seq, cp, tp = cfg.data.seq_len, self.cp, self.tp
        if seq % (2 * cp):
            raise ConfigError(
                f"data.seq_len: {seq} does not split into 2 * parallel.cp = {2 * cp} equal "
                "chunks (context parallelism gives each cp rank an early and a late chunk of "
                "every sequence, which balances the causal attention's work)"
            )
        if cfg.parallel.sequence_parallel and (seq // cp) % tp:
            raise ConfigError(
                f"data.seq_len: the {seq // cp} positions a cp rank holds (data.seq_len / "
                f"parallel.cp = {seq} / {cp}) are not divisible by parallel.tp={tp} "
                "(parallel.sequence_parallel splits them)"
            )

    # ------------------------------------------------------------------ mesh

    def build_mesh(self, device_type: str, cache: bool = True) -> Meshes:
        """The world ``DeviceMesh`` with named dims ``MESH_DIMS`` (size-1 dims included) and
        its sub-meshes. Needs the default process group. ``cache=False``: build it anew and
        keep no reference (``moetrain plan``, under a fake process group it then destroys).

        Built once per layout and default process group, then reused: a process that builds
        several trainers of one layout (tests, tools) would otherwise open new process groups
        -- sockets between every pair of their ranks -- each time, and DTensor's sharding
        cache, which compares meshes by their ranks, could hand a new model an older mesh."""
        import torch.distributed as dist

        if not cache:
            return self._build_mesh(device_type)
        key = (device_type, id(dist.group.WORLD), self)
        if key not in _MESHES:
            _MESHES[key] = self._build_mesh(device_type)
        return _MESHES[key]

    def _build_mesh(self, device_type: str) -> Meshes:
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIMS,
        )
        # Keep the flattened mesh objects: looking them up again through the root is
        # deprecated.
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        dp_cp, dp_shard_cp = dp, world["dp_shard"]
        if self.cp > 1:
            dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        ep = edp = ep_root = None
        if self.ep > 1:
            from moetrain.parallel.expert_parallel import build_ep_meshes

            # EP groups are carved out of the dp x cp ranks (cp innermost: an EP group spans
            # the cp ranks of a dp rank first, as in Megatron-Core).
            ep, edp, ep_root = build_ep_meshes(
                self.pp, self.dp_cp, self.tp, self.ep, device_type, return_root=True
            )
        return Meshes(
            world=world,
            dp=dp,
            pp=world["pp"],
            tp=world["tp"],
            dp_shard=world["dp_shard"],
            dp_replicate=world["dp_replicate"],
            ep=ep,
            edp=edp,
            ep_root=ep_root,
            cp=world["cp"],
            dp_cp=dp_cp,
            dp_shard_cp=dp_shard_cp,
        )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dim (the documented rank order)."""
        out = {}
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        for name, size in reversed(list(zip(MESH_DIMS, sizes, strict=True))):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}
