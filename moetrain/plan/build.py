"""One rank of a planned job, built for real on the meta device: its model state in bytes.

``build_rank`` runs, under a fake process group of the job's world size
(``moetrain.plan.fake``), what the trainer runs on that rank before its first step: the whole
model built on the meta device (``meta_model``: shapes and dtypes, no memory, as the trainer
builds it), ``moetrain.parallel.parallelize`` (pipeline split, TP/SP, CP, EP, activation
checkpointing, FSDP2 / ZeRO, the pipeline schedule) and the optimizers the engine would build
(handed in as ``build_optimizers``: the training layer's own function). Then it reads the
bytes off the tensors that produced:

- parameters: the distinct storages behind this rank's parameters (DTensor local shards,
  FSDP2's padded shards), and the optimizer's own parameters where they are not those
  (master weights);
- gradients at their peak, the end of backward: one per parameter of its local shape and
  dtype (ZeRO 0/1, experts, TP shards), or FSDP2's reduce-scattered shard (its padded size,
  in the parameter's dtype);
- optimizer states: every optimizer is stepped once on meta gradients and the states it
  created are read (their shapes and dtypes are the optimizer's choice, not a formula);
  Muon's per-step gather bytes and Newton-Schulz FLOPs are what its optimizer states for
  the parameters it holds (``step_costs``);
- gathered parameters: what FSDP2 holds unsharded -- under ZeRO-2 every unit between
  forward and backward (exact), under ZeRO-3 the two largest units (one in use, one
  prefetched: an estimate);
- the start-up's workspace: the largest generator block the initialisation of this rank's
  shards draws (``moetrain.parallel.materialize.init_workspace``, the function the trainer's
  initialisation uses to choose its blocks) and the largest shard FSDP2 re-pads when the
  shards get their storage (an uneven shard is copied into its padded buffer).

Every figure but the last is what ``moetrain.parallel.accounting.model_state_bytes`` reads
from the real tensors of the same rank after a step (tests/plan/test_exact.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moetrain.config import JobConfig
from moetrain.model.moe import MoELayer
from moetrain.model.precision import Precision
from moetrain.model.transformer import meta_model
from moetrain.parallel.dims import ParallelDims
from moetrain.parallel.expert_parallel import expert_layouts
from moetrain.parallel.materialize import init_workspace
from moetrain.parallel.parallelize import parallelize
from moetrain.plan.fake import fake_world
from moetrain.plan.meta import SkipInPlace, fast_fsdp_chunks

BuildOptimizers = Callable[..., tuple[Any, list[torch.optim.Optimizer]]]
"""``(cfg, dims, meshes, parts, expert_params) -> (grad_sync, optimizers)``: the trainer's
``moetrain.train.engine.build_optimizers``."""


@dataclass
class Layer:
    """One transformer block a rank holds."""

    index: int
    moe: bool


@dataclass
class Chunk:
    """One pipeline stage a rank holds (the whole model without a pipeline)."""

    stage: int
    layers: list[Layer]
    embedding: bool
    output: bool


@dataclass
class RankState:
    """What one rank holds, read from the tensors its build produced (bytes)."""

    rank: int
    coords: dict[str, int]
    chunks: list[Chunk]
    params: int
    grads: int
    optim: int
    masters: int
    gathered: int
    gathered_exact: bool
    buffers: int
    param_elements: int
    """Elements of this rank's parameters before data-parallel sharding (its TP shard and
    pipeline stages): the Psi of the data-parallel traffic."""
    expert_elements: int = 0
    optim_dtypes: dict[str, int] = field(default_factory=dict)
    """Optimizer state bytes by dtype name (what the optimizer chose)."""
    checkpoint: int = 0
    """Bytes of the tensors this rank's checkpoint holds: its parameters, persistent buffers
    and every optimizer state tensor (the step counters too) -- what an asynchronous save
    stages (``moetrain.train.checkpoint.write.Staging``)."""
    n_params: int = 0
    """The whole model's parameters (tied ones once)."""
    n_active: int = 0
    """Parameters one token uses (top-k of the routed experts)."""
    flops_per_token: float = 0.0
    """The whole model's training FLOPs per token (``Transformer.flops_per_token``: what the
    trainer's MFU counts)."""
    init_block: int = 0
    """Bytes of the largest generator block the initialisation of this rank's shards draws
    (fp32, on the CPU whatever the device: ``moetrain.model.init``)."""
    repad: int = 0
    """Bytes of the largest FSDP2 shard copied into its padded buffer when the shards get
    their storage (an uneven last shard; none on data-parallel rank 0)."""
    muon_sent: int = 0
    """Bytes this rank's Muon gathers send per step (``optim.name=muon``: sharded matrices
    made whole, in the Newton-Schulz dtype), from the optimizers' ``step_costs``."""
    muon_flops: int = 0
    """Newton-Schulz FLOPs this rank computes per step (every matrix it holds a piece of)."""

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optim + self.masters


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tp_sharded(p: torch.Tensor) -> bool:
    if not hasattr(p, "placements"):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    pairs = zip(names, p.placements, strict=True)
    return any(n == "tp" and not pl.is_replicate() for n, pl in pairs)


