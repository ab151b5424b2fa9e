"""Muon for every hidden matrix of an MoE, routed experts one matrix each, under any layout.

One step of a Muon-updated parameter (torch.optim.Muon's arithmetic, Moonlight's scaling):

    B <- mu B + (1 - mu) g            the momentum buffer (one per parameter; an average)
    U <- (1 - mu) g + mu B            Nesterov
    O <- NS_k(U)                      k quintic Newton-Schulz steps, (a, b, c) below, on each
                                      whole matrix: a 3-D expert tensor (E, A, B) is E matrices,
                                      orthogonalized as a batch, never as one flattened matrix
    p <- p (1 - lr wd) - lr rms sqrt(max(A, B)) O      decoupled decay; update RMS ~ ``rms``

Every other parameter (embeddings, output head, router gates, norms, biases) takes AdamW's
step in the same optimizer object: ``Muon`` is torch's AdamW (or moetrain's bf16-moments
AdamW) with one more parameter group, so that there is one optimizer per model chunk, one
state dict per chunk for DCP, and the AdamW groups compute what torch's AdamW computes.

Layouts. Newton-Schulz needs the whole matrix; a rank may hold a slice of it:

- a DTensor parameter (FSDP2's ZeRO-2/3 and HSDP shards, TP's column/row shards, expert TP
  without EP): its update is cast to the Newton-Schulz dtype, all-gathered over every mesh
  dim it is sharded on (``redistribute`` to Replicate), orthogonalized by every rank, and
  each rank keeps its own slice (Replicate -> Shard is a local slice). A 3-D expert tensor
  sharded over its expert dim alone (FSDP2 without EP) holds whole experts already: that
  dim is kept, nothing moves for it;
- expert parallelism: a rank's experts are whole (``layouts``: their place in the full
  tensor) -- under expert TP their FFN width is gathered over tp only;
- ZeRO-1's flat slices: ``moetrain.train.zero1_state.Zero1Matrices`` all-gathers the
  group's flat update once and orthogonalizes the matrices this rank's slice touches.

That is Moonlight's "distributed Muon" (``optim.muon_distributed=gather``): gather,
orthogonalize redundantly, keep one's slice. Traffic per step: each sharded Muon matrix once,
in the Newton-Schulz dtype (bf16: 2 bytes an element), (n - 1) / n of it sent by each of its n
holders -- at most a sixth of ZeRO-3's own traffic in fp32 training. FLOPs: ``ns_flops`` per
matrix, on every rank that holds a piece of it. The default (``owners``,
``moetrain.train.muon_owners.OwnerMatrices``) sends each matrix's slices to one owner and
returns the result's: 1 / n of the FLOPs per rank, 2 / n of the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from moetrain.config import OptimConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.moe import MoELayer, Router
from moetrain.train.adamw import AdamW, BF16MomentsAdamW, torch_kwargs

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic of the reference implementation (Keller Jordan's; torch.optim.Muon's)."""
NS_EPS = 1e-7
"""Floor of the Frobenius norm the update is divided by (torch.optim.Muon's)."""
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

Layout = tuple[Any, tuple[Any, ...]]
"""(device mesh, placements) of a plain local tensor that is a slice of a larger one."""


# ----------------------------------------------------------------------------- the math


def newton_schulz(
    x: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, eps: float = NS_EPS
) -> torch.Tensor:
    """The orthogonalized ``x`` (..., A, B): every trailing matrix on its own, the leading
    dims a batch. torch.optim.Muon's iteration, operation for operation (a matrix taller than
    wide is transposed first), in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    X = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        X = X.mT
    batch = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """Matmul FLOPs of ``newton_schulz`` on a tensor of ``shape`` (..., A, B): per matrix
    and step, with m = min(A, B) and n = max(A, B), X X^T (2 m^2 n), b A + c A A (2 m^3)
    and a X + B X (2 m^2 n)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float) -> torch.Tensor:
    """Move the buffer toward the gradient and return the Nesterov update (torch.optim.Muon's
    ``lerp`` form); a bf16 buffer is updated in fp32 and rounded back once."""
    if buf.dtype == grad.dtype:
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum)
    m = buf.float().lerp_(grad.float(), 1 - momentum)
    buf.copy_(m)
    return grad.float().lerp(m, momentum)


