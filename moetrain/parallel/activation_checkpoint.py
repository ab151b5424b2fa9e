"""Activation checkpointing: recompute activations in backward instead of keeping them.

    none       keep everything
    selective  recompute the attention of every block (the ``5 a s / h`` term of the
               activation-memory formula, cheap to recompute next to the MoE FFN)
    full       recompute every block: only block inputs are kept

MoE layers count router statistics as a side effect of forward (``MoELayer.stats``, a
``moetrain.model.moe_stats.MoEStats``); a recomputed forward would count them twice, so the
recompute runs inside a context that snapshots that object and restores it afterwards, and
starts from the sequence counter of the original forward so that it routes as the forward
did (the injected aux-loss gradient is recomputed like any other activation).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moetrain.model.moe import MoELayer


def _moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


class _NoteRows:
    """Around the original forward: remember each MoE layer's sequence counter as it was
    (``MoEStats.rows``: router jitter, routing replay and record are keyed by it)."""

    def __init__(self, layers: list[MoELayer], rows: list[torch.Tensor]) -> None:
        self.layers, self.rows = layers, rows

    def __enter__(self) -> None:
        self.rows[:] = [m.stats.rows.clone() for m in self.layers]

    def __exit__(self, *exc: object) -> None:
        return None


class _KeepMoEStats:
    """Around each recomputation in backward: a recomputed block must not count its MoE
    statistics twice, so each layer's ``MoEStats`` (and its dispatcher's byte counter) is
    snapshotted and restored after; the recompute starts from the sequence counter of the
    original forward, so that it draws the same router jitter and routes as the forward did.
    Re-enterable: zero-bubble schedules recompute a block twice, once for the input gradient
    and once for the weight gradient."""

    def __init__(self, layers: list[MoELayer], rows: list[torch.Tensor]) -> None:
        self.layers, self.rows = layers, rows
        self.saved: list[list[tuple[dict[str, torch.Tensor], float]]] = []

    def __enter__(self) -> None:
        self.saved.append([m.keep_counters() for m in self.layers])
        for m, before in zip(self.layers, self.rows, strict=True):
            m.stats.rows.copy_(before)

    def __exit__(self, *exc: object) -> None:
        for m, kept in zip(self.layers, self.saved.pop(), strict=True):
            m.restore_counters(kept)


def _wrap(module: nn.Module) -> nn.Module:
    layers = _moe_layers(module)

    def contexts() -> tuple[_NoteRows, _KeepMoEStats]:
        rows: list[torch.Tensor] = []  # one per checkpointed call, shared by its two contexts
        return _NoteRows(layers, rows), _KeepMoEStats(layers, rows)

    return checkpoint_wrapper(module, preserve_rng_state=True, context_fn=contexts)


def apply_ac(model: nn.Module, mode: Literal["none", "selective", "full"]) -> None:
    """Wrap blocks (full) or their attention (selective) of ``model`` in place. Parameter
    names are unchanged in state dicts (the wrapper's prefix is stripped by torch)."""
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            model.layers[name] = _wrap(block)
        else:
            block.attention = _wrap(block.attention)


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """torch.compile each block (the repeated unit) in place."""
    if not enabled:
        return
    import torch

    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block)
