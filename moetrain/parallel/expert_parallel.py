"""Expert parallelism: place E / ep experts on each rank and swap in a cross-rank dispatcher.

Layout. ``parallel.ep`` is carved out of the data-parallel ranks (dp x cp under context
parallelism, as Megatron-Core does): they split into ``edp = dp * cp / ep``
expert-data-parallel replicas of ``ep`` ranks each (ep innermost, as torchtitan does; with
cp the innermost are the cp ranks of one dp rank). EP rank r of a group owns experts
``[r * E/ep, (r+1) * E/ep)``. Ranks of one EP group see different data (or other tokens of
the same sequences), so an EP group is also part of the data-parallel group; with tensor
parallelism every TP rank holds the same experts (replicated) and dispatches over the EP
group of its own TP index.

Gradients. A rank's expert gradient already sums the contributions of every source rank
of its EP group (the all-to-all backward carries them home), so expert parameters need an
all-reduce over the *expert*-data-parallel group only, and then the same ``1 / dp`` scale
as every other parameter (the loss is a mean over all dp ranks). Non-expert parameters are
reduced over the full dp group as usual. ``reduce_expert_grads`` does the expert half when
the expert parameters are kept out of FSDP/DDP (``ignored_params``); with FSDP2 on the edp
mesh instead, set the gradient divide factor to dp (``expert_fsdp_divide_factor``).

Losses. The router, capacity decision and balancing losses run on the source rank with
its own tokens, before dispatch (see ``docs/expert_parallel.md``): EP changes none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from moetrain.config import ConfigError
from moetrain.model.ep_dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    AmaxOverGroup,
    ExpertTPDispatcher,
)
from moetrain.model.experts import EXPERT_FFN_DIMS
from moetrain.model.init import fqn
from moetrain.model.moe import MoELayer
from moetrain.model.transformer import TransformerBlock
from moetrain.parallel.data_parallel import grads_or_zeros

DISPATCHERS = ("all_to_all", "all_gather")


def check_ep_layout(num_experts: int, ep: int, dp: int, cp: int = 1) -> None:
    """Raise ``ConfigError`` naming the keys unless ep divides the experts and the dp x cp
    size.

    ``dp`` is the data-parallel degree (``parallel.dp_replicate * parallel.dp_shard``), ``cp``
    the context-parallel one: EP groups are carved out of the dp x cp ranks."""
    if ep < 1:
        raise ConfigError(f"parallel.ep: must be >= 1, got {ep}")
    if ep == 1:
        return
    if num_experts == 0:
        raise ConfigError(f"parallel.ep: {ep} needs MoE layers, but moe.num_experts is 0")
    if num_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide moe.num_experts={num_experts}")
    if (dp * cp) % ep:
        if cp > 1:
            raise ConfigError(
                f"parallel.ep: {ep} does not divide the data-parallel x context-parallel size "
                f"{dp * cp} (parallel.dp_replicate * parallel.dp_shard * parallel.cp)"
            )
        raise ConfigError(
            f"parallel.ep: {ep} does not divide the data-parallel size "
            f"{dp} (parallel.dp_replicate * parallel.dp_shard)"
        )


def build_ep_meshes(
    pp: int, dp: int, tp: int, ep: int, device_type: str = "cpu", *, return_root: bool = False
):
    """The ``ep`` and ``edp`` 1-D meshes over the rank order of ``moetrain.parallel.dims``.

    The world is ``(pp, dp, tp)`` row-major with dp = dp_replicate x dp_shard (x cp under
    context parallelism: pass dp * cp, the cp ranks are contiguous inside it); dp splits
    into ``(edp, ep)`` with ep innermost, so EP groups are ``ep`` consecutive dp ranks of
    one pipeline stage and TP index. Every rank must call this (it creates groups).
    Returns ``(ep_mesh, edp_mesh)``, plus the 4-D ``(pp, edp, ep, tp)`` root mesh with
    ``return_root`` (its ``["ep", "tp"]`` sub-mesh places expert-TP shards in checkpoints).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if dp % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide the data-parallel size {dp}")
    mesh = init_device_mesh(
        device_type, (pp, dp // ep, ep, tp), mesh_dim_names=("pp", "edp", "ep", "tp")
    )
    if return_root:
        return mesh["ep"], mesh["edp"], mesh
    return mesh["ep"], mesh["edp"]


def _group(mesh_or_group):
    if mesh_or_group is None:
        return None
    if hasattr(mesh_or_group, "get_group"):  # a 1-D DeviceMesh
        return mesh_or_group.get_group()
    if not isinstance(mesh_or_group, dist.ProcessGroup):
        raise TypeError(
            f"expected a 1-D DeviceMesh or a ProcessGroup, got {type(mesh_or_group).__name__} "
            "(a Meshes bundle needs ep/edp meshes: see build_ep_meshes)"
        )
    return mesh_or_group


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def apply_ep(
    model: nn.Module, ep_mesh, dispatcher: str = "all_to_all", etp_mesh=None
) -> list[nn.Parameter]:
    """Keep this rank's E / ep experts in every MoE layer and install the EP dispatcher.

    ``ep_mesh``: a 1-D DeviceMesh (or a ProcessGroup) over the ranks of this rank's EP group
    (``build_ep_meshes``). ``dispatcher``: "all_to_all" or "all_gather". ``etp_mesh``: the
    tensor-parallel mesh to split every local expert's FFN width over (expert tensor
    parallelism; the layer input must be replicated over it, as ``apply_tp`` leaves it).
    Call it on a model whose experts were initialised identically on every rank (same
    seed, as the trainer does), before FSDP/ZeRO wrapping. Returns the expert parameters,
    which are then reduced over the expert-data-parallel group (``reduce_expert_grads``),
    never over dp or tp: the same ones ``ep_expert_params`` finds in the model afterwards.

    For the engine's convenience ``ep_mesh`` may also be an object with ``ep`` (and
    optionally ``tp``) mesh attributes and ``dispatcher`` an object with ``ep_dispatcher``
    / ``expert_tp`` / ``overlap_shared_experts`` / ``ep_overlap`` /
    ``ep_dropless_transport`` attributes (a ``ParallelConfig``):
    ``ep_dropless_transport=slots`` sends dropless rows in static slots
    (``AllToAllDispatcher``); ``ep_overlap=halves`` makes every block with an MoE layer run
    two halves of its sequences interleaved (``TransformerBlock.schedule_halves``);
    ``overlap_shared_experts`` makes every MoE layer with shared experts compute them while
    its all-to-all carries the routed tokens (``MoELayer.exchange``).
    """
    if hasattr(ep_mesh, "ep"):  # a Meshes-like bundle
        meshes, ep_mesh = ep_mesh, ep_mesh.ep
        if not isinstance(dispatcher, str) and getattr(dispatcher, "expert_tp", False):
            etp_mesh = meshes.tp
    overlap, halves, slots = False, False, False
    if not isinstance(dispatcher, str):  # a ParallelConfig-like section
        overlap = bool(getattr(dispatcher, "overlap_shared_experts", False))
        halves = getattr(dispatcher, "ep_overlap", "none") == "halves"
        slots = getattr(dispatcher, "ep_dropless_transport", "exact") == "slots"
        dispatcher = getattr(dispatcher, "ep_dispatcher", "all_to_all")
    if overlap and dispatcher != "all_to_all":
        raise ConfigError(
            "parallel.overlap_shared_experts: needs parallel.ep_dispatcher=all_to_all, got "
            f"{dispatcher}"
        )
    if dispatcher not in DISPATCHERS:
        raise ValueError(
            f"EP dispatcher: expected one of {', '.join(DISPATCHERS)}, got {dispatcher!r}"
        )
    group = _group(ep_mesh)
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    etp_group = _group(etp_mesh)
    if etp_group is not None and dist.get_world_size(etp_group) == 1:
        etp_group = None
    tp = dist.get_world_size(etp_group) if etp_group is not None else 1
    tp_rank = dist.get_rank(etp_group) if etp_group is not None else 0
    for layer in moe_layers(model):
        E = layer.num_experts
        if E % ep:
            raise ConfigError(f"parallel.ep: {ep} does not divide moe.num_experts={E}")
        L = E // ep
        experts = layer.experts
        if experts.num_experts != E:
            raise ValueError(
                f"MoE layer holds {experts.num_experts} of {E} experts: "
                "apply_ep was already applied"
            )
        F = experts.w1.shape[2]
        if F % tp:
            raise ConfigError(
                f"moe.expert_ffn_dim: {F} is not divisible by parallel.tp={tp} "
                "(expert tensor parallelism splits it)"
            )
        f = slice(tp_rank * (F // tp), (tp_rank + 1) * (F // tp))
        e = slice(rank * L, (rank + 1) * L)
        names = experts.ffn_dims()  # the per-expert tensors (the output bias stays whole)
        for name, ffn_dim in names.items():
            w = getattr(experts, name)
            index = (e, *([slice(None)] * (ffn_dim - 1)), f)
            local = nn.Parameter(w.detach()[index].clone(), requires_grad=w.requires_grad)
            setattr(experts, name, local)
        experts.num_experts = L
        if dispatcher == "all_to_all":
            ep_dispatcher = AllToAllDispatcher(group, E, padded=layer.cfg.pad_to_capacity,
                                               dropless_slots=slots)  # fmt: skip
        else:
            ep_dispatcher = AllGatherDispatcher(group, E, padded=layer.cfg.pad_to_capacity)
        if etp_group is not None:
            ep_dispatcher = ExpertTPDispatcher(ep_dispatcher, etp_group)
            experts.amax_reduce = AmaxOverGroup(etp_group)
        # Shared experts computed while the all-to-all is in flight (same numbers).
        layer.install_dispatcher(ep_dispatcher, overlap_shared=overlap)
    if halves:  # parallel.ep_overlap=halves: each block's two halves hide each other's transfers
        for block in model.modules():
            if type(block) is TransformerBlock and block.moe_enabled:
                block.schedule_halves()
    return ep_expert_params(model)


def ep_expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The per-expert parameters of every MoE layer of ``model`` (``GroupedExperts.ffn_dims``:
    the weights and the per-expert biases). Under expert parallelism these are this rank's
    experts (what ``apply_ep`` kept and returned): the engine hands that list to whatever
    treats them apart (the optimizers, the gradient reduction, the checkpoint views); the
    checkpoint layouts and gathers below, which run only under expert parallelism, read them
    off the model."""
    return [getattr(layer.experts, name) for layer in moe_layers(model)
            for name in layer.experts.ffn_dims()]  # fmt: skip


def expert_layouts(
    parts: Iterable[nn.Module], meshes: Any, cfg: Any
) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Full-model name -> (mesh, placements) of each expert parameter this rank holds under
    expert parallelism: where its slice sits in the full (E, ...) tensor, as a DTensor over
    the EP mesh (and the FFN width over TP under expert TP, ``ep_root["ep", "tp"]``) would
    place it. Checkpoints save the slices as such views; the initialisation draws exactly
    those regions (``moetrain.parallel.materialize``). ``meshes``: the layout's
    (``moetrain.parallel.dims.Meshes``), ``cfg``: its ``ParallelConfig``. Empty without
    expert parallelism."""
    out: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    if meshes is None or meshes.ep is None:
        return out
    expert_tp = cfg.expert_tp and meshes.tp.size() > 1
    for part in parts:
        experts = {id(p) for p in ep_expert_params(part)}
        for name, p in part.named_parameters():
            if id(p) not in experts:
                continue
            if expert_tp:
                ffn_dim = EXPERT_FFN_DIMS[name.rsplit(".", 1)[-1]]
                out[fqn(name)] = (meshes.ep_root["ep", "tp"], (Shard(0), Shard(ffn_dim)))
            else:
                out[fqn(name)] = (meshes.ep, (Shard(0),))
    return out


def expert_fsdp_divide_factor(dp: int) -> int:
    """With FSDP2 sharding the experts on the edp mesh, the reduce-scatter must divide by
    the full dp size (not edp): ``experts_module.set_gradient_divide_factor(dp)``."""
    return dp


@torch.no_grad()
def reduce_expert_grads(params: Iterable[nn.Parameter], edp_group, dp: int) -> None:
    """Sum expert gradients over the expert-data-parallel group and scale them by 1 / dp.

    ``edp_group``: DeviceMesh or ProcessGroup of the ranks holding the same experts (None
    or size 1: no communication). ``dp``: the full data-parallel degree, the same divisor
    DDP/FSDP apply to the other parameters, so both halves of the model see exactly the
    gradient of the global-batch mean loss. One coalesced all-reduce, of a zero gradient
    where this rank's data left an expert parameter unused (``grads_or_zeros``).
    """
    grads = grads_or_zeros(params)
    if not grads:
        return
    group = _group(edp_group)
    if group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for g in grads:
        g.div_(dp)


@torch.no_grad()
def gather_experts(model: nn.Module, ep_mesh, etp_mesh=None) -> dict[str, torch.Tensor]:
    """Full (E, ...) expert weights of every MoE layer, gathered over the EP group (and the
    FFN width over ``etp_mesh``), keyed by parameter name: for checks and for exporting a
    layout-independent state dict."""
    experts = {id(p) for p in ep_expert_params(model)}
    local = {name: p.detach() for name, p in model.named_parameters() if id(p) in experts}
    return gather_expert_tensors(local, ep_mesh, etp_mesh)


@torch.no_grad()
def gather_expert_tensors(
    local: dict[str, torch.Tensor], ep_mesh, etp_mesh=None
) -> dict[str, torch.Tensor]:
    """This rank's slices of expert tensors (weights, gradients, ...) keyed by the expert
    parameter's name (``...experts.w1`` / ``w3`` / ``w2`` / ``b1`` / ``b3``), gathered to full
    (E, ...) size over the EP group and the FFN width over ``etp_mesh`` (collective)."""
    out = {}
    for name, full in local.items():
        ffn_dim = EXPERT_FFN_DIMS[name.rsplit(".", 1)[-1]]
        for mesh, dim in ((etp_mesh, ffn_dim), (ep_mesh, 0)):
            group = _group(mesh)
            if group is None or dist.get_world_size(group) == 1:
                continue
            parts = [torch.empty_like(full) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, full.contiguous(), group=group)
            full = torch.cat(parts, dim)
        out[name] = full
    return out


@torch.no_grad()
def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """fp64 scalar on ``device``: the sum of the squares of every element of ``tensors``.

    One fused multi-tensor norm (``torch._foreach_norm``) reads each tensor once in its own
    dtype (4 bytes an element for fp32 gradients) and adds up in fp64 registers: no fp64
    copy is written and read back, as ``t.double().pow(2).sum()`` did. fp64 accumulation
    costs nothing next to the read on a GPU, and keeps the CPU's norm exact: torch's CPU
    norm kernel adds fp32 squares lane by lane, 2.5e-5 off for the micro MoE's gradients,
    which moved a layout's AdamW moments past the equivalence oracle's tolerance."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    return torch.stack(norms).to(device).pow(2).sum()


def expert_grad_sq_norm(params: Iterable[nn.Parameter], ep_mesh, etp_mesh=None) -> torch.Tensor:
    """Squared L2 norm of the expert gradients of the whole model, summed over the EP group.

    Expert-data-parallel replicas hold identical reduced expert gradients, so the EP group
    (times the TP group under expert tensor parallelism, ``etp_mesh``; without it TP ranks
    hold identical experts) covers every expert once. Add it to the non-expert squared norm of
    this stage before any reduction over pipeline stages."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    total = sum_of_squares(grads, grads[0].device if grads else torch.device("cpu"))
    for mesh in (ep_mesh, etp_mesh):
        group = _group(mesh)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total
