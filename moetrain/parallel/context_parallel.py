"""Context parallelism: every sequence split over ``parallel.cp`` ranks along the sequence.

The split. A sequence of S positions is cut into 2 cp equal chunks; cp rank c holds chunk c
and chunk 2 cp - 1 - c (Megatron-Core's and torch's ``_load_balance`` order), so that every
rank holds an early and a late part of each sequence and does the same share of the causal
attention's work (with plain contiguous chunks the last rank would do cp times the first
one's). The engine cuts each micro-batch with ``sequence_index``; the data layer is not
involved (the cp ranks of a data-parallel rank read the same sequences).

Attention. Each rank computes queries, keys and values of its own tokens (RoPE at their true
positions), then all-gathers the keys and values of the whole sequence over the cp group
(before the grouped-query repeat: kv heads only), puts them in position order and attends
under the mask the model built for the rank's positions (``moetrain.model.masks``: causal by
position, and per document or within a sliding window when configured; the document
indices are those of the whole sequences, which every cp rank of a sequence holds). Exact:
every query sees exactly the keys it sees in one process. Backward reduce-scatters the keys'
and values' gradients. Per layer and micro-batch a rank sends (cp - 1)/cp of the whole
sequence's K and V forward, and as much back (``analytic_cp_bytes``); it holds the whole
sequence's K and V (and a 1/cp slice of the score matrix) while its layer runs. torch's
context-parallel SDPA dispatches to the CUDA flash / efficient kernels and does not run on
gloo (CPU); this small autograd implementation (the all-gather variant, as Llama 3 trained
with) runs everywhere.

MoE. Routing is per token, but capacity and the balancing statistics are defined per token
group of whole sequences: every MoE layer all-gathers its tokens' expert choices (and,
to drop by score, their scores: T x K each, small) over the cp group and plans with the
whole groups' ranking (``moetrain.model.dispatch.plan_dispatch_sharded``), so a cp run drops
exactly the assignments one process drops; the switch losses' f counts the whole groups'
choices. Router jitter is keyed by each token's true position.

Gradients and losses. Parameters are replicated over cp; each rank's loss is the mean over
its own tokens, an equal share of each sequence, so the mean of the cp ranks' losses is the
whole sequences' mean, and gradients are averaged over dp x cp (the engine's ``dp_cp``
group; ZeRO shards over dp_shard x cp).

The model never sees a process group: ``apply_cp`` installs the attention function and
returns a ``ContextShard`` (the ``moetrain.model.sequence_shard.SequenceShard`` seam), which
the caller puts in the model's step context (``StepContext.seq_shard``: RoPE, router jitter
and the MoE layers read it there).

Shape legend: B batch, s positions this rank holds, S whole sequence, H heads, Dh head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.attention import Attention, LatentAttention
from moetrain.model.ep_dispatch import AllGatherFunction
from moetrain.model.masks import AttentionMask, attend


def sequence_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """int64 positions cp rank ``rank`` holds of a ``seq_len`` sequence: chunks ``rank`` and
    ``2 cp - 1 - rank`` of 2 cp equal chunks, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"a sequence of {seq_len} positions does not split into 2 * cp = {2 * cp} equal chunks"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat((first, second))


def gather_order(seq_len: int, cp: int) -> torch.Tensor:
    """The index that puts the cp ranks' tokens, concatenated rank after rank, in position
    order."""
    held = torch.cat([sequence_index(seq_len, cp, r) for r in range(cp)])
    return torch.argsort(held)


def _gather_seq_first(x_sBX: torch.Tensor, group: Any) -> torch.Tensor:
    out = x_sBX.new_empty((dist.get_world_size(group) * x_sBX.shape[0], *x_sBX.shape[1:]))
    dist.all_gather_into_tensor(out, x_sBX.contiguous(), group=group)
    return out


