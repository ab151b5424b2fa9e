"""One training step measured on this rank (``measure_step``: memory probes after forward,
backward and the optimizer step, every collective counted, saved activations, routed-expert
FLOPs) and its figures beside the analytic ones (``step_figures``). What they use of the run
they measure is named by ``MeasuredRun`` (the trainer is one), not reached by duck typing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moetrain.parallel.accounting.analytic import (
    analytic_expert_flops,
    analytic_sent,
    full_sequence_kv_bytes,
    zero_bytes_per_param,
)
from moetrain.parallel.accounting.comm import CommCounter
from moetrain.parallel.accounting.memory import (
    MemorySample,
    SavedActivations,
    model_state_bytes,
    optimizer_state_bytes_per_param,
)

if TYPE_CHECKING:
    from moetrain.config import JobConfig
    from moetrain.parallel.dims import Meshes, ParallelDims

Probe = Callable[[str], None]
"""Called with "forward", "backward" and "step" as a step passes each phase."""


@runtime_checkable
class StepEngine(Protocol):
    """What accounting reads of the engine that runs a step (``moetrain.train.engine.Engine``
    is one)."""

    @property
    def parts(self) -> list[torch.nn.Module]:
        """This rank's model chunks (one per pipeline stage it holds; one without pipeline)."""
        ...

    @property
    def optimizers(self) -> list[Any]:
        """Its optimizers (their ``param_groups`` and ``state``)."""
        ...

    @property
    def params_at_rest(self) -> int:
        """Parameters this rank holds before data-parallel sharding (``params_before_dp``)."""
        ...

    @property
    def meshes(self) -> Meshes | None:
        """The named meshes (the cp group's name labels its collectives); None in one
        process."""
        ...


@runtime_checkable
class MeasuredRun(Protocol):
    """What ``measure_step`` and ``step_figures`` use of a run: its config and layout, its
    engine, and a training step with memory probes (``moetrain.train.trainer.Trainer`` is
    one; tests/parallel/test_accounting.py checks it)."""

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def dims(self) -> ParallelDims: ...

    @property
    def engine(self) -> StepEngine: ...

    def probed_step(self, probe: Probe) -> Any:
        """Run one training step, calling ``probe(phase)`` after its forward, its backward and
        its optimizer step; return the step's result."""
        ...


@dataclass
class StepReport:
    """What one measured training step allocated and sent on this rank."""

    rank: int
    params_per_rank: int
    """Parameters this rank holds before data-parallel sharding (its TP shard, its stages)."""
    memory: dict[str, MemorySample] = field(default_factory=dict)
    activations: int = 0
    """Peak bytes of the tensors saved for backward during the step (``SavedActivations``)."""
    result: Any = None
    """What the run's ``probed_step`` returned (the trainer's StepResult)."""
    sent: dict[str, float] = field(default_factory=dict)
    sent_by_group: dict[str, dict[str, float]] = field(default_factory=dict)
    expert_flops: float = 0.0
    """Forward FLOPs of this rank's routed experts in the step, counted from the rows they
    received and the weight slices they hold (2 x rows x D x F per projection, 3 of them;
    recomputation under activation checkpointing counts again)."""

    @property
    def peak(self) -> MemorySample:
        return max(self.memory.values(), key=lambda s: s.total)

    def as_scalars(self) -> dict[str, float]:
        out = {f"comm/bytes_sent/{k}": v for k, v in self.sent.items()}
        peak = self.peak
        out.update(
            {
                "memory/model_state_bytes": float(peak.total),
                "memory/param_bytes": float(peak.params),
                "memory/grad_bytes": float(peak.grads),
                "memory/optim_bytes": float(peak.optim),
                "memory/activation_bytes": float(self.activations),
            }
        )
        return out