def _non_tp_shards(p: torch.Tensor) -> int:
    """How many ways ``p`` is split over mesh dims other than tp."""
    out = 1
    names = p.device_mesh.mesh_dim_names or ()
    for n, pl, size in zip(names, p.placements, p.device_mesh.shape, strict=True):
        if n != "tp" and not pl.is_replicate():
            out *= size
    return out


def _fsdp_params(parts: list[nn.Module]) -> dict[int, Any]:
    """id(sharded parameter) -> its FSDPParam, for every FSDP2 unit of the chunks."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, Any] = {}
    for part in parts:
        for m in part.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else []:
                out[id(fp.sharded_param)] = fp
    return out


def _repad(parts: list[nn.Module]) -> int:
    """Bytes of the largest shard FSDP2 copies into a padded buffer of its own when
    ``to_empty`` gives the shards storage (``FSDPParam.reset_sharded_param``: a non-empty
    local shard smaller than the padded one); the copy's source is freed right after."""
    out = 0
    for fp in _fsdp_params(parts).values():
        local = fp.sharded_param._local_tensor
        if local.numel() and tuple(local.shape) != tuple(fp.padded_sharded_param_size):
            out = max(out, local.numel() * local.element_size())
    return out


def _fsdp_units(parts: list[nn.Module]) -> list[int]:
    """Unsharded bytes of each FSDP2 unit (what one all-gather brings), in the dtype the unit
    gathers in (its mixed-precision policy: bf16 blocks, fp32 routers and root under
    train.dtype bf16)."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    dtype = group.mp_policy.param_dtype
                    units.append(
                        sum(
                            fp._orig_size.numel() * (dtype or fp.sharded_param.dtype).itemsize
                            for fp in group.fsdp_params
                        )
                    )
    return units


def _chunks(parts: list[nn.Module], stage_ids: list[int], num_stages: int) -> list[Chunk]:
    out = []
    for part, stage in zip(parts, stage_ids, strict=True):
        layers = [
            Layer(int(name), any(isinstance(m, MoELayer) for m in block.modules()))
            for name, block in part.layers.items()
        ]
        out.append(Chunk(stage, layers, part.tok_embeddings is not None, part.output is not None))
    return out


def build_rank(
    cfg: JobConfig,
    dims: ParallelDims,
    rank: int,
    build_optimizers: BuildOptimizers,
    device_type: str = "cuda",
) -> RankState:
    """Build ``rank`` of the job on the meta device and read its model state."""
    coords = dims.coords(rank)
    # The trainer's policy on the target device (FSDP2's unit dtypes come from it).
    precision = Precision.choose(cfg.train.dtype, device_type)
    with fake_world(dims.world_size, rank):
        meshes = dims.build_mesh("cpu", cache=False)
        model = meta_model(cfg.model, cfg.moe)
        whole = {
            "n_params": model.num_params(),
            "n_active": model.num_params(active=True),
            "flops_per_token": model.flops_per_token(cfg.data.seq_len),
        }
        with fast_fsdp_chunks():
            pm = parallelize(
                model,
                dims,
                meshes,
                cfg.parallel,
                pp_rank=coords["pp"],
                precision=precision,
                device=torch.device("cpu"),
                n_microbatches=dims.breadth_first(cfg),
                loss_fn=lambda logits, labels: logits.sum(),
                seq_len=cfg.data.seq_len,
            )
        parts = pm.parts
        layouts = expert_layouts(parts, meshes, cfg.parallel)
        whole["init_block"] = init_workspace(parts, cfg.model, layouts) * torch.float32.itemsize
        whole["repad"] = _repad(parts)
        _, optimizers = build_optimizers(cfg, dims, meshes, parts, pm.expert_params)
        state = _read_state(parts, optimizers, cfg)
        costs = [opt.step_costs() for opt in optimizers if hasattr(opt, "step_costs")]
        whole["muon_sent"] = sum(c["sent"] for c in costs)
        whole["muon_flops"] = sum(c["ns_flops"] for c in costs)
        chunks = _chunks(parts, pm.stage_ids, dims.num_stages)
    from moetrain.parallel.accounting import params_before_dp

    expert = sum(_local(p).numel() for p in pm.expert_params)
    return RankState(
        rank=rank,
        coords=coords,
        chunks=chunks,
        param_elements=params_before_dp(parts),
        expert_elements=expert,
        **whole,
        **state,
    )


def _read_state(
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    cfg: JobConfig,
) -> dict[str, Any]:
    fsdp = _fsdp_params(parts)
    seen: set[int] = set()
    params = grads = 0
    model_params: list[nn.Parameter] = []
    for part in parts:
        for name, p in part.named_parameters():
            local = _local(p)
            key = _storage_id(local)
            if key in seen:
                continue
            seen.add(key)
            model_params.append(p)
            params += local.untyped_storage().nbytes()
            fp = fsdp.get(id(p))
            if fp is not None:  # FSDP2's reduce-scattered shard, padded, in the param dtype
                grads += fp.padded_sharded_param_size.numel() * local.element_size()
            elif name.endswith("tok_embeddings.weight") and _tp_sharded(p):
                # The vocabulary-parallel embedding's gradient comes back replicated over tp
                # (the engine shards it in the optimizer step): whole until then.
                grads += p.numel() // _non_tp_shards(p) * local.element_size()
            else:
                grads += local.numel() * local.element_size()
    masters = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                key = _storage_id(_local(p))
                if key not in seen:
                    seen.add(key)
                    masters += _local(p).untyped_storage().nbytes()
    optim, by_dtype = _optimizer_state(optimizers)
    buffers, persistent, seen_b = 0, 0, set()
    for part in parts:
        for module in part.modules():
            for name, b in module.named_buffers(recurse=False):
                key = _storage_id(b)
                if key not in seen_b:
                    seen_b.add(key)
                    buffers += b.untyped_storage().nbytes()
                    if name not in module._non_persistent_buffers_set:
                        persistent += b.untyped_storage().nbytes()
    scalars = sum(
        _local(v).untyped_storage().nbytes()
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() == 0
    )
    gathered, exact = 0, True
    if fsdp:
        unit_bytes = _fsdp_units(parts)
        if cfg.parallel.zero_stage == 2:  # every unit stays gathered from forward to backward
            gathered = sum(unit_bytes)
        else:  # ZeRO-3: one unit in use, the next prefetched
            gathered, exact = sum(sorted(unit_bytes)[-2:]), False
    return {
        "params": params,
        "grads": grads,
        "optim": optim,
        "masters": masters,
        "gathered": gathered,
        "gathered_exact": exact,
        "buffers": buffers,
        "optim_dtypes": by_dtype,
        "checkpoint": params + persistent + optim + scalars,
    }


def _optimizer_state(optimizers: list[torch.optim.Optimizer]) -> tuple[int, dict[str, int]]:
    """Step every optimizer once on zero gradients at a learning rate of 0 (meta tensors:
    nothing is computed; at lr 0 Muon gathers and orthogonalizes nothing, which the fake
    process group could not run) and read the states it created: bytes of their distinct
    storages, and by dtype."""
    for opt in optimizers:
        lrs = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        try:
            with SkipInPlace():
                opt.step()
        finally:
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr
    seen: set[int] = set()
    total, by_dtype = 0, {}
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue  # AdamW's step counter: a scalar
                local = _local(v)
                key = _storage_id(local)
                if key in seen:
                    continue
                seen.add(key)
                n = local.untyped_storage().nbytes()
                total += n
                name = str(local.dtype).removeprefix("torch.")
                by_dtype[name] = by_dtype.get(name, 0) + n
    return total, by_dtype