def muon_directions(
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    momentum: float,
    orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """The orthogonalized Nesterov updates of one group: momentum first, then
    Newton-Schulz (``orthogonalize``: whole matrices under any layout)."""
    updates = [momentum_update(b, g, momentum) for b, g in zip(bufs, grads, strict=True)]
    return orthogonalize(updates)


# ----------------------------------------------------------------------------- whole matrices


def _split_dim(placement: Any) -> int | None:
    """The tensor dim a placement splits (``Shard``, or FSDP2's ``_StridedShard`` over a TP
    shard, which is no ``Shard`` subclass in every torch), or None."""
    if placement.is_replicate() or placement.is_partial():
        return None
    return placement.dim


def _keeps(placement: Any, ndim: int) -> bool:
    """A placement Newton-Schulz can run under: the batch dim of a stack of matrices."""
    return type(placement) is Shard and ndim == 3 and placement.dim == 0


def whole(
    u: torch.Tensor, layout: Layout | None, dtype: torch.dtype
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(whole matrices of ``u`` in ``dtype``, back: their orthogonalized version -> this
    rank's slice of it). ``u`` is a DTensor, or a plain tensor that is a slice of a larger one
    (``layout``), or whole. Collective over the mesh dims ``u`` is sharded on, except a 3-D
    tensor's expert dim."""
    if isinstance(u, DTensor):
        dt = u.to(dtype)
    elif layout is not None:
        mesh, placements = layout
        dt = DTensor.from_local(u.to(dtype), mesh, placements, run_check=False)
    else:
        return u.to(dtype), lambda o: o
    mesh, placements = dt.device_mesh, dt.placements
    keep = tuple(p if _keeps(p, dt.ndim) else Replicate() for p in placements)
    if keep == tuple(placements):
        return dt.to_local(), lambda o: o
    gathered = dt.redistribute(mesh, keep)

    def back(o: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(o, mesh, keep, run_check=False, shape=dt.shape,
                                  stride=dt.stride())  # fmt: skip
        return full.redistribute(mesh, placements).to_local()

    return gathered.to_local(), back


def gather_costs(
    p: torch.Tensor, layout: Layout | None, itemsize: int
) -> tuple[int, tuple[int, ...]]:
    """What ``whole`` costs for the parameter ``p``: (bytes this rank sends, the shape
    Newton-Schulz then runs on). Each gathered mesh dim is an all-gather of equal (padded)
    chunks; gathering n of them, the ring sends (n - 1) chunk-sized pieces, whether in one
    collective or one per mesh dim (local x (n1 - 1) + local n1 x (n2 - 1) = local x
    (n1 n2 - 1))."""
    if isinstance(p, DTensor):
        mesh, placements = p.device_mesh, p.placements
    elif layout is not None:
        mesh, placements = layout
    else:
        return 0, tuple(p.shape)
    shape = list(global_shape(p, layout))
    splits = [1] * len(shape)  # how many ways each dim is split
    gathered = 1
    for size, placement in zip(mesh.shape, placements, strict=True):
        dim = _split_dim(placement)
        if dim is not None:
            splits[dim] *= size
            if not _keeps(placement, len(shape)):
                gathered *= size
    chunk = math.prod(-(-d // n) for d, n in zip(shape, splits, strict=True))
    if any(_keeps(placement, len(shape)) for placement in placements):  # this rank's experts
        shape[0] = (p.to_local() if isinstance(p, DTensor) else p).shape[0]
    return chunk * (gathered - 1) * itemsize, tuple(shape)


def global_shape(p: torch.Tensor, layout: Layout | None) -> tuple[int, ...]:
    """The full shape of the tensor ``p`` is (a slice of)."""
    if isinstance(p, DTensor) or layout is None:
        return tuple(p.shape)
    mesh, placements = layout
    shape = list(p.shape)
    for size, placement in zip(mesh.shape, placements, strict=True):
        dim = _split_dim(placement)
        if dim is not None:
            shape[dim] *= size
    return tuple(shape)


class WholeMatrices:
    """Orthogonalizes each update of a group as its whole matrices (``whole``): the default
    for parameters that are DTensors, EP slices (``layouts``) or plain."""

    def __init__(self, layouts: dict[torch.Tensor, Layout] | None = None) -> None:
        self.layouts = layouts or {}

    def shapes(self, params: list[torch.Tensor]) -> list[tuple[int, ...]]:
        return [global_shape(p, self.layouts.get(p)) for p in params]

    def __call__(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], steps: int, dtype
    ) -> list[torch.Tensor]:
        out = []
        for p, u in zip(params, updates, strict=True):
            w, back = whole(u, self.layouts.get(p), dtype)
            out.append(back(newton_schulz(w, steps, dtype)))
        return out

    def costs(self, params: list[torch.Tensor], steps: int, dtype) -> tuple[int, int]:
        """(bytes this rank sends, Newton-Schulz FLOPs) of one step over ``params``."""
        sent = flops = 0
        for p in params:
            b, shape = gather_costs(p, self.layouts.get(p), dtype.itemsize)
            sent += b
            flops += ns_flops(shape, steps)
        return sent, flops


# ----------------------------------------------------------------------------- the optimizer


class _MuonSteps:
    """The Muon group of a ``Muon`` optimizer (``group["muon"]``) stepped here; the other
    groups by the AdamW class it is mixed into."""

    whole: Any

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups  # type: ignore[attr-defined]
        for group in groups:
            if group.get("muon"):
                self._muon_step(group)
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            super().step()  # type: ignore[misc]
        finally:
            self.param_groups = groups
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        state = self.state  # type: ignore[attr-defined]
        bufs = []
        for p in params:
            st = state[p]
            if "momentum_buffer" not in st:
                kind = self.moments_dtype or p.grad.dtype  # type: ignore[attr-defined]
                st["momentum_buffer"] = torch.zeros_like(p.grad, dtype=kind)
                # A step count as AdamW keeps one (torch's Adam expects it in every state
                # it loads); Muon's arithmetic does not read it.
                st["step"] = torch.zeros((), dtype=torch.float32)
            st["step"] += 1
            bufs.append(st["momentum_buffer"])
        lr, wd = group["lr"], group["weight_decay"]
        dtype = NS_DTYPES[group["ns_dtype"]]

        def orthogonalize(updates: list[torch.Tensor]) -> list[torch.Tensor]:
            if lr == 0:  # no update to make (DCP's state initialisation steps at lr 0)
                return updates
            return self.whole(params, updates, group["ns_steps"], dtype)

        directions = muon_directions([p.grad for p in params], bufs, group["momentum"],
                                     orthogonalize)  # fmt: skip
        if lr == 0:
            return
        for p, o, shape in zip(params, directions, self.whole.shapes(params), strict=True):
            scale = group["update_rms"] * math.sqrt(max(shape[-2:]))
            mine = p.to_local() if isinstance(p, DTensor) else p
            mine.mul_(1 - lr * wd)
            mine.add_(o.to_local() if isinstance(o, DTensor) else o, alpha=-(lr * scale))

    def step_costs(self) -> dict[str, int]:
        """What one step of the Muon group costs this rank, from the parameters' layouts
        (``moetrain plan`` reads it; tests/plan/test_exact.py measures it): the bytes its
        gathers send (ring convention, as ``moetrain.parallel.accounting.CommCounter``
        counts them) and the Newton-Schulz FLOPs."""
        sent = flops = 0
        for group in self.param_groups:  # type: ignore[attr-defined]
            if group.get("muon") and group["params"]:
                b, f = self.whole.costs(
                    group["params"], group["ns_steps"], NS_DTYPES[group["ns_dtype"]]
                )
                sent, flops = sent + b, flops + f
        return {"sent": sent, "ns_flops": flops}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts every floating state tensor to its parameter's dtype: bf16 momentum
        buffers are cast back (``optim.moments_dtype=bf16``)."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        dtype = self.moments_dtype  # type: ignore[attr-defined]
        if dtype is None:
            return
        for st in self.state.values():  # type: ignore[attr-defined]
            buf = st.get("momentum_buffer")
            if buf is not None and buf.dtype != dtype:
                st["momentum_buffer"] = buf.to(dtype)


class Muon(_MuonSteps, AdamW):
    """Muon on the group flagged ``muon``, torch's AdamW on the others (fp32 state)."""


class BF16MomentsMuon(_MuonSteps, BF16MomentsAdamW):
    """Muon with a bf16 momentum buffer, AdamW with bf16 moments (``moments_dtype=bf16``)."""


def build_muon(
    decay: list[torch.Tensor],
    no_decay: list[torch.Tensor],
    matrices: list[torch.Tensor],
    cfg: OptimConfig,
    whole_matrices: Any = None,
) -> torch.optim.Optimizer:
    """AdamW's two groups (decayed, not decayed) and Muon's group, always in this order.
    ``whole_matrices``: how the Muon group's updates become whole matrices (default: each
    parameter's own layout, gathered: ``WholeMatrices()``; the trainer passes
    ``moetrain.train.muon_owners.expert_matrices``)."""
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": matrices, "weight_decay": cfg.weight_decay, "muon": True,
         "momentum": cfg.muon_momentum, "ns_steps": cfg.muon_ns_steps,
         "ns_dtype": cfg.muon_ns_dtype, "update_rms": cfg.muon_update_rms},
    ]  # fmt: skip
    cls = Muon if cfg.moments_dtype == "fp32" else BF16MomentsMuon
    opt = cls(groups, **torch_kwargs(cfg, [*decay, *no_decay, *matrices], cfg.moments_dtype))
    opt.whole = whole_matrices if whole_matrices is not None else WholeMatrices()
    return opt


# ----------------------------------------------------------------------------- which parameters


def muon_matrices(model: nn.Module, cfg: OptimConfig) -> set[int]:
    """ids of the trainable parameters Muon updates: every ``nn.Linear`` weight and every
    routed expert's weight matrices (``GroupedExperts`` w1, w3, w2: (E, A, B)), except the
    embedding, the output head and the router gates unless ``cfg`` says otherwise. Never
    norms, biases (experts' (E, F) biases included) or buffers."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = getattr(model, "output", None)
    head = {id(output.weight)} if isinstance(output, nn.Linear) else set()
    gates = {
        id(p)
        for m in model.modules()
        if isinstance(m, (Router, MoELayer))
        for sub in ([m] if isinstance(m, Router) else [m.shared_expert_gate])
        if sub is not None
        for p in sub.parameters()
    }
    out = set()
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            candidates = [getattr(m, n) for n in ("w1", "w3", "w2")]
        elif isinstance(m, nn.Linear):
            candidates = [m.weight]
        elif isinstance(m, nn.Embedding) and cfg.muon_embedding:
            candidates = [m.weight]
        else:
            continue
        for p in candidates:
            if p is None or not p.requires_grad:
                continue
            i = id(p)
            if i in embedding and not cfg.muon_embedding:
                continue
            if i in head - embedding and not cfg.muon_output:
                continue
            if i in gates and not cfg.muon_router:
                continue
            out.add(i)
    return out


__all__ = [
    "BF16MomentsMuon",
    "Muon",
    "NS_COEFFICIENTS",
    "WholeMatrices",
    "build_muon",
    "gather_costs",
    "momentum_update",
    "muon_directions",
    "muon_matrices",
    "newton_schulz",
    "ns_flops",
    "whole",
]
