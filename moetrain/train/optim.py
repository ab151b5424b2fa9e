"""The optimizer of a model chunk -- AdamW (``moetrain.train.adamw``) or Muon with AdamW
(``moetrain.train.muon``), ``optim.name`` -- with its parameter groups, the warm-up + cosine
schedule, gradient clipping.

Schedule convention: the learning rate used by optimizer step ``s`` (0-based, i.e. the number of
steps already taken, which is ``scheduler.last_epoch`` while that step runs) is

    s <  warmup:           lr * (s + 1) / (warmup + 1)
    s >= warmup, cosine:   lr * (m + (1 - m) * (1 + cos(pi * p)) / 2),
                           p = min(1, (s - warmup) / max(1, total_steps - warmup))
    s >= warmup, constant: lr

with ``m = min_lr_ratio``. The warm-up never uses a zero learning rate (a step at lr 0 would be a
wasted step) and reaches exactly ``lr`` at ``s = warmup``; the cosine reaches ``m * lr`` at
``s = total_steps`` and stays there if training runs longer. The trainer calls
``optimizer.step()`` then ``scheduler.step()`` once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from moetrain.config import OptimConfig
from moetrain.model.experts import GroupedExperts
from moetrain.train.adamw import AdamW, BF16MomentsAdamW, adamw
from moetrain.train.muon import build_muon, muon_matrices

__all__ = [
    "AdamW",
    "BF16MomentsAdamW",
    "WarmupCosine",
    "adamw",
    "build_from_groups",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm_",
    "optimizer_groups",
    "param_groups",
]


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split the trainable parameters into (decayed, not decayed).

    Weight matrices and higher (linear weights, embeddings, the E x D x F expert weights, the
    router's gate) are decayed; norm weights and biases are not, whatever their shape -- the
    routed experts' (E, F) and (E, D) biases (``GroupedExperts.BIASES``) included, as
    Megatron-Core and torchtitan exempt them --, nor the 1-D attention sinks: decaying a gain
    or an offset towards 0 fights what it parameterises. The router's expert-selection bias is
    a buffer, not a parameter, so it never reaches the optimizer. Frozen parameters are left
    out; tied parameters appear once (``named_parameters`` deduplicates them).
    """
    biases = {
        id(b)
        for m in model.modules()
        if isinstance(m, GroupedExperts)
        for b in (getattr(m, name) for name in m.BIASES)
        if b is not None
    }
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # DTensor parameters (FSDP2 / TP) report their global ndim, so the split does not
        # depend on the parallel layout.
        (decay if p.ndim >= 2 and id(p) not in biases else no_decay).append(p)
    return decay, no_decay


def optimizer_groups(model: nn.Module, cfg: OptimConfig) -> list[list[nn.Parameter]]:
    """The parameter groups of ``build_optimizer``, in its order: AdamW's (decayed, not
    decayed), then under ``optim.name=muon`` Muon's matrices (``muon_matrices``), which leave
    AdamW's groups."""
    decay, no_decay = param_groups(model)
    if cfg.name != "muon":
        return [decay, no_decay]
    chosen = muon_matrices(model, cfg)
    return [
        [p for p in decay if id(p) not in chosen],
        [p for p in no_decay if id(p) not in chosen],
        [p for p in decay if id(p) in chosen],
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, **muon: Any) -> torch.optim.Optimizer:
    """The optimizer of ``model``'s trainable parameters, with its groups always in this
    order:

    group 0: weight matrices (>= 2-D, not biases), ``weight_decay = cfg.weight_decay``
    (AdamW);
    group 1: norm weights and biases (``param_groups``), ``weight_decay = 0`` (AdamW);
    group 2: under ``optim.name=muon`` only, the matrices Muon updates (taken out of group 0).

    Every group exists even when it is empty, so group indices (and checkpointed optimizer
    state) do not depend on the model. ``fused``/``foreach`` are left to torch's defaults.
    ``muon``: keyword arguments of ``moetrain.train.muon.build_muon`` (how sharded matrices
    are made whole).
    """
    groups = optimizer_groups(model, cfg)
    if not any(groups):
        raise ValueError("build_optimizer: the model has no trainable parameters")
    return build_from_groups(groups, cfg, **muon)


def build_from_groups(
    groups: list[list[torch.Tensor]], cfg: OptimConfig, **muon: Any
) -> torch.optim.Optimizer:
    """``build_optimizer``'s optimizer over any tensors grouped as ``optimizer_groups``
    groups them (model parameters, or ZeRO-1's flat slices of them)."""
    if cfg.name != "muon":
        return adamw(*groups, cfg)
    return build_muon(*groups, cfg, **muon)


class WarmupCosine:
    """The learning-rate multiplier of step ``s`` (see the module docstring for the formula).

    A small class rather than a closure: ``LambdaLR.state_dict()`` stores a callable object's
    ``__dict__`` (plain ints, floats and a str here), so the scheduler state saves with
    ``torch.save`` and loads under ``weights_only=True``, and a resumed run continues the exact
    schedule it was saved with.
    """

    def __init__(
        self,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float,
        schedule: Literal["cosine", "constant"] = "cosine",
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        self.schedule = str(schedule)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def __repr__(self) -> str:
        return (
            f"WarmupCosine(warmup_steps={self.warmup_steps}, total_steps={self.total_steps}, "
            f"min_lr_ratio={self.min_lr_ratio}, schedule={self.schedule!r})"
        )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine (or constant) decay, one multiplier shared by all groups.

    Creating the scheduler already sets the groups' lr to the step-0 value. Its
    ``state_dict()`` holds only plain values (base lrs, step counter, the schedule's
    parameters); loading it restores the saved schedule, including ``total_steps``.
    """
    fn = WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio, cfg.schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients of ``params``, clipping them to ``max_norm`` first.

    ``max_norm=None`` only measures. A non-finite norm is returned as is and the gradients are
    left untouched (clipping with a nan/inf norm would turn them all into nan or zeros); whether
    to skip the step is the trainer's decision. Parameters without a gradient are ignored.
    With DTensor gradients the norm is reduced over their mesh (``full_tensor``); reducing over
    pipeline stages is the caller's job.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    # foreach=None: torch's fused multi-tensor path wherever the device supports it.
    total = torch.nn.utils.get_total_norm(
        grads, norm_type=2.0, error_if_nonfinite=False, foreach=None
    )
    # A DTensor norm is read out whole for the float, but handed to torch's clipping as is,
    # the way torch.nn.utils.clip_grad_norm_ does, so it scales DTensor gradients.
    full_tensor = getattr(total, "full_tensor", None)
    norm = float(full_tensor() if full_tensor is not None else total)
    if max_norm is not None and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
    return norm
