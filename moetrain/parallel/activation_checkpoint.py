"""Activation checkpointing: recompute activations in backward instead of keeping them.

    none       keep everything
    selective  recompute the attention of every block (the ``5 a s / h`` term of the
               activation-memory formula, cheap to recompute next to the MoE FFN)
    full       recompute every block: only block inputs are kept

MoE layers record router statistics as a side effect of forward; a recomputed forward
would count them twice, so the recompute runs inside a context that restores those buffers
afterwards (the injected aux-loss gradient is recomputed like any other activation).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moetrain.model.moe import MoELayer


def _moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


@contextmanager
def _note_rows(module: nn.Module, rows: list[torch.Tensor]):
    """Around the original forward: remember each MoE layer's sequence counter as it was
    (router jitter is keyed by it, ``MoELayer.set_jitter_key``)."""
    rows[:] = [m.stat_rows.clone() for m in _moe_layers(module)]
    yield


@contextmanager
def _keep_moe_stats(module: nn.Module, rows: list[torch.Tensor]):
    """Recomputing a block in backward must not count its MoE statistics twice: snapshot
    every ``stat_*`` buffer (and the dispatcher's byte counter) and restore them after. The
    recompute itself starts from the sequence counter of the original forward, so that it
    draws the same router jitter and routes exactly as the forward did."""
    layers = _moe_layers(module)
    saved = [
        (
            {n: b.clone() for n, b in m.named_buffers(recurse=False) if n.startswith("stat_")},
            getattr(m.dispatcher, "bytes_sent", None),
        )
        for m in layers
    ]
    for m, before in zip(layers, rows, strict=True):
        m.stat_rows.copy_(before)
    try:
        yield
    finally:
        for m, (buffers, bytes_sent) in zip(layers, saved, strict=True):
            for name, value in buffers.items():
                getattr(m, name).copy_(value)
            if bytes_sent is not None:
                m.dispatcher.bytes_sent = bytes_sent


def _wrap(module: nn.Module) -> nn.Module:
    def contexts():
        rows: list[torch.Tensor] = []
        return _note_rows(module, rows), _keep_moe_stats(module, rows)

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
