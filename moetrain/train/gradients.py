"""A rank's gradients between the step's backward and its optimizer step: reduced over the
dimensions the layout leaves them partial on, their global norm, clipping.

``Gradients`` is a collaborator of ``moetrain.train.engine.Engine``, handed what it reads:
the rank's model chunks, the stage-0/1 ``GradientSync`` (None under FSDP or in one process),
the meshes, the expert parameters and the groups they are reduced over, and the pipeline's
embedding group (multi-token prediction). The engine orders the calls
(``Engine.optimizer_step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.parallel.data_parallel import GradientSync, grads_or_zeros
from moetrain.parallel.dims import Meshes
from moetrain.parallel.expert_parallel import (
    expert_grad_sq_norm,
    reduce_expert_grads,
    sum_of_squares,
)
from moetrain.parallel.pipeline import embedding_copy
from moetrain.train.tensors import local, process_group, shard_dims

_NORM_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class GradientLayout:
    """What the gradients' reduction and norm need of the layout."""

    zero_stage: int
    """0/1 (``GradientSync``) or 2/3 (FSDP); 0 without data parallelism."""
    cp: int
    """Context-parallel degree: ZeRO shards over dp_shard x cp when > 1."""
    dp_cp: int
    """Ranks the expert gradients are averaged over (dp x cp)."""
    pipelined_embeddings: bool
    """Multi-token prediction under a pipeline: the first stage's embedding and the last
    stage's copy of it are summed (``sync_embedding_copies``)."""


class Gradients:
    def __init__(
        self,
        parts: list[nn.Module],
        grad_sync: GradientSync | None,
        meshes: Meshes | None,
        expert_params: list[nn.Parameter],
        etp_mesh: Any,
        embedding_group: Any,
        layout: GradientLayout,
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.grad_sync = grad_sync
        self.meshes = meshes
        self.expert_params = expert_params
        self.ep_mesh = meshes.ep if meshes is not None else None
        self.edp_mesh = meshes.edp if meshes is not None else None
        self.etp_mesh = etp_mesh
        self.pp_group = process_group(meshes.pp) if meshes is not None else None
        self.embedding_group = embedding_group
        self.layout = layout
        self.device = device

    def pieces(self, norm: bool = False) -> list[tuple[torch.Tensor, frozenset[str]]]:
        """(local gradient, mesh dims it is sharded over) of this rank's non-expert
        gradients; ``norm``: only its share of the gradient norm (the last stage's copy of the
        embedding, whose gradient equals the first stage's, left out)."""
        out = []
        copies = {id(c) for c in self.embedding_copies()} if norm else set()
        if self.grad_sync is not None:
            zero1 = self.layout.zero_stage == 1
            for grad, param in self.grad_sync.grad_pieces():
                if id(param) in copies:
                    continue
                dims = set(shard_dims(param))
                if zero1:  # sharded over dp_shard (x cp)
                    dims.add("dp_shard_cp" if self.layout.cp > 1 else "dp_shard")
                out.append((local(grad), frozenset(dims)))
            return out
        experts = {id(p) for p in self.expert_params}
        for part in self.parts:
            for p in part.parameters():
                if p.grad is not None and id(p) not in experts and id(p) not in copies:
                    out.append((local(p.grad), frozenset(shard_dims(p.grad))))
        return out

    def expert_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.expert_params if p.grad is not None]

    def embedding_copies(self) -> list[nn.Parameter]:
        """The last stage's copy of the embedding, when this rank holds it (multi-token
        prediction under a pipeline, ``moetrain.parallel.pipeline.embedding_copy``)."""
        return [c for c in map(embedding_copy, self.parts) if c is not None]

    @torch.no_grad()
    def sync_embedding_copies(self) -> None:
        """Sum the gradients of the first stage's embedding and the last stage's copy (both
        this rank's, or over ``embedding_group``), before any other reduction: both copies
        then take the same step. Each has the gradient of its own uses (the main model's
        input, the multi-token-prediction modules' inputs); the embedding's is their sum."""
        if not self.layout.pipelined_embeddings:
            return
        mine = self.embedding_copies()
        mine += [part.tok_embeddings.weight for part in self.parts
                 if part.embeds_input and part.tok_embeddings is not None]  # fmt: skip
        if not mine:
            return  # a stage in the middle
        grads = [local(p.grad) for p in mine]  # every one has one (``fill_unused`` ran first)
        total = torch.stack(grads).sum(0)
        if self.embedding_group is not None:
            dist.all_reduce(total, group=self.embedding_group)
        for g in grads:
            g.copy_(total)

    def fill_unused(self) -> None:
        """A zero gradient for every trainable parameter the step's data left unused on this
        rank, before any reduction: in every layout, one process included, each trainable
        parameter then steps with the gradient of the data that used it (zero where none
        did, as an expert that received no token), and every data-parallel rank reduces the
        same set of gradients whichever parameters its own data used."""
        for part in self.parts:
            grads_or_zeros(part.parameters())

    def match_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements. Some ops return a
        gradient in another layout (the vocabulary-parallel embedding's comes back
        replicated); Replicate -> Shard is a local slice, no communication."""
        for part in self.parts:
            for p in part.parameters():
                g = p.grad
                if (
                    isinstance(g, DTensor)
                    and isinstance(p, DTensor)
                    and (g.placements != p.placements)
                ):
                    p.grad = g.redistribute(p.device_mesh, p.placements)

    def reduce(self) -> None:
        """Stage-0/1 data-parallel reduction, and the experts' over expert data parallelism
        (FSDP reduced the rest in backward)."""
        if self.grad_sync is not None:
            self.grad_sync.reduce()
        if self.expert_params:
            reduce_expert_grads(self.expert_params, self.edp_mesh, self.layout.dp_cp)

    def norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: squares summed locally per sharding class, then
        over exactly the mesh dims each class is sharded over, then over pipeline stages."""
        # ZeRO shards over dp_shard x cp under context parallelism (one flattened dim).
        norm_dims = tuple("dp_shard_cp" if d == "dp_shard" and self.layout.cp > 1 else d
                          for d in _NORM_DIMS)  # fmt: skip
        classes = [frozenset(c) for c in _subsets(norm_dims)]
        pieces: list[list[torch.Tensor]] = [[] for _ in classes]
        for grad, dims in self.pieces(norm=True):
            pieces[classes.index(dims)].append(grad.detach())
        sq = [sum_of_squares(p, self.device) for p in pieces]
        if self.meshes is not None:
            for name in norm_dims:
                group = process_group(getattr(self.meshes, name))
                if group is None:
                    continue
                sharded = [i for i, c in enumerate(classes) if name in c]
                part = torch.stack([sq[i] for i in sharded])
                dist.all_reduce(part, group=group)
                for j, i in enumerate(sharded):
                    sq[i] = part[j]
        total = torch.stack(sq).sum()
        if self.expert_params:
            # Every expert once: summed over the EP group (and the TP group under expert TP),
            # never over edp (identical replicas) nor over tp with replicated experts.
            sq_e = expert_grad_sq_norm(self.expert_params, self.ep_mesh, self.etp_mesh)
            total = total + sq_e.to(total.dtype)
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total.sqrt()

    @torch.no_grad()
    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale every gradient by min(1, max_norm / norm), on the device."""
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad, _ in self.pieces():
            grad.mul_(coef.to(grad.dtype))
        for grad in self.expert_grads():
            grad.mul_(coef.to(grad.dtype))

    def zero(self) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()


def _subsets(names: tuple[str, ...]) -> list[set[str]]:
    out: list[set[str]] = [set()]
    for name in names:
        out += [s | {name} for s in out]
    return out
