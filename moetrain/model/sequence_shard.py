"""The seam for context parallelism: a process that holds only part of every sequence.

Under context parallelism (``parallel.cp``) each process holds some positions of every
sequence of its micro-batch. Three things in the model depend on where its tokens are:

- RoPE needs each token's position (``Transformer`` reads them from the shard);
- attention needs the keys and values of the whole sequence (the attention's ``attend``
  function, installed by ``moetrain.parallel.context_parallel``);
- the MoE layer's capacity and balancing losses are defined per token group of whole
  sequences, and router jitter is keyed by position (``MoELayer`` gathers the routing
  decisions of the whole sequences through the shard before planning).

The model holds a ``SequenceShard`` (None: the process holds whole sequences) and never asks
how it communicates: ``moetrain.parallel.context_parallel.ContextShard`` implements it over
a process group, as the expert-parallel dispatchers implement ``Dispatcher``.

Shape legend: B sequences, s positions this process holds, S whole sequence, X any.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceShard(Protocol):
    seq_len: int
    """S: positions of a whole sequence."""

    def positions(self, device: torch.device) -> torch.Tensor:
        """int64 (s,): the position in its sequence of each token this process holds of
        every sequence, in the order it holds them (the same for every sequence)."""
        ...

    def gather(self, x_BsX: torch.Tensor) -> torch.Tensor:
        """(B, s, ...) of this process -> (B, S, ...) of the whole sequences in position order,
        the same on every process sharing them (collective; no gradient)."""
        ...
