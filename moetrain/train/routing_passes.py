"""The step's routing passes: the global-batch balancing loss's counting pass and the
routing records (training records and eval routing), gathered into whole-batch tensors.

Global-batch balancing (``moe.global_aux_loss_coef``): the loss of every micro-batch needs
the expert counts of the whole step (every micro-batch, every data-parallel rank) before its
backward. With one forward per rank and step and no pipeline, the counts of that forward are
summed over dp between forward and backward; otherwise a no-grad counting pass over the
step's micro-batches (routing exactly as the training forward will: same parameters, jitter
keys and replayed ids) runs first. Either way every layout uses the same counts as one
process on the whole global batch.

``RoutingPasses`` is a mixin of ``moetrain.train.engine.Engine``: it reads the engine's parts,
MoE layers, groups and step helpers (``_pipeline_step``, ``_loss_ctx``, ``_batch_inputs``,
``_set_jitter_keys``, ``_merge_stages``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Batch = dict[str, torch.Tensor]


def reduce_route_counts(counts_LE: torch.Tensor, dp_group: Any) -> None:
    """Sum the expert choices of a step over the data-parallel ranks (dp x cp), in place.
    Each rank counted its own tokens over all experts (on the source rank under expert
    parallelism; its own positions of every sequence under cp), and tensor-parallel ranks
    route the same tokens: dp x cp is exactly the dimension to sum over."""
    if dp_group is not None:
        dist.all_reduce(counts_LE, group=dp_group)


class RoutingPasses:
    """The counting pass and the routing records of ``Engine``."""

    @torch.no_grad()
    def _counting_pass(self, micro_batches: list[Batch]) -> None:
        """The step's expert counts before any backward: a no-grad forward of this rank's
        micro-batches in training mode (the same routing as the training forward: same
        parameters, jitter keys and replayed ids), counted by the MoE layers and summed over
        dp. Nothing else of it is kept: statistics, byte counters and the sequence counter
        are left as they were."""
        sent = {i: layer.dispatcher.bytes_sent for i, layer in self.moe.items()}
        for layer in self.moe.values():
            layer.counting = True
        try:
            for start in range(0, len(micro_batches), self.breadth):
                group = micro_batches[start : start + self.breadth]
                if self.schedule is not None:
                    self._pipeline_step(group, train=False)
                    continue
                for batch in group:
                    inputs, labels, kwargs = self._batch_inputs(batch)
                    with self._loss_ctx():
                        self._forward(self.parts[0], inputs, labels, kwargs)
        finally:
            for i, layer in self.moe.items():
                layer.counting = False
                layer.dispatcher.bytes_sent = sent[i]
        self._set_global_counts()
        self._set_jitter_keys()  # the training forwards start from the first sequence again
        for layer in self.moe.values():
            layer.route_counts.zero_()

    def _set_global_counts(self) -> None:
        """Sum every MoE layer's counted choices over dp and hand them to the layers."""
        ids = sorted(self.moe)
        if not ids:
            return
        counts = torch.stack([self.moe[i].route_counts for i in ids])
        reduce_route_counts(counts, self.dp_group)
        for i, c in zip(ids, counts, strict=True):
            self.moe[i].set_global_counts(c)

    @torch.no_grad()
    def routing_record(self) -> dict[str, Any] | None:
        """The routing of the last ``forward_backward(..., record=True)`` (collective): on
        every rank ``{"input_ids": (global batch, S), "ids": {layer: (global batch, S, K)}}``
        with every MoE layer of the model, gathered over dp and pp; None if not recorded."""
        if self._record_inputs is None:
            return None
        layers = {i: layer.record_BSK for i, layer in self.moe.items()}
        for rec in layers.values():  # each dp rank wrote its own rows; the others hold -1
            if self.seq_group is not None:
                rec.add_(1)
                dist.all_reduce(rec, group=self.seq_group)
                rec.sub_(1)
        inputs = self._gather_dp(self._record_inputs.to(self.device))
        ids = self._merge_stages({i: r.to("cpu", torch.int16) for i, r in layers.items()})
        for layer in self.moe.values():
            layer.record_BSK = None
        self._record_inputs = None
        return {"input_ids": inputs.cpu(), "ids": dict(sorted(ids.items()))}

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped per-rank tensors over dp in rank order (collective)."""
        if self.seq_group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.dims.dp)]
        dist.all_gather(parts, t.contiguous(), group=self.seq_group)
        return torch.cat(parts)

    def _eval_routing(self, micro_batches: list[Batch]) -> dict[str, Any]:
        mine = {  # multi-token-prediction modules do not run in evaluation
            i: torch.cat(layer.eval_record or []).to(self.device, torch.int64)
            for i, layer in self.moe.items()
            if i < self.cfg.model.n_layers
        }
        ids = {i: self._gather_dp(t).to("cpu", torch.int16) for i, t in sorted(mine.items())}
        inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(self.device)
        return {
            "input_ids": self._gather_dp(inputs).cpu(),
            "ids": dict(sorted(self._merge_stages(ids).items())),
        }
