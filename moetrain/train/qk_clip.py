"""QK-clip (``optim.qk_clip``, Kimi K2's MuonClip): after the optimizer step, the query and key
projections of every attention head whose largest pre-softmax logit of the step exceeded the
threshold tau are rescaled so that those logits would end at tau.

The attention modules record their (local) heads' maxima in the step's training forwards
(``moetrain.model.attention.MaxLogits``). ``QKClip`` puts them in one (attention layers,
heads) table at their global head indices -- a tensor-parallel rank holds heads
``tp_rank x H / tp`` onwards -- and takes its maximum over every rank in one all-reduce: data
and context parallel ranks saw other tokens, tensor parallel ranks other heads, pipeline
stages other layers, and ranks holding the same logits agree. Each rank then rescales the
layers it holds by gamma_h = tau / max_h for the heads above tau (1 elsewhere: a product by
1.0 leaves a weight bit for bit), as the module says per row of each projection
(``qk_clip_scales``), on whatever shard of it this rank keeps (tensor parallel, FSDP, both:
the factors are laid out as the parameter is). ZeRO-1's slices share the model's storage,
and every rank rescales the same way, so replicas stay equal. Optimizer states are left as
they are, as in K2.

Cost per step: the logits' maxima from the attention pass itself (no second pass), one
all-reduce of (attention layers x heads) fp32 values, and one product over each clipped
layer's query and key weights. ``QKClip`` is a collaborator of
``moetrain.train.engine.Engine``, handed the rank's model chunks, every attention layer's
index, the head count, tau and the rank's tensor parallel coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moetrain.model.attention import MaxLogits
from moetrain.parallel.data_parallel import by_layer


def scale_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """``param *= rows`` along its first dimension, in place, on whatever part of it this
    rank holds (a DTensor's shard: the factors are distributed as the parameter is, each rank
    taking its own part of the full factors it computed, without communication). The
    factors are one column, broadcast over the rest; laid out at the parameter's full size
    only where a placement splits another dimension than the rows."""
    factors = rows.to(param.dtype).view(-1, *([1] * (param.dim() - 1)))
    if isinstance(param, DTensor):
        if any(p.is_shard() and p.dim != 0 for p in param.placements):
            factors = factors.expand(param.shape).contiguous()
        factors = distribute_tensor(factors, param.device_mesh, param.placements,
                                    src_data_rank=None)  # fmt: skip
    param.mul_(factors)


class QKClip:
    def __init__(
        self,
        parts: Sequence[nn.Module],
        layer_ids: Sequence[int],
        n_heads: int,
        tau: float,
        tp_rank: int,
        device: torch.device,
    ) -> None:
        # Every attention module of the rank's chunks (multi-token prediction's included:
        # layers n_layers and on).
        self.layers: dict[int, MaxLogits] = by_layer(parts, MaxLogits)
        self.rows = {layer: row for row, layer in enumerate(sorted(layer_ids))}
        self.n_heads = n_heads
        self.tau = tau
        self.tp_rank = tp_rank
        self.device = device
        self.last: torch.Tensor | None = None
        """The last step's (layers, heads) maxima over the job (``-inf``: nothing recorded),
        on the device."""

    def reset(self) -> None:
        """Forget what the modules recorded (forwards that are not a step's)."""
        for module in self.layers.values():
            module.pop_max_logits()

    @torch.no_grad()
    def gather(self) -> torch.Tensor:
        """Every attention head's largest logit of the step over the job, (layers, heads):
        each rank's record at its global head indices, then a max over every rank. The
        modules' records are popped."""
        table = torch.full((len(self.rows), self.n_heads), -math.inf, device=self.device)
        for layer, module in self.layers.items():
            max_H = module.pop_max_logits()
            if max_H is not None:
                lo = self.tp_rank * max_H.numel()
                table[self.rows[layer], lo : lo + max_H.numel()] = max_H.to(table.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.last = table
        return table

    def factors(self, table: torch.Tensor) -> torch.Tensor:
        """gamma per head: tau / max where the maximum exceeds tau, else 1."""
        return torch.where(table > self.tau, self.tau / table, torch.ones_like(table))

    @torch.no_grad()
    def step(self, update: bool) -> None:
        """After the optimizer step: gather the maxima, and when the step ``update``d the
        parameters rescale the heads above tau (a skipped step only clears the records)."""
        table = self.gather()
        if not update or math.isinf(self.tau):
            return
        gamma = self.factors(table)
        for layer, module in self.layers.items():
            for name, rows in module.qk_clip_scales(gamma[self.rows[layer]]).items():
                scale_rows(module.get_parameter(name), rows)

    def per_layer(self) -> dict[int, float]:
        """The last step's largest logit of each attention layer (over its heads), on the
        host (one copy), for the logs."""
        if self.last is None:
            return {}
        host = self.last.amax(dim=1).cpu()
        return {layer: float(host[row]) for layer, row in self.rows.items()}
