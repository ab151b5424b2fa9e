"""The step's routing: what the engine tells the MoE layers through their step context
(routing replay and record, eval routing, the counting pass), the global-batch balancing
loss's step counts, and the routing records gathered into whole-batch tensors.

Global-batch balancing (``moe.global_aux_loss_coef``; the loss itself, whole, is
``moetrain.model.losses.GlobalBalanceLoss``): the loss of every micro-batch needs the
expert counts of the whole step (every micro-batch, every data-parallel rank) before its
backward. With one forward per rank and step and no pipeline, the counts of that forward are
summed over dp between forward and backward (``when_counted`` is "forward"); otherwise a
no-grad counting pass over the step's micro-batches (routing exactly as the training forward
will: same parameters, jitter keys and replayed ids) runs first ("pass"). Either way every
layout uses the same counts as one process on the whole global batch.

``RoutingPasses`` is a collaborator of ``moetrain.train.engine.Engine``: it is handed the
step context, the rank's MoE layers, the step's groups and what it needs of the step's shape;
the engine hands it a function that runs forwards when it asks for a counting pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from moetrain.model.moe import MoELayer
from moetrain.model.step_context import StepContext
from moetrain.train.batches import Batch
from moetrain.train.step_groups import StepGroups


@dataclass(frozen=True)
class RoutingShape:
    """What the routing passes need of the job: the step's global batch and sequence length
    (records), top-k, the model's layer count (eval routing leaves the multi-token-prediction
    modules out: they do not run in evaluation), whether the global-batch loss is on, and
    where this rank's tokens are in the run (router jitter: ``moetrain.model.jitter``)."""

    global_batch: int
    seq_len: int
    top_k: int
    n_layers: int
    global_balance: bool
    seed: int = 0
    """``train.seed``."""
    first_sequence: int = 0
    """The global index, in a step's global batch, of this rank's first sequence."""


def reduce_route_counts(counts_LE: torch.Tensor, dp_group: Any) -> None:
    """Sum the expert choices of a step over the data-parallel ranks (dp x cp), in place.
    Each rank counted its own tokens over all experts (on the source rank under expert
    parallelism; its own positions of every sequence under cp), and tensor-parallel ranks
    route the same tokens: dp x cp is exactly the dimension to sum over."""
    if dp_group is not None:
        dist.all_reduce(counts_LE, group=dp_group)