def measure_step(run: MeasuredRun) -> StepReport:
    """Run one training step of ``run`` under a ``CommCounter`` with memory probes after
    forward, backward and the optimizer step. Call it after a first step (Adam states exist)."""
    engine = run.engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    report = StepReport(rank, engine.params_at_rest)

    def probe(phase: str) -> None:
        report.memory[phase] = model_state_bytes(engine.parts, engine.optimizers)

    def count_expert_flops(module: Any, args: tuple, out: torch.Tensor) -> None:
        x_ND, offs_E = args[0], args[1]
        rows = int(offs_E[-1]) if offs_E.numel() else 0
        w1 = module.w1.to_local() if hasattr(module.w1, "to_local") else module.w1
        report.expert_flops += 3 * 2 * rows * x_ND.shape[1] * w1.shape[2]

    from moetrain.model.experts import GroupedExperts

    hooks = [
        m.register_forward_hook(count_expert_flops)
        for part in engine.parts
        for m in part.modules()
        if isinstance(m, GroupedExperts)
    ]
    try:
        with CommCounter() as counter, SavedActivations(engine.parts) as saved:
            report.result = run.probed_step(probe)
    finally:
        for h in hooks:
            h.remove()
    report.activations = saved.peak
    report.sent = counter.sent_by_kind()
    by_group: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in counter.records:
        by_group[r.group][r.kind] += r.sent
    report.sent_by_group = {g: dict(v) for g, v in by_group.items()}
    return report


def step_figures(run: MeasuredRun, report: StepReport) -> dict[str, Any]:
    """What ``measure_step`` measured on this rank beside the analytic figure for each: model
    state against the ZeRO formula, bytes sent by kind (and over the cp group) against
    ``analytic_sent``, saved activations with the whole-sequence K/V term cp keeps, expert
    FLOPs against ``analytic_expert_flops``. What tools/comm_report.py prints and
    tests/parallel/test_accounting.py asserts."""
    cfg, d, engine = run.cfg, run.dims, run.engine
    counts = layer_counts(engine.parts)
    zero = cfg.parallel.zero_stage if d.dp * d.cp > 1 else 0
    meshes = engine.meshes
    cp_group = meshes.cp.get_group().group_name if d.cp > 1 and meshes is not None else None
    params = report.params_per_rank
    optim_bytes = optimizer_state_bytes_per_param(engine.optimizers)
    return {
        "params": params,
        "memory": report.peak.total,
        "optim_bytes": optim_bytes,
        # Muon's matrices and the rest apart (optim.name=muon; the rest is all under AdamW)
        "optim_bytes_muon": optimizer_state_bytes_per_param(engine.optimizers, muon=True),
        "optim_bytes_rest": optimizer_state_bytes_per_param(engine.optimizers, muon=False),
        "formula": zero_bytes_per_param(zero, d.dp_shard * d.cp, optim_bytes=optim_bytes) * params,
        "zero": zero,
        "sent": report.sent,
        "sent_cp": report.sent_by_group.get(cp_group, {}) if cp_group else {},
        "analytic": analytic_sent(cfg, d, params, counts),
        "moe_layers": counts["moe"],
        "dense_layers": counts["dense"],
        "expert_flops": report.expert_flops,
        "expert_flops_analytic": analytic_expert_flops(cfg, d, counts["moe"]),
        "activations": report.activations,
        "kv": full_sequence_kv_bytes(
            cfg.model,
            d,
            d.micro_batch_size(cfg),
            cfg.data.seq_len,
            counts["dense"] + counts["moe"],
            cfg.parallel.activation_checkpointing,
        ),
        "cp": d.cp,
    }


def layer_counts(parts: list[torch.nn.Module]) -> dict[str, int]:
    """Dense and MoE layers of this rank's chunks, and how many of the embedding and the
    output it holds (the inputs of ``analytic_sent``)."""
    from moetrain.model.moe import MoELayer

    out = {"dense": 0, "moe": 0, "boundary": 0}
    for part in parts:
        for block in part.layers.values():
            is_moe = any(isinstance(m, MoELayer) for m in block.modules())
            out["moe" if is_moe else "dense"] += 1
        out["boundary"] += (part.tok_embeddings is not None) + (part.output is not None)
    return out
