"""The ``train`` and ``log`` sections: steps, batches, device and precision, evaluation,
checkpoints and resuming, failure policies, routing replay and records, FP8; console and
TensorBoard logging and the warnings it raises."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moetrain.config.errors import _fail, _positive


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to train for. 0: save the starting model as checkpoint step 0 and stop
    (a model upcycled or initialised from a Hugging Face checkpoint, written directly for
    ``moetrain export-hf`` or ``generate``; a later run with more steps resumes from it)."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one data-parallel rank. Gradient accumulation
    steps = global_batch_size / (micro_batch_size * data-parallel degree)."""
    seed: int = 0
    """Seed of parameter initialisation and of router jitter."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train. auto: CUDA when available, else CPU."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: bf16 runs every GEMM on bf16 operands, forward and backward (autocast
    around the forward, the routed experts cast at their grouped GEMMs), with fp32 master
    weights, fp32 router gates and embeddings, and one policy under every layout (FSDP2
    mixed precision under ZeRO-2/3: blocks gathered in bf16, fp32 gradient reduction;
    docs/kernels.md), on CUDA or CPU; auto is bf16 on CUDA and fp32 on CPU. Parameters and
    optimizer state stay fp32."""
    output_dir: str = "outputs/run"
    """Run directory: TensorBoard events in <output_dir>/tb, checkpoints in
    <output_dir>/checkpoints."""
    eval_every: int = 50
    """Compute the held-out eval loss every N steps (and at the end). 0: only at the end."""
    eval_batches: int = 8
    """Micro-batches of the eval split per evaluation."""
    checkpoint_every: int = 100
    """Save a checkpoint every N steps (and at the end). 0: only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is verified."""
    checkpoint_async: bool = False
    """Write the periodic checkpoints while training goes on: the state is staged (copied to
    host memory, pinned on a GPU) at the step, then written, verified and published by a
    background thread over a process group of its own. At most one save is in flight (the
    next one waits, and the log says so); the final checkpoint, a preemption's and a
    non-finite halt's are written synchronously after the one in flight. The staging copy
    (parameters and optimizer state) is in ``moetrain plan`` and ``memory_check``
    (docs/checkpoints.md)."""
    resume: str = "auto"
    """"auto": resume from the checkpoint ``<output_dir>/checkpoints/latest`` names, or else
    the newest one that verifies; start fresh when there is none; refuse when checkpoints
    exist but none verifies. "never": start fresh; refuse when ``<output_dir>/checkpoints``
    holds any checkpoint. Or the path of a checkpoint (or of a checkpoints directory: its
    latest) to resume from. A resume with nothing to train (the checkpoint is at
    ``steps`` or past it) is refused, and so is one whose config changes a key that changes
    what the model computes (``resume_allow_changes``; docs/checkpoints.md). A refused start
    exits with status 2 and writes nothing."""
    compile: bool = False
    """Compile each transformer block with torch.compile (inductor). Blocks of one shape
    share a compiled graph (one more for evaluation), with no graph break on
    ``torch._grouped_mm``'s path (docs/architecture.md)."""
    nonfinite_policy: Literal["skip", "halt"] = "skip"
    """A step whose loss or gradient norm is not finite: "skip" leaves the parameters and
    optimizer untouched, counts the step (``train/skipped_steps``) and goes on; "halt" stops
    with an error (the last checkpoint holds the last good state)."""
    max_nonfinite_skips: int = 10
    """Halt anyway once more than this many steps have been skipped."""
    collective_timeout_s: int = 600
    """Seconds a collective may wait for a rank before failing the job (dead-rank bound)."""
    routing_replay: str | None = None
    """Routing replay (reinforcement-learning fine-tuning: train the policy that generated the
    rollouts): a directory of per-step files ``step_<8-digit step>.pt`` in the routing-trace
    format (docs/dashboards.md) holding each token's expert ids per MoE layer for the step's
    global batch (and its input_ids, checked against the data). Those ids replace the
    router's top-k in the training forward; combine weights and balancing losses still come
    from the router's scores. null: the router chooses."""
    benchmark: bool = False
    """This run measures speed, not a model: allows options that make the trained model
    useless (``moe.force_load_balancing``), which training refuses otherwise. Marks the run in
    its logs and TensorBoard."""
    memory_check: bool = True
    """Before building anything, compare this rank's planned memory peak
    (``moetrain plan``) with the memory it has (``memory_per_rank_gb``) and refuse to start,
    with both figures and the plan's advice, when it does not fit. false: start anyway."""
    memory_per_rank_gb: float | None = None
    """Memory one rank may use, in GB (10^9 bytes), for ``memory_check``. null: the GPU's
    memory on CUDA; on CPU the machine's available memory (MemAvailable) divided among the
    ranks of this node."""
    record_routing: bool = False
    """Write every training step's routing (the global batch's expert ids per MoE layer) to
    ``<output_dir>/routing/train/step_<8-digit step>.pt``, the format ``routing_replay``
    reads."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Keys whose value may differ from the resumed checkpoint's although the change alters
    what the model computes or the data stream its position belongs to (``moe.top_k``,
    ``moe.score_func``, ``model.rope_theta``, ``data.dataset``, ...): a resume that changes
    such a key is refused, naming it, unless it is listed here, e.g. ``[moe.top_k]``. Each
    accepted change is logged. Which keys need it: ``RESUME_KEYS`` in moetrain/config/resume.py and
    docs/checkpoints.md. Shape changes (the checkpoint fingerprint) are refused whatever
    this says."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 GEMMs (docs/fp8.md): the forward and input-gradient GEMMs of the blocks' linear
    layers (attention, dense and shared-expert FFNs) and of the routed experts take FP8
    inputs; the router, the embeddings, the output head, norms and the optimizer stay in
    high precision. "tensorwise": one scale per weight (per expert), e4m3 forward and e5m2
    output gradients; "rowwise": a scale per weight row along the contraction dim,
    power-of-two scales, e4m3 throughout. Activations and output gradients get a scale per
    token in both, so the numbers do not depend on the parallel layout. On top of
    ``train.dtype`` (whose dtype the GEMM outputs keep). Checkpoints are unchanged: a run
    resumes with another value. "none": off."""
    fp8_experts: bool = True
    """With ``train.fp8``: the routed experts' grouped GEMMs in FP8 too. false: only the
    linear layers."""
    fp8_backend: Literal["auto", "emulated", "scaled_mm"] = "auto"
    """How FP8 GEMMs run: "scaled_mm" on FP8 tensor cores (``torch._scaled_mm``,
    ``torch._scaled_grouped_mm`` on CUDA sm90; torch's CPU kernel for linears),
    "emulated" (cast to FP8 and back, then an fp32 GEMM: the same numbers up to the GEMM's
    rounding, on any device), "auto": scaled_mm on CUDA sm89+, emulated elsewhere."""

    def validate(self) -> None:
        _positive("train", self, "global_batch_size", "micro_batch_size", "eval_batches",
                  "keep_last", "collective_timeout_s", "memory_per_rank_gb")
        if self.steps < 0:
            _fail("train.steps", f"must be >= 0, got {self.steps}")
        if self.max_nonfinite_skips < 0:
            _fail("train.max_nonfinite_skips", f"must be >= 0, got {self.max_nonfinite_skips}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.routing_replay is not None and not Path(self.routing_replay).expanduser().is_dir():
            _fail("train.routing_replay", f"{self.routing_replay!r} is not a directory of "
                  "per-step routing files (step_00000001.pt, ...)")
        if self.global_batch_size % self.micro_batch_size:
            _fail("train.global_batch_size", f"{self.global_batch_size} is not divisible by "
                  f"train.micro_batch_size={self.micro_batch_size}")


@dataclass
class LogConfig:
    log_every: int = 10
    """Print a log line every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to <train.output_dir>/tb."""
    progress_bar: bool = True
    """Show a tqdm progress bar with loss and tokens/s (off when stderr is not a tty)."""
    heatmap_every: int = 50
    """Log the layer x expert token-share heatmap image every N steps. 0: never."""
    histogram_every: int = 50
    """Log router-score histograms every N steps. 0: never."""
    dead_expert_window: int = 20
    """An expert is dead when it received no tokens over the last N steps: the
    ``dead_experts`` scalar counts them, and a warning is logged when one dies."""
    imbalance_warn_threshold: float | None = 3.0
    """Log a warning when a layer's load imbalance (max/mean tokens per expert over a step)
    rises past this value; again only after it has come back under. null: never warn."""

    collapse_fraction: float | None = 0.9
    """Warn of router collapse when the same expert of a layer receives at least this
    fraction of the tokens for ``collapse_steps`` consecutive steps, and of one expert per
    batch when in each of those steps some expert does, not always the same one (the router
    does not tell tokens apart yet). null: never warn."""
    collapse_steps: int = 10
    """Consecutive steps of collapse before the warning."""
    specialization: bool = True
    """At every evaluation, record which experts each eval token is routed to: per MoE layer
    and expert the most frequent tokens and the share of each data domain, expert
    co-activation (TensorBoard text and images), saved to ``<output_dir>/routing/``; at the
    end of training, routing stability (per layer, the fraction of eval tokens whose top-1
    expert at each evaluation equals the final one's)."""
    specialization_top_tokens: int = 8
    """Tokens listed per expert in the specialization view."""

    def validate(self) -> None:
        _positive("log", self, "log_every", "dead_expert_window", "collapse_steps",
                  "specialization_top_tokens")
        if self.collapse_fraction is not None and not 0 < self.collapse_fraction <= 1:
            _fail("log.collapse_fraction", f"must be in (0, 1] or null, got "
                  f"{self.collapse_fraction}")
        for name in ("heatmap_every", "histogram_every"):
            if getattr(self, name) < 0:
                _fail(f"log.{name}", f"must be >= 0, got {getattr(self, name)}")
        t = self.imbalance_warn_threshold
        if t is not None and not (t >= 1 and math.isfinite(t)):
            _fail("log.imbalance_warn_threshold", f"must be a finite number >= 1 (max/mean is "
                  f"never below 1) or null, got {t}")
