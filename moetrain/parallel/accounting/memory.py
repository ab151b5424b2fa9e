"""Memory, measured: the bytes of the distinct storages behind this rank's parameters,
gradients and optimizer states (``model_state_bytes``), its optimizer's state per parameter
read from the real state (``optimizer_state_bytes_per_param``), the activations autograd
keeps for backward (``SavedActivations``), and the parameters it holds before data-parallel
sharding (``params_before_dp``). The formulas they are set beside: ``analytic``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class MemorySample:
    params: int = 0
    grads: int = 0
    optim: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


def model_state_bytes(parts: list[torch.nn.Module], optimizers: list[Any]) -> MemorySample:
    """Bytes of the distinct storages behind parameters, gradients and optimizer states."""
    seen: set[tuple[int, int]] = set()
    sample = MemorySample()

    def count(t: torch.Tensor | None, field_name: str) -> None:
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return
        key = _storage_key(t)
        if key in seen:
            return
        seen.add(key)
        setattr(sample, field_name, getattr(sample, field_name) + key[1])

    masters = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    for part in parts:
        for p in part.parameters():
            count(p, "params")
    for p in masters:
        count(p, "params")
    for part in parts:
        for p in part.parameters():
            count(p.grad, "grads")
    for p in masters:
        count(p.grad, "grads")
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    count(v, "optim")
    return sample


def optimizer_state_bytes_per_param(optimizers: list[Any], muon: bool | None = None) -> float:
    """Bytes of optimizer state per parameter element, read from the optimizers' real state:
    the state tensors of each parameter shaped like it (AdamW's two moments, Muon's one
    momentum buffer; step counts are scalars), in their own dtypes -- 8 for fp32 moments,
    4 for bf16 ones, 4 and 2 for Muon's matrices. Before the first step, when no state
    exists yet, from the dtype the optimizer declares for its moments (``moments_dtype``;
    None: each parameter's own) and the tensors its group keeps (Muon's group, flagged
    ``muon``: one). ``muon``: only Muon's matrices (True) or only the rest (False)."""
    state_bytes = elements = 0
    for opt in optimizers:
        declared = getattr(opt, "moments_dtype", None)
        for group in opt.param_groups:
            if muon is not None and bool(group.get("muon")) != muon:
                continue
            slots = 1 if group.get("muon") else 2
            for p in group["params"]:
                n = _local(p).numel()
                if n == 0:
                    continue
                elements += n
                tensors = [
                    _local(v) for v in opt.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                ]  # fmt: skip
                if tensors:
                    state_bytes += sum(t.numel() * t.element_size() for t in tensors)
                else:
                    itemsize = (declared or p.dtype).itemsize
                    state_bytes += slots * n * itemsize
    return state_bytes / elements if elements else 0.0


# ----------------------------------------------------------------------------- activations


class SavedActivations:
    """Bytes of the tensors autograd keeps for backward (the activations), live at once,
    while active (``with SavedActivations(parts) as a``): a tensor counts from when a
    forward saves it until the backward that used it frees it; ``peak`` is the most held at
    any moment. Storages are counted once however many saved tensors view them; parameters
    (and FSDP's gathered copies of them, which are model state) are left out. Activation
    checkpointing's own hooks take precedence inside checkpointed regions, so what they keep
    (block inputs) is what is counted there."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.params = {_storage_key(_local(p)) for part in parts for p in part.parameters()}
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        # A parameter, or a view of one (a linear layer saves its weight transposed): FSDP's
        # gathered parameters are parameters too, at storages this count has not seen.
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        if t.device.type == "meta":
            return t
        try:
            key = _storage_key(_local(t))  # a DTensor's own shard
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return t
        if key in self.params:
            return t
        if key not in self._refs:
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, key, self)

    def _release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= key[1]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    """A saved tensor and its place in ``SavedActivations``' count (released on collection,
    when autograd frees the graph node holding it)."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], owner: SavedActivations):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


def params_before_dp(parts: list[torch.nn.Module]) -> int:
    """Elements of this rank's parameters counted before data-parallel sharding."""
    total = 0
    for part in parts:
        for p in part.parameters():
            if not hasattr(p, "device_mesh"):
                total += p.numel()
                continue
            names = p.device_mesh.mesh_dim_names or ()
            denom = 1
            for name, placement, size in zip(names, p.placements, p.device_mesh.shape, strict=True):
                if name == "tp" and not placement.is_replicate():
                    denom *= size
            total += p.numel() // denom
    return total