class ContextShard:
    """The ``SequenceShard`` of one cp rank: its positions of every ``seq_len`` sequence and
    the gather of whole sequences over ``group``."""

    def __init__(self, group: Any, seq_len: int) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len = seq_len
        self._positions = sequence_index(seq_len, self.cp, self.rank)
        self._order = gather_order(seq_len, self.cp)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self._positions.to(device), self._order.to(device))
        return self._on[device]

    def positions(self, device: torch.device) -> torch.Tensor:
        return self._tables(device)[0]

    def order(self, device: torch.device) -> torch.Tensor:
        return self._tables(device)[1]

    def check(self, local_len: int) -> None:
        if local_len * self.cp != self.seq_len:
            raise ValueError(
                f"context parallelism: {local_len} positions of each sequence on this rank, "
                f"expected data.seq_len / parallel.cp = {self.seq_len} / {self.cp}"
            )

    @torch.no_grad()
    def gather(self, x_BsX: torch.Tensor) -> torch.Tensor:
        self.check(x_BsX.shape[1])
        x_sBX = x_BsX.transpose(0, 1)
        whole = _gather_seq_first(x_sBX, self.group)
        return whole.index_select(0, self.order(x_BsX.device)).transpose(0, 1)


class ContextParallelAttention:
    """The ``attend`` function of an attention module under context parallelism: this
    rank's queries over the keys and values of the whole sequence (all-gathered over the cp
    group with autograd: backward reduce-scatters their gradients), under the mask the model
    built for this rank's positions (causal by position, and per document or sliding window
    when configured: ``moetrain.model.masks``)."""

    def __init__(self, shard: ContextShard) -> None:
        self.shard = shard

    def __call__(
        self,
        q_BsHD: torch.Tensor,
        k_BsHD: torch.Tensor,
        v_BsHD: torch.Tensor,
        scale: float | None,
        mask: AttentionMask,
        sinks_H: torch.Tensor | None = None,
        max_logits: bool = False,
    ) -> Any:
        if mask.q_pos is None or mask.kv_len != self.shard.seq_len:
            raise ValueError(
                "context parallelism: the attention mask is not one of this rank's positions "
                "of whole sequences (a KV cache, or a model without the shard)"
            )
        self.shard.check(q_BsHD.shape[1])
        order = self.shard.order(q_BsHD.device)
        k_BSHD, v_BSHD = (
            AllGatherFunction.apply(t.transpose(0, 1), self.shard.group)
            .index_select(0, order)
            .transpose(0, 1)
            for t in (k_BsHD, v_BsHD)
        )
        return attend(q_BsHD, k_BSHD, v_BSHD, scale, mask, sinks_H, max_logits)


def apply_cp(model: nn.Module, cp_mesh: Any, seq_len: int) -> ContextShard | None:
    """Context parallelism on ``model`` (a Transformer or a pipeline chunk of one) over
    ``cp_mesh`` (1-D), for sequences of ``seq_len`` positions: every attention's ``attend``
    replaced by ``ContextParallelAttention``. Returns the ``ContextShard``, which the model
    reads from its step context (``StepContext.seq_shard``, set by the engine): RoPE at this
    rank's positions, every MoE layer planning over whole sequences. A no-op (None) at
    cp = 1. Call it before activation checkpointing wraps the attention modules."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return None
    shard = ContextShard(cp_mesh.get_group(), seq_len)
    for block in model.layers.values():
        attention = block.attention
        if not isinstance(attention, Attention | LatentAttention):
            raise TypeError(f"apply_cp: unexpected attention module {type(attention).__name__}")
        attention.attend = ContextParallelAttention(shard)
    return shard


def analytic_cp_bytes(
    micro_batch_size: int,
    seq_len: int,
    cp: int,
    kv_elems_per_token: int,
    routing_bytes_per_token: int,
    n_attention: int,
    n_moe: int,
    micro_batches: int,
    recomputed_attention: int = 0,
    recomputed_moe: int = 0,
    bytes_per_elem: int = 4,
) -> float:
    """Bytes one cp rank sends in one step (ring all-gather / reduce-scatter: (cp - 1)/cp of
    the whole tensor): per micro-batch and attention layer the whole sequence's keys and
    values gathered forward and their gradients reduce-scattered backward (plus one more
    gather per recomputed attention under activation checkpointing); per MoE layer the
    routing decisions of the whole sequences gathered forward (and again when recomputed).
    ``kv_elems_per_token``: K + V elements of one token on this rank (its tp share of the kv
    heads); ``routing_bytes_per_token``: top_k * (8 for the int64 ids + 4 for the fp32
    scores when dropping by score)."""
    frac = (cp - 1) / cp
    tokens = micro_batch_size * seq_len
    kv = tokens * kv_elems_per_token * bytes_per_elem * frac
    route = tokens * routing_bytes_per_token * frac
    per_mb = kv * (2 * n_attention + recomputed_attention) + route * (n_moe + recomputed_moe)
    return micro_batches * per_mb
