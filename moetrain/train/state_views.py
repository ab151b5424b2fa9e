"""The engine's checkpoint views: model and optimizer state under full-model names, the same
keys under every layout (DCP reshards them on load), and the way back.

``CheckpointViews`` is a collaborator of ``moetrain.train.engine.Engine``, handed what it
reads: the rank's model chunks, their optimizers and schedulers, the ZeRO-1 gradient sync,
the meshes and the parallel and optimizer config sections. ZeRO-1's flat optimizer slices are
saved through full-size shadows (``moetrain.train.zero1_state``); expert slices under expert
parallelism as DTensor views over the EP (and TP) mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from moetrain.config import OptimConfig, ParallelConfig
from moetrain.parallel.data_parallel import GradientSync
from moetrain.parallel.dims import Meshes
from moetrain.parallel.expert_parallel import expert_layouts
from moetrain.train.tensors import MOMENTS
from moetrain.train.zero1_state import zero1_restore, zero1_shadow

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointViews:
    """Checkpoint views of a rank's model chunks (``parts``) and their ``optimizers`` (one
    per chunk, or ZeRO-1's over ``grad_sync``'s slices when ``zero_stage`` is 1)."""

    def __init__(
        self,
        parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        grad_sync: GradientSync | None,
        zero_stage: int,
        meshes: Meshes | None,
        has_experts: bool,
        parallel: ParallelConfig,
        optim: OptimConfig,
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.grad_sync = grad_sync
        self.zero_stage = zero_stage
        self.meshes = meshes
        self.has_experts = has_experts
        self.parallel = parallel
        self.optim = optim
        self.device = device
        # ZeRO-1's gathered shadows between ``app_state`` and ``load_app_state``.
        self._shadows: list[torch.optim.Optimizer] | None = None

    def _part_optimizers(self) -> list[torch.optim.Optimizer]:
        """Per model chunk, the optimizer whose state dict a checkpoint holds: the live ones,
        or ZeRO-1's gathered shadows."""
        if self.zero_stage != 1:
            return self.optimizers
        return zero1_shadow(self.grad_sync, self.optimizers, self.parts, self.optim, self.device)

    def app_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by full-model names (flattened optimizer state), the
        same keys under every layout: DCP reshards them on load."""
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        self._shadows = self._part_optimizers()
        for part, opt in zip(self.parts, self._shadows, strict=True):
            model_sd.update(get_model_state_dict(part))
            optim_sd.update(get_optimizer_state_dict(part, opt, options=FLAT))
        # Expert parallelism: each rank holds a slice of every expert tensor under the full
        # model's name. Saved as DTensor views (no copy) sharded over the EP mesh (and the
        # FFN width over TP under expert TP), DCP writes each slice at its offset in the
        # full (E, ...) tensor and reads any other slicing back: the checkpoint loads under
        # any ep (ep = 1 included, where these are plain full tensors).
        for full_name, mesh, placements in self._expert_layouts():
            for sd, key in (
                (model_sd, full_name),
                *((optim_sd, f"state.{full_name}.{k}") for k in MOMENTS),
            ):
                if key in sd and not isinstance(sd[key], DTensor):
                    sd[key] = DTensor.from_local(sd[key], mesh, placements, run_check=False)
        return {"model": model_sd, "optim": optim_sd}

    def _expert_layouts(self) -> list[tuple[str, Any, tuple[Any, ...]]]:
        """(full-model name, mesh, placements) of each expert parameter of this rank."""
        if not self.has_experts:
            return []
        found = expert_layouts(self.parts, self.meshes, self.parallel)
        return [(name, mesh, placements) for name, (mesh, placements) in found.items()]

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer half of ``app_state()`` (ZeRO-1's shadows not kept for a load)."""
        state = self.app_state()["optim"]
        self._shadows = None
        return state

    def load_app_state(self, state: dict[str, Any]) -> None:
        """Load what ``app_state()`` returned after DCP filled it."""
        shadows = self._shadows
        assert shadows is not None, "load_app_state: call app_state() first"
        experts = {full_name for full_name, _, _ in self._expert_layouts()}
        expert_keys = experts | {f"state.{f}.{k}" for f in experts for k in MOMENTS}
        for sd in (state["model"], state["optim"]):  # the expert DTensor views: local again
            for key, value in sd.items():
                if key in expert_keys and isinstance(value, DTensor):
                    # A copy: DCP may hand back a view that partly overlaps the parameter it
                    # is loaded into (seen with one expert per rank sharded over ep and the
                    # FFN width over tp), which the copy into the parameter refuses.
                    sd[key] = value.to_local().clone()
        seen: set[str] = set()
        for part, opt in zip(self.parts, shadows, strict=True):
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in keys})
            # A name two chunks of this rank hold (the embedding and the last stage's copy of
            # it under the V schedules): the optimizer keeps the tensors it is given, so the
            # second chunk gets copies of its moments, never the first's own tensors.
            shared = keys & seen
            optim = {k: v.clone() if _state_of(k) in shared and isinstance(v, torch.Tensor)
                     else v for k, v in state["optim"].items()}  # fmt: skip
            set_optimizer_state_dict(part, opt, optim, options=FLAT)
            seen |= keys
        if self.zero_stage == 1:
            zero1_restore(self.grad_sync, self.optimizers, shadows)
        self._shadows = None

    def model_state(self) -> dict[str, Any]:
        """The model half of ``app_state()``: this rank's tensors under full-model names
        (expert slices as DTensor views), for DCP to fill in place from any source (the
        interop layer reads Hugging Face weights into it); then ``load_model_state``."""
        sd: dict[str, Any] = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part))
        for full_name, mesh, placements in self._expert_layouts():
            if full_name in sd and not isinstance(sd[full_name], DTensor):
                sd[full_name] = DTensor.from_local(sd[full_name], mesh, placements, run_check=False)
        return sd

    def load_model_state(self, sd: dict[str, Any]) -> None:
        """Apply a ``model_state()`` that DCP filled."""
        experts = {full_name for full_name, _, _ in self._expert_layouts()}
        sd = {k: v.to_local() if k in experts and isinstance(v, DTensor) else v
              for k, v in sd.items()}  # fmt: skip
        for part in self.parts:
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in keys})

    def scheduler_state(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(state)


def _state_of(key: str) -> str:
    """The parameter name of a flattened optimizer-state key (``state.<name>.<moment>``)."""
    return key.removeprefix("state.").rsplit(".", 1)[0] if key.startswith("state.") else ""