class RoutingPasses:
    """The routing side of a step (module doc). ``layers``: this rank's MoE layers by index;
    ``any_moe``: whether the whole model has MoE layers (under a pipeline every stage runs
    the counting pass, also one without an MoE layer: it is a schedule run)."""

    def __init__(
        self,
        context: StepContext,
        layers: dict[int, MoELayer],
        any_moe: bool,
        groups: StepGroups,
        shape: RoutingShape,
        device: torch.device,
    ) -> None:
        self.context = context
        self.layers = layers
        self.any_moe = any_moe
        self.groups = groups
        self.shape = shape
        self.device = device
        self._record_inputs: torch.Tensor | None = None

    # ------------------------------------------------------------------ a training step

    def begin_step(
        self,
        micro_batches: list[Batch],
        step: int,
        replay: dict[int, torch.Tensor] | None = None,
        record: bool = False,
    ) -> None:
        """Before the first forward of optimizer step ``step``: tell every MoE layer where
        the step's tokens are in the run (``MoELayer.set_jitter_key``), forget the previous
        step's counts; put the step's replayed routing (per MoE layer (global batch, S, K))
        in the context, and a record to fill when ``record``."""
        ctx, s = self.context, self.shape
        for layer in self.layers.values():
            layer.set_jitter_key(s.seed, step, s.first_sequence)
            layer.global_balance.begin_step()
        ctx.replay = None if replay is None else {
            i: replay[i].to(self.device) for i in self.layers}  # fmt: skip
        ctx.record = None
        if record:
            ctx.record = {
                i: torch.full((s.global_batch, s.seq_len, s.top_k), -1, dtype=torch.int64,
                              device=self.device)
                for i in self.layers
            }  # fmt: skip
        self._record_inputs = torch.cat([b["input_ids"] for b in micro_batches]) if record else None

    def end_step(self) -> None:
        """After a step's last backward: routers choose again."""
        self.context.replay = None

    def when_counted(
        self, micro_batches: int, breadth: int, pipelined: bool
    ) -> Literal["pass", "forward"] | None:
        """When the global-batch loss's step counts are known (module doc): after a counting
        "pass" before the step, after the step's one "forward" per rank, or None (no loss)."""
        if not (self.shape.global_balance and self.any_moe):
            return None
        return "forward" if not pipelined and micro_batches <= breadth else "pass"

    @torch.no_grad()
    def counting_pass(
        self,
        micro_batches: list[Batch],
        breadth: int,
        run_forwards: Callable[[list[Batch]], Any],
    ) -> None:
        """The step's expert counts before any backward: no-grad forwards of this rank's
        micro-batches in training mode, ``breadth`` at a time (``run_forwards``: the
        engine's, through the pipeline schedule or the local model), with the same routing
        as the training forwards (same parameters, jitter keys and replayed ids), counted by
        the MoE layers and summed over dp. Nothing else of it is kept: statistics, the
        sequence counter and byte counters are left as they were."""
        kept = {i: m.keep_counters() for i, m in self.layers.items()}
        self.context.counting = True
        try:
            for start in range(0, len(micro_batches), breadth):
                run_forwards(micro_batches[start : start + breadth])
        finally:
            self.context.counting = False
            for i, layer in self.layers.items():
                layer.restore_counters(kept[i])  # the training forwards start from sequence 0
        self.hand_over_counts()

    def hand_over_counts(self) -> None:
        """Sum every MoE layer's counted choices over dp and hand the sums to the layers'
        global-batch losses (before the step's first backward)."""
        ids = sorted(self.layers)
        if not ids:
            return
        counts = torch.stack([self.layers[i].global_balance.counts_E for i in ids])
        reduce_route_counts(counts, self.groups.dp)
        for i, c in zip(ids, counts, strict=True):
            self.layers[i].global_balance.set_step_counts(c)

    # ------------------------------------------------------------------ records

    @torch.no_grad()
    def routing_record(self) -> dict[str, Any] | None:
        """The routing of the last step begun with ``record`` (collective): on every rank
        ``{"input_ids": (global batch, S), "ids": {layer: (global batch, S, K)}}`` with every
        MoE layer of the model, gathered over dp and pp; None if not recorded."""
        records = self.context.record
        if self._record_inputs is None or records is None:
            return None
        for rec in records.values():  # each dp rank wrote its own rows; the others hold -1
            if self.groups.seq is not None:
                rec.add_(1)
                dist.all_reduce(rec, group=self.groups.seq)
                rec.sub_(1)
        inputs = self.groups.gather_dp(self._record_inputs.to(self.device))
        ids = self.groups.merge_stages(
            {i: r.to("cpu", torch.int16) for i, r in records.items()})
        self.context.record = None
        self._record_inputs = None
        return {"input_ids": inputs.cpu(), "ids": dict(sorted(ids.items()))}

    def start_eval_record(self) -> None:
        """Eval forwards from now on append their routing (``eval_routing`` reads it)."""
        self.context.eval_record = {i: [] for i in self.layers}

    def stop_eval_record(self) -> None:
        self.context.eval_record = None

    def eval_routing(self, micro_batches: list[Batch]) -> dict[str, Any]:
        """The eval forwards' routing since ``start_eval_record`` (collective): ``input_ids``
        (sequences, S) in the eval split's order and ``ids`` {layer: (sequences * S, K)} for
        every MoE layer of the model, gathered over dp and pp on every rank."""
        records = self.context.eval_record or {}
        mine = {  # multi-token-prediction modules do not run in evaluation
            i: torch.cat(records.get(i) or []).to(self.device, torch.int64)
            for i in self.layers
            if i < self.shape.n_layers
        }
        g = self.groups
        ids = {i: g.gather_dp(t).to("cpu", torch.int16) for i, t in sorted(mine.items())}
        inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(self.device)
        return {
            "input_ids": g.gather_dp(inputs).cpu(),
            "ids": dict(sorted(g.merge_stages(ids).items())),
        }
