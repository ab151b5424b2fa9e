"""``plan``: a layout validated and priced at its world size, one distinct rank at a time.

    plan(cfg, world_size, build_optimizers, device_type="cuda", gpu=hardware.gpu("h100"))

validates the layout with the trainer's own checks and messages (``check_layout``), builds
each distinct rank (every pipeline stage; the other coordinates of a stage hold the same
shapes, data-parallel rank 0 the most of FSDP's and ZeRO-1's uneven shards) on the meta
device (``moetrain.plan.build``), adds its activations (``moetrain.plan.activations``), and
with a GPU its traffic and a step-time estimate (``traffic``, ``estimate``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from moetrain.config import ConfigError, JobConfig
from moetrain.model.precision import Precision
from moetrain.parallel.dims import ParallelDims
from moetrain.plan import activations as act
from moetrain.plan.build import BuildOptimizers, RankState, build_rank
from moetrain.plan.estimate import Estimate, estimate_ranks
from moetrain.plan.hardware import GPU
from moetrain.plan.stepmix import StepMix, cached_census
from moetrain.plan.traffic import Axis, traffic


@dataclass
class RankPlan:
    """One distinct rank: its model state (read off its meta build), its activations, and
    with a GPU its traffic and step estimate."""

    state: RankState
    per_microbatch: list[int]
    """Activation bytes one micro-batch leaves in each of the rank's chunks."""
    in_flight: list[int]
    """Micro-batches in flight per chunk when the rank holds the most."""
    activations: int
    """The most activation bytes held at once (what SavedActivations measures)."""
    recompute: int
    """One block's tensors while activation checkpointing recomputes it (not in the above)."""
    rope: int
    axes: list[Axis] = field(default_factory=list)
    estimate: Estimate | None = None
    staging: int = 0
    """Host bytes the asynchronous checkpoints stage into (``train.checkpoint_async``): a copy
    of the rank's checkpoint tensors (``RankState.checkpoint``: parameters, persistent
    buffers, optimizer state), allocated at the first save and kept. In host memory (pinned)
    on a GPU, beside the rank's other memory on a CPU."""
    dropless_worst: int = 0
    """Bytes beyond ``activations`` that one MoE layer of one micro-batch needs when dropless
    routing sends this rank's experts every token of its expert-parallel group
    (``activations.dropless_worst_rows``): what an unlucky step adds to the peak. 0 where a
    capacity factor or static buffers bound it."""

    @property
    def steady(self) -> int:
        """Bytes at the step's peak: model state (parameters, gradients, optimizer states,
        master weights), gathered parameters, buffers and activations."""
        s = self.state
        return (
            s.model_state + s.gathered + s.buffers + self.activations + self.recompute + self.rope
        )


@dataclass
class Plan:
    cfg: JobConfig
    dims: ParallelDims
    device_type: str
    dtype: torch.dtype
    ranks: list[RankPlan]
    gpu: GPU | None = None
    gpus_per_node: int = 8

    def start_up_of(self, rank: RankPlan) -> int:
        """Bytes a rank holds at the peak of its start-up (``moetrain.parallel.materialize``):
        its parameter shards and buffers, plus the larger of the largest generator block
        its initialisation draws (in host memory on a GPU: counted on a CPU only) and the
        largest shard FSDP2 re-pads while the shards get their storage."""
        s = rank.state
        block = s.init_block if self.device_type == "cpu" else 0
        return s.params + s.buffers + max(block, s.repad)

    @property
    def start_up(self) -> int:
        """The largest start-up of the planned ranks."""
        return max(self.start_up_of(r) for r in self.ranks)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.steady)

    def peak(self, rank: RankPlan | None = None) -> int:
        """A rank's peak over the run (the worst rank's by default): its start-up or its
        step, whichever is larger, plus the runtime's reserve on a GPU."""
        if rank is None:
            return max(self.peak(r) for r in self.ranks)
        return max(self.start_up_of(rank), rank.steady + self.staging_on_device(rank)) + (
            self.reserve
        )

    def staging_on_device(self, rank: RankPlan) -> int:
        """The asynchronous checkpoints' staging where it shares the rank's memory (a CPU
        run); a GPU's rank stages into host memory instead (``memory_check`` checks it)."""
        return rank.staging if self.device_type == "cpu" else 0

    def step_peak(self, rank: RankPlan | None = None) -> int:
        """A rank's peak during training steps (the worst rank's by default), plus the
        runtime's reserve on a GPU."""
        ranks = [rank] if rank is not None else self.ranks
        steady = max(r.steady + self.staging_on_device(r) for r in ranks)
        return int(steady + self.reserve)

    @property
    def reserve(self) -> int:
        return int(self.gpu.runtime_reserve_gb * 1e9) if self.gpu is not None else 0

    @property
    def step_s(self) -> float | None:
        """The slowest rank's estimated step: the job's."""
        times = [r.estimate.step_s for r in self.ranks if r.estimate is not None]
        return max(times) if times else None

    @property
    def tflops_per_gpu(self) -> float | None:
        """Model TFLOP/s per GPU as the trainer (and published tables) count them:
        FLOPs per token x tokens per step / (step x world size)."""
        step = self.step_s
        if step is None:
            return None
        s = self.ranks[0].state
        tokens = self.cfg.train.global_batch_size * self.cfg.data.seq_len
        return s.flops_per_token * tokens / (step * self.dims.world_size) / 1e12


