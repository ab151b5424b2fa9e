"""A step's micro-batches as the model takes them on this rank: its positions of every
sequence (context parallelism), the labels that count, the model's keyword inputs, and the
scale that makes the step's loss the mean over its counted labels under document masking.

``MicroBatchInputs`` is a collaborator of ``moetrain.train.engine.Engine``, handed what it
reads: ``model.document_mask``, this rank's positions of a sequence (None: all), the device,
and the groups the labels are counted over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetrain.model.masks import document_ids
from moetrain.model.mtp import IGNORE_INDEX
from moetrain.train.step_groups import StepGroups

Batch = dict[str, torch.Tensor]


def counted_labels(batch: Batch, document_mask: bool) -> torch.Tensor:
    """A micro-batch's labels with the positions left out of the loss set to
    ``IGNORE_INDEX``: those already so (padding) and, under document masking, every
    document's separator (``doc_ends``)."""
    labels = batch["labels"]
    ends = batch.get("doc_ends")
    if document_mask and ends is not None:
        labels = labels.masked_fill(ends.to(labels.device, torch.bool), IGNORE_INDEX)
    return labels


class MicroBatchInputs:
    def __init__(
        self,
        document_mask: bool,
        seq_index: torch.Tensor | None,
        device: torch.device,
        groups: StepGroups,
    ) -> None:
        self.document_mask = document_mask
        self.seq_index = seq_index
        self.device = device
        self.groups = groups

    def of(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(this rank's input tokens, its labels, the model's keyword inputs) of a
        micro-batch, on the device. Keyword inputs cover the whole sequences (every cp rank
        needs the keys' documents): ``documents`` under document masking, and ``valid``
        (the labels that count) when some do not."""
        document_mask = self.document_mask
        labels = counted_labels(batch, document_mask)
        kwargs: dict[str, torch.Tensor] = {}
        ends = batch.get("doc_ends")
        if document_mask and ends is not None:
            kwargs["documents"] = document_ids(ends).to(self.device, non_blocking=True)
        valid = labels != IGNORE_INDEX
        if document_mask or not bool(valid.all()):
            kwargs["valid"] = valid.to(self.device, non_blocking=True)
        inputs = self.local_tokens(batch["input_ids"]).to(self.device, non_blocking=True)
        return inputs, self.local_tokens(labels).to(self.device, non_blocking=True), kwargs

    def local_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """This rank's positions of every sequence (context parallelism), or all of them."""
        return tokens_BS if self.seq_index is None else tokens_BS[:, self.seq_index]

    def loss_scale(self, micro_batches: list[Batch]) -> float | None:
        """Under document masking, each micro-batch's summed cross-entropy times
        ``len(micro_batches) * dp_cp / V`` (V: the counted labels of the whole step, over
        every data-parallel rank; collective) makes the step's loss and gradient the mean
        over its counted labels, whatever the layout: the usual averaging over
        micro-batches and dp x cp ranks then sums the shares. Otherwise None: a micro-batch's
        loss is the mean over its counted labels (all of them unless the batch pads)."""
        if not self.document_mask:
            return None
        count = sum(int((counted_labels(b, True) != IGNORE_INDEX).sum()) for b in micro_batches)
        total = torch.tensor(float(count), dtype=torch.float64, device=self.device)
        if self.groups.seq is not None:  # whole sequences: cp ranks counted the same ones
            dist.all_reduce(total, group=self.groups.seq)
        n = float(total)
        return len(micro_batches) * self.groups.dp_cp_size / n if n else 0.0
