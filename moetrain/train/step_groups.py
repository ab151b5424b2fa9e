"""The process groups of a step's own collectives, and the gathers the engine's collaborators
share: one frozen object handed to each of them (``moetrain.train.engine.Engine``), so none
reads another's attributes to find a group.

Losses, gradients and statistics are averaged or summed over dp x cp (``dp``: cp ranks hold
other tokens of the same sequences); records of whole sequences, which the MoE layers
already gathered over cp, are gathered over dp alone (``seq``); each pipeline stage holds
some layers (``pp``). All None in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepGroups:
    dp: Any = None
    """dp x cp: what losses, gradients and statistics are summed or averaged over."""
    seq: Any = None
    """dp alone: the ranks holding other sequences."""
    pp: Any = None
    """The pipeline stages."""
    dp_size: int = 1
    """Ranks of ``seq`` (dp)."""
    dp_cp_size: int = 1
    """Ranks of ``dp`` (dp x cp)."""
    pp_size: int = 1

    def mean_over_dp(self, value: torch.Tensor) -> float:
        """Mean over dp x cp: every rank's value is the mean over an equal number of tokens
        (its sequences, or its equal share of every sequence under cp)."""
        if self.dp is not None:
            value = value.clone()
            dist.all_reduce(value, group=self.dp)
            value /= self.dp_cp_size
        return float(value)

    def gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped per-rank tensors over dp in rank order (collective)."""
        if self.seq is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.dp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.seq)
        return torch.cat(parts)

    def merge_stages(self, mine: dict[str, Any]) -> dict[str, Any]:
        """Every pipeline stage's dict merged, on every stage (collective; ``mine`` itself
        without a pipeline)."""
        if self.pp is None:
            return mine
        gathered: list[Any] = [None] * self.pp_size
        dist.all_gather_object(gathered, mine, group=self.pp)
        return {k: v for d in gathered for k, v in d.items()}