def check_layout(cfg: JobConfig, world_size: int, device_type: str = "cuda") -> ParallelDims:
    """The trainer's checks before it builds anything, with its messages: the vocabulary
    (from the tokenizer when model.vocab_size is null), the layout against the world size,
    every cross-section rule (``ParallelDims.validate``), FlexAttention on a CPU."""
    if cfg.model.attention_backend == "flex" and device_type == "cpu":
        raise ConfigError(
            "model.attention_backend: flex trains on CUDA only (FlexAttention has no "
            "backward on CPU); use sdpa, which gives the same numbers (docs/attention.md)"
        )
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    if cfg.model.vocab_size is None:
        from moetrain.data import load_tokenizer

        cfg.model.vocab_size = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir).vocab_size
    return dims.validate(cfg)


def distinct_ranks(dims: ParallelDims) -> list[int]:
    """One rank per pipeline stage (data-parallel, cp and tp coordinates 0): every other rank
    holds what one of these holds, or less."""
    return [pp * (dims.world_size // dims.pp) for pp in range(dims.pp)]


def plan_rank(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    dtype: torch.dtype,
    device_type: str,
) -> RankPlan:
    sh = act.shapes(cfg, dims, dtype, device_type)
    per_mb = [act.chunk_bytes(cfg, sh, c) for c in state.chunks]
    stage_ids = [c.stage for c in state.chunks]
    kept = [act.input_only_bytes(cfg, sh, c) for c in state.chunks]
    peak, flight = act.peak_in_flight(cfg, dims, state.coords["pp"], stage_ids, per_mb, kept)
    rope = act.rope_bytes(cfg, sh) * (max(sum(flight), 1) if dims.cp > 1 else 1)
    staging = state.checkpoint if cfg.train.checkpoint_async else 0
    worst = 0
    if any(layer.moe for c in state.chunks for layer in c.layers):
        excess_rows = act.dropless_worst_rows(cfg, sh) - act.rows(cfg, sh)
        worst = max(excess_rows, 0) * act.expert_row_bytes(cfg, sh)
    return RankPlan(state, per_mb, flight, peak, act.recompute_bytes(cfg, sh, state.chunks), rope,
                    staging=staging, dropless_worst=worst)  # fmt: skip


def plan(
    cfg: JobConfig,
    world_size: int,
    build_optimizers: BuildOptimizers,
    *,
    device_type: str = "cuda",
    gpu: GPU | None = None,
    gpus_per_node: int = 8,
    ranks: list[int] | None = None,
    overlap: dict[str, float] | None = None,
    mix: StepMix | None = None,
) -> Plan:
    """Validate the layout of ``cfg`` at ``world_size`` ranks and plan its distinct ranks
    (or ``ranks``); with ``gpu`` price their traffic and step time too, from ``mix``: what
    the code's step computes (default: the census of this model's proxy,
    ``moetrain.plan.stepmix``)."""
    dims = check_layout(cfg, world_size, device_type)
    dtype = Precision.choose(cfg.train.dtype, device_type).dtype  # the trainer's
    out = []
    sh = act.shapes(cfg, dims, dtype, device_type)
    for rank in ranks if ranks is not None else distinct_ranks(dims):
        state = build_rank(cfg, dims, rank, build_optimizers, device_type)
        rp = plan_rank(cfg, dims, state, dtype, device_type)
        if gpu is not None:
            rp.axes = traffic(cfg, dims, state, sh, dtype, gpus_per_node)
        out.append(rp)
    if gpu is not None:  # together: the pipeline's pace is its slowest stage's
        if mix is None:
            mix = cached_census(cfg, dtype, build_optimizers)
        estimates = estimate_ranks(cfg, dims, [(r.state, r.axes) for r in out], gpu, mix,
                                   overlap, device_type)  # fmt: skip
        for rp, e in zip(out, estimates, strict=True):
            rp.estimate = e
    return Plan(cfg, dims, device_type, dtype, out, gpu, gpus_per_node)


# ----------------------------------------------------------------------------- memory check


def available_memory(device: torch.device) -> tuple[float, str]:
    """Bytes this rank may use and where the figure comes from: the GPU's free memory on
    CUDA; on a CPU the machine's available memory (MemAvailable) shared by the node's ranks
    (LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free memory of {torch.cuda.get_device_name(device)}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = host_memory_available()
    return avail / local, f"MemAvailable {avail / 1e9:.1f} GB / {local} local rank(s)"


def host_memory_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))  # not Linux
