"""Data parallelism and ZeRO over the ``dp_replicate`` x ``dp_shard`` ranks.

    zero_stage 0  replicas; gradients all-reduced (``GradientSync``, below)
    zero_stage 1  gradients reduce-scattered, each rank steps its 1/dp_shard slice of every
                  parameter group, updated slices all-gathered (``GradientSync`` + ``Zero1``)
    zero_stage 2  FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients and optimizer
                  state sharded, parameters kept gathered between forward and backward
    zero_stage 3  FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters sharded too

Hybrid sharding: stages 2/3 shard over ``dp_shard`` on a 2-D (dp_replicate, dp_shard) mesh
(HSDP); stage 1 reduce-scatters over ``dp_shard`` and all-reduces the slices over
``dp_replicate``; stage 0 all-reduces over both.

Why not torch's DDP and ZeroRedundancyOptimizer for stages 0/1: DDP does not accept the
DTensor parameters tensor parallelism makes, nor a pipeline stage's several model chunks
under one reduction, and ZeroRedundancyOptimizer shards whole parameters (uneven memory,
an all-reduce plus broadcasts: 3 Psi instead of 2 Psi) and has no DCP state dict. The
flat-buffer reduction here is ~150 lines, composes with TP and PP, and sends exactly the
analytic volume: all-reduce 2 Psi (n-1)/n for stage 0, reduce-scatter + all-gather
2 Psi (n-1)/n for stage 1 (``docs/parallel.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.model.moe import MoELayer
from moetrain.model.precision import Precision

BUCKET_NUMEL = 1 << 22  # elements per all-reduce bucket (16 MiB of fp32)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: Any,
    zero_stage: int,
    precision: Precision | None = None,
    ignored: Iterable[nn.Parameter] = (),
) -> None:
    """ZeRO-2/3 with FSDP2: each block, then the root. ``dp_mesh`` is 1-D (dp_shard) or 2-D
    (dp_replicate, dp_shard) for hybrid sharding. ``precision``: the run's policy, whose
    ``fsdp_policies`` say in which dtype each unit is gathered (None: fp32). ``ignored``:
    parameters FSDP must leave alone (the expert parameters under expert parallelism: they
    differ per EP rank and are reduced over the expert-data-parallel group by the engine,
    ``reduce_expert_grads``).

    Mixed precision computes what one bf16 process computes (autocast with fp32 master
    weights): the blocks are gathered in bf16; every MoE router is its own unit gathered in
    fp32, and so is the root (token embeddings, final norm, output head)
    (``moetrain.model.precision``, ``Precision.fsdp_policies``)."""
    from torch.distributed.fsdp import fully_shard

    from moetrain.model.moe import Router

    policies = (precision or Precision(torch.float32, "cpu")).fsdp_policies()
    reshard = zero_stage == 3
    kw: dict[str, Any] = {"ignored_params": set(ignored)} if ignored else {}
    for block in model.layers.values():
        if policies.routers is not None:
            for router in (m for m in block.modules() if isinstance(m, Router)):
                fully_shard(
                    router, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policies.routers
                )
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policies.blocks, **kw
        )
    # The root (embedding, final norm, output) follows the stage too, so that ZeRO-3 sends
    # exactly its 3 Psi: gathered for forward and again for backward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policies.root, **kw)
    reduce_unused_as_zeros(model)


def reduce_unused_as_zeros(model: nn.Module) -> None:
    """Make FSDP2 reduce-scatter a zero gradient for a parameter this rank's data left unused,
    so that every rank issues the same collectives whatever its data used (torch >= 2.13,
    ``set_reduce_scatter_unused_params``); the other reductions do the same
    (``grads_or_zeros``). Older torch reduce-scatters only the gradients a rank has: a
    parameter some ranks' data leave unused would stop the job there, so it is warned of."""
    setter = getattr(model, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(True)
        return
    import warnings

    warnings.warn(
        f"torch {torch.__version__}: FSDP2 (parallel.zero_stage 2/3) reduces only the "
        "gradients each rank has, so a parameter that some ranks' data leave unused would "
        "stop the job; torch >= 2.13 reduces a zero gradient for it (docs/parallel.md)",
        RuntimeWarning,
        stacklevel=2,
    )


def grads_or_zeros(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Each trainable parameter's gradient, a zero one created where this rank's data left the
    parameter unused: every rank then reduces the same tensors, in the same buckets (a missing
    gradient would shift every later one and desynchronize the collective). Parameters whose
    gradient is not needed (``requires_grad`` False) are left out."""
    out = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def apply_ddp(model: nn.Module, dp_mesh: Any, zero_stage: int) -> None:
    """Stages 0/1 leave the module as it is: its gradients are reduced after backward by
    the engine's ``GradientSync`` (one per rank, over every model chunk)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GradientSync:
    """Stage 0/1 gradient reduction over the data-parallel ranks, for the parameters of all
    of this rank's model chunks.

    Stage 0 all-reduces (averages) every gradient in flat buckets over ``dp``. Stage 1 keeps
    per-group flat index spaces (decay / no-decay, as the optimizer groups them), padded to a
    multiple of dp_shard; rank r owns the contiguous slice r of each, reduce-scatters the
    gradients into it, and steps only its slice of the parameters (``Zero1``).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        zero_stage: int,
        dp_group: Any,
        shard_group: Any,
        replicate_group: Any,
    ) -> None:
        self.zero_stage = zero_stage
        self.dp_group, self.shard_group, self.replicate_group = (
            dp_group,
            shard_group,
            replicate_group,
        )
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.groups = [list(g) for g in groups]
        self.shards: list[_FlatShard] = []
        if zero_stage == 1:
            n = dist.get_world_size(shard_group) if shard_group is not None else 1
            r = dist.get_rank(shard_group) if shard_group is not None else 0
            self.shards = [_FlatShard(g, n, r) for g in self.groups]

    # ------------------------------------------------------------------ stage 0

    @torch.no_grad()
    def reduce(self) -> None:
        """Average the gradients over dp (stage 0), or reduce-scatter them into this rank's
        slices (stage 1)."""
        if self.zero_stage == 1:
            for shard in self.shards:
                shard.reduce_scatter(self.shard_group, self.replicate_group, self.dp)
            return
        if self.dp == 1:
            return
        grads = [_local(g) for g in grads_or_zeros(p for group in self.groups for p in group)]
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None and (size + g.numel() <= BUCKET_NUMEL or not bucket):
                bucket.append(g)
                size += g.numel()
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.dp
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
            bucket, size = ([g], g.numel()) if g is not None else ([], 0)

    # ------------------------------------------------------------------ stage 1

    def optimizer_groups(self) -> list[list[nn.Parameter]]:
        """What this rank's optimizer steps: the full parameters (stage 0) or the views of
        this rank's slices (stage 1)."""
        if self.zero_stage == 1:
            return [s.views for s in self.shards]
        return self.groups

    @torch.no_grad()
    def gather_params(self) -> None:
        """Stage 1, after the optimizer step: all-gather the updated slices."""
        for shard in self.shards:
            shard.all_gather(self.shard_group)

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(gradient tensor, the parameter it belongs to) pairs whose squares sum to this
        rank's share of the gradient norm."""
        if self.zero_stage == 1:
            return [
                (v.grad, p)
                for s in self.shards
                for v, p in zip(s.views, s.owners, strict=True)
                if v.grad is not None
            ]
        return [(p.grad, p) for g in self.groups for p in g if p.grad is not None]

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad_shard = None
            for v in shard.views:
                v.grad = None


class _FlatShard:
    """One parameter group laid out flat (padded to a multiple of n); rank r owns
    ``[r * L / n, (r + 1) * L / n)``. ``views`` are parameters sharing storage with the
    owned pieces of the model's parameters, so stepping them updates the model in place."""

    def __init__(self, params: list[nn.Parameter], n: int, r: int) -> None:
        self.params = params
        self.n = n
        self.numels = [_local(p).numel() for p in params]
        total = sum(self.numels)
        self.padded = -(-total // n) * n if total else 0
        self.size = self.padded // n
        lo, hi = r * self.size, (r + 1) * self.size
        self.lo = lo
        self.views: list[nn.Parameter] = []
        self.owners: list[nn.Parameter] = []
        self.pieces: list[tuple[int, int, int]] = []  # (param index, start in param, length)
        offset = 0
        for i, (p, numel) in enumerate(zip(params, self.numels, strict=True)):
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                flat = _local(p).detach().view(-1)
                self.views.append(nn.Parameter(flat[a - offset : b - offset]))
                self.owners.append(p)
                self.pieces.append((i, a - offset, b - a))
            offset += numel
        self.grad_shard: torch.Tensor | None = None

    def reduce_scatter(self, shard_group: Any, replicate_group: Any, dp: int) -> None:
        if not self.params:
            return
        ref = _local(self.params[0])
        flat = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)
        offset = 0
        for p, numel in zip(self.params, self.numels, strict=True):
            if p.grad is not None:
                flat[offset : offset + numel].copy_(_local(p.grad).reshape(-1))
            offset += numel
        out = torch.empty(self.size, dtype=flat.dtype, device=flat.device)
        if self.n > 1:
            dist.reduce_scatter_tensor(out, flat, group=shard_group)
        else:
            out.copy_(flat)
        del flat
        if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
            dist.all_reduce(out, group=replicate_group)
        out /= dp
        self.grad_shard = out
        pos = 0
        for view in self.views:
            view.grad = out[pos : pos + view.numel()]
            pos += view.numel()
        # The full gradients are done with: ZeRO-1's peak is the end of backward, 4 + 4 + 8/N.
        for p in self.params:
            p.grad = None

    def all_gather(self, shard_group: Any) -> None:
        if not self.params or self.n == 1:
            return
        ref = _local(self.params[0])
        mine = torch.zeros(self.size, dtype=ref.dtype, device=ref.device)
        pos = 0
        for view in self.views:
            mine[pos : pos + view.numel()].copy_(view.detach())
            pos += view.numel()
        for p, full in zip(self.params, self.gather_flat(mine, shard_group), strict=True):
            _local(p).detach().view(-1).copy_(full)

    def gather_flat(self, mine: torch.Tensor, shard_group: Any) -> list[torch.Tensor]:
        """This rank's slice of a flat per-group quantity (updated weights, a gradient or
        Adam moment shard) gathered over the shard group, cut back into one flat piece per
        parameter (collective)."""
        full = torch.empty(self.padded, dtype=mine.dtype, device=mine.device)
        if self.n > 1:
            dist.all_gather_into_tensor(full, mine, group=shard_group)
        else:
            full.copy_(mine)
        out, offset = [], 0
        for numel in self.numels:
            out.append(full[offset : offset + numel])
            offset += numel
        return out


def by_layer(parts: Iterable[nn.Module], kind: type) -> dict[int, Any]:
    """The modules of type ``kind`` in all of this rank's model chunks (one per block), by
    layer index (``layers.<i>.…``)."""
    out: dict[int, Any] = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, kind):
                out[int(name.split(".")[1])] = module
    return out


def moe_layers(parts: Iterable[nn.Module]) -> dict[int, MoELayer]:
    """The MoE layers of all of this rank's model chunks, by layer index."""
    return by_layer(parts, MoELayer)
