"""Newton-Schulz once per matrix: each sharded Muon matrix orthogonalized by one of its holders.

``WholeMatrices`` (``moetrain.train.muon``) gathers a sharded matrix on every rank that holds
a slice of it and repeats the iteration there (Moonlight's distributed Muon): the FLOPs are
multiplied by the number of holders. ``OwnerMatrices`` (``optim.muon_distributed=owners``,
the default) gives each matrix one *owner* among its holders instead:

1. **Ownership.** The ranks that split a group of parameters the same way (the same mesh dims,
   e.g. FSDP2's shard dim, TP's dim, both) share the group's parameters out by Newton-Schulz
   FLOPs, greedily (largest first, to the least loaded rank: LPT). A parameter is the unit:
   a 2-D matrix, or a rank's experts of one 3-D weight (orthogonalized as the batch one
   process orthogonalizes, which keeps the arithmetic bit for bit: a CPU ``bmm`` may round a
   matrix differently in a batch of another size).
2. **To the owner.** Every holder sends its slice of each matrix to the matrix's owner, in
   the Newton-Schulz dtype: one ``all_to_all`` per split mesh dim (a 2-D split routes in two
   hops, each inside a group the mesh already has). The owner writes every slice where it
   belongs: a ``Shard`` split is ``torch.chunk``'s view, FSDP2's ``_StridedShard`` (ZeRO-3
   over a TP block) DTensor's own split, kept as flat indices per shape.
3. **Back.** The owner orthogonalizes its matrices whole and returns each holder its slice
   over the same hops in reverse.

Replicated mesh dims (HSDP's replicas) are not split: each replica group repeats its own
share, as it repeats the rest of its optimizer step (sharing it across replicas would send
every result over the replica link, which HSDP keeps for the gradient all-reduce). A rank's
experts under EP or FSDP2's expert-dim shard are whole already and stay where they are.
FLOPs: 1 / n of the gather's FLOPs per rank, up to the balance of the shares; bytes: 2 / n
of the gather's (a slice goes to its owner and comes back, (n - 1) / n^2 of a matrix each
way on average, where the all-gather sends (n - 1) / n of it from every holder): the same
at n = 2, fewer beyond.
``moetrain plan`` prices both from ``costs`` (exact: measured by tests/plan/test_exact.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moetrain.config import OptimConfig
from moetrain.model.init import fqn
from moetrain.parallel.expert_parallel import expert_layouts
from moetrain.train import muon
from moetrain.train.muon import Layout, WholeMatrices, _keeps, _split_dim, global_shape, ns_flops

Coord = tuple[int, ...]
Packet = tuple[int, Coord]
"""(a unit's index, the coordinate of the holder whose slice it is)."""


@dataclass(frozen=True)
class _Unit:
    """One Muon parameter as the routing sees it."""

    index: int
    """Its position in the group's parameter list."""
    shape: tuple[int, ...]
    """The tensor Newton-Schulz runs on: whole over the routed mesh dims, this rank's experts
    over an expert dim that is kept."""
    placements: tuple[Any, ...]
    """The placements of the routed mesh dims, in mesh order."""
    sizes: tuple[int, ...]
    """Their mesh sizes."""
    flops: int


@dataclass(frozen=True)
class _Route:
    """A group of units split over the same mesh dims: their owners and the hops."""

    mesh: Any
    dims: tuple[int, ...]
    """The routed mesh dims, in mesh order (a hop over each, in its process group)."""
    me: Coord
    """This rank's coordinate over the routed dims."""
    units: tuple[_Unit, ...]
    owners: tuple[Coord, ...]
    numels: dict[int, dict[Coord, int]]
    """Each unit's slice sizes per coordinate (``slice_numels``)."""
    hops: list[tuple[list[list[Packet]], list[list[Packet]]]]
    """What each hop sends to and receives from each peer (``_hops``)."""


def coords_of(sizes: tuple[int, ...]) -> list[Coord]:
    """Every coordinate over mesh dims of these sizes, row-major."""
    return list(itertools.product(*(range(n) for n in sizes)))


def slice_of(full: torch.Tensor, placements: tuple[Any, ...], sizes: tuple[int, ...],
             coord: Coord) -> torch.Tensor:  # fmt: skip
    """The slice of ``full`` the rank at ``coord`` holds: each mesh dim's split in mesh order,
    as DTensor distributes a tensor (``Shard``: ``torch.chunk``, ranks past the last chunk
    empty; ``_StridedShard``: its interleaved chunks). A view of ``full`` when every split is
    a plain ``Shard``; a copy otherwise."""
    t = full
    for placement, n, c in zip(placements, sizes, coord, strict=True):
        if type(placement) is Shard:
            chunks = torch.chunk(t, n, dim=placement.dim)
            size = t.size(placement.dim)
            t = chunks[c] if c < len(chunks) else t.narrow(placement.dim, size, 0)
        else:
            t = placement._split_tensor(t, n, with_padding=False)[0][c]
    return t


_MAPS: dict[tuple, list[torch.Tensor]] = {}


class Slices:
    """Each coordinate's slice of a unit's tensor, to write into and read out of. Plain
    ``Shard`` splits are views (nothing stored); FSDP2's ``_StridedShard`` interleaves rows,
    so its slices are flat indices into the tensor, computed once per shape and split."""

    def __init__(self, unit: _Unit, device: torch.device) -> None:
        self.unit = unit
        self.coords = coords_of(unit.sizes)
        self.maps: list[torch.Tensor] | None = None
        if any(type(p) is not Shard for p in unit.placements):
            key = (unit.shape, unit.placements, unit.sizes, str(device))
            if key not in _MAPS:
                full = torch.arange(math.prod(unit.shape), device=device).view(unit.shape)
                _MAPS[key] = [slice_of(full, unit.placements, unit.sizes, c).reshape(-1)
                              for c in self.coords]  # fmt: skip
            self.maps = _MAPS[key]

    def put(self, full: torch.Tensor, pieces: dict[Coord, torch.Tensor]) -> None:
        """Write each coordinate's flat piece where it belongs in ``full``."""
        for j, c in enumerate(self.coords):
            if self.maps is not None:
                full.view(-1)[self.maps[j]] = pieces[c]
            else:
                view = slice_of(full, self.unit.placements, self.unit.sizes, c)
                view.copy_(pieces[c].view(view.shape))

    def take(self, full: torch.Tensor) -> dict[Coord, torch.Tensor]:
        """Each coordinate's slice of ``full``, flat."""
        if self.maps is not None:
            flat = full.reshape(-1)  # (Newton-Schulz returns a tall matrix transposed)
            return {c: flat[m] for c, m in zip(self.coords, self.maps, strict=True)}
        return {c: slice_of(full, self.unit.placements, self.unit.sizes, c).reshape(-1)
                for c in self.coords}  # fmt: skip


def slice_numels(unit: _Unit) -> dict[Coord, int]:
    """The elements each coordinate's slice holds (from the meta device: no index maps)."""
    full = torch.empty(unit.shape, device="meta")
    return {c: slice_of(full, unit.placements, unit.sizes, c).numel()
            for c in coords_of(unit.sizes)}  # fmt: skip


def assign_owners(flops: list[int], n: int) -> list[int]:
    """Each unit's owner among ``n`` ranks: largest first to the least loaded (ties: the
    earlier unit, the lower rank) -- every rank computes the same answer."""
    load = [0] * n
    out = [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: (-flops[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + flops[i]
    return out


def _ranks_along(mesh: Any, coord: list[int], dim: int) -> tuple[int, ...]:
    """The ranks of ``mesh`` that differ from ``coord`` in mesh dim ``dim`` alone (its
    process group's members, read from the mesh: the plan's meshes have no groups)."""
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
    return tuple(mesh.mesh[index].tolist())


def _layout(p: torch.Tensor, layout: Layout | None) -> Layout | None:
    if isinstance(p, DTensor):
        return p.device_mesh, tuple(p.placements)
    return layout


class OwnerMatrices(WholeMatrices):
    """``WholeMatrices`` with each sharded matrix orthogonalized by one owner (the module's
    docstring); a parameter it cannot route (split on an expert dim it does not keep) is
    gathered as ``WholeMatrices`` does."""

    def __init__(self, layouts: dict[torch.Tensor, Layout] | None = None) -> None:
        super().__init__(layouts)
        self._plans: dict[tuple, tuple[list[_Route], list[int]]] = {}

    def plan(self, params: list[torch.Tensor], steps: int) -> tuple[list[_Route], list[int]]:
        """(the routes, the indices of parameters orthogonalized where they are: whole
        already, or gathered). The same parameters are planned once."""
        key = (tuple(id(p) for p in params), steps)
        if key not in self._plans:
            self._plans[key] = self._plan(params, steps)
        return self._plans[key]

    def _plan(self, params: list[torch.Tensor], steps: int) -> tuple[list[_Route], list[int]]:
        classes: dict[tuple, tuple[tuple[Any, tuple[int, ...]], Coord, list[_Unit]]] = {}
        here: list[int] = []
        for i, p in enumerate(params):
            layout = _layout(p, self.layouts.get(p))
            if layout is None:
                here.append(i)
                continue
            mesh, placements = layout
            shape = list(global_shape(p, self.layouts.get(p)))
            dims = [d for d, pl in enumerate(placements)
                    if _split_dim(pl) is not None and not _keeps(pl, len(shape))]  # fmt: skip
            if any(_keeps(pl, len(shape)) for pl in placements):  # this rank's experts
                shape[0] = (p.to_local() if isinstance(p, DTensor) else p).shape[0]
            if not dims or (len(shape) == 3 and any(_split_dim(placements[d]) == 0 for d in dims)):
                here.append(i)
                continue
            coord = mesh.get_coordinate()
            assert coord is not None
            me = tuple(coord[d] for d in dims)
            key = tuple(_ranks_along(mesh, coord, d) for d in dims)
            sizes = tuple(mesh.size(d) for d in dims)
            unit = _Unit(i, tuple(shape), tuple(placements[d] for d in dims), sizes,
                         ns_flops(shape, steps))  # fmt: skip
            classes.setdefault(key, ((mesh, tuple(dims)), me, []))[2].append(unit)
        routes = []
        for (mesh, dims), me, units in classes.values():  # in the order of their first parameter:
            # the same on every rank of a group (sorting by the groups' names would not be,
            # and two groups' all-to-alls taken in different orders deadlock)
            sizes = units[0].sizes
            flat = assign_owners([u.flops for u in units], math.prod(sizes))
            coords = coords_of(sizes)
            owners = tuple(coords[o] for o in flat)
            routes.append(_Route(mesh, dims, me, tuple(units), owners,
                                 {u.index: slice_numels(u) for u in units},
                                 _hops(me, units, owners)))  # fmt: skip
        return routes, here

    def __call__(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], steps: int, dtype
    ) -> list[torch.Tensor]:
        routes, here = self.plan(params, steps)
        out: list[Any] = [None] * len(params)
        for i in here:
            w, back = muon.whole(updates[i], self.layouts.get(params[i]), dtype)
            out[i] = back(muon.newton_schulz(w, steps, dtype))
        for route in routes:
            mine = {}
            for u in route.units:
                upd = updates[u.index]
                mine[u.index] = (upd.to_local() if isinstance(upd, DTensor) else upd).to(dtype)
            out_local = orthogonalize_owned(route, mine, steps, dtype)
            for u in route.units:
                out[u.index] = out_local[u.index]
        return out

    def costs(self, params: list[torch.Tensor], steps: int, dtype) -> tuple[int, int]:
        """(bytes this rank sends, Newton-Schulz FLOPs) of one step over ``params``: the
        parameters it owns, and each hop's all-to-all counted as
        ``moetrain.parallel.accounting.CommCounter`` counts one ((n - 1) / n of what it is
        handed), there and back."""
        routes, here = self.plan(params, steps)
        sent = 0.0
        flops = 0
        for i in here:
            b, f = WholeMatrices.costs(self, [params[i]], steps, dtype)
            sent, flops = sent + b, flops + f
        for route in routes:
            for n, (send, recv) in zip(route.units[0].sizes, route.hops, strict=True):
                moved = sum(route.numels[i][c] for keys in (*send, *recv) for i, c in keys)
                sent += (n - 1) / n * moved * dtype.itemsize  # there (send), back (recv)
            flops += sum(u.flops for u, o in zip(route.units, route.owners, strict=True)
                         if o == route.me)  # fmt: skip
        return round(sent), flops


def matrices_for(cfg: OptimConfig, layouts: dict[torch.Tensor, Layout] | None = None) -> Any:
    """How the Muon group's updates are orthogonalized whole (``optim.muon_distributed``):
    by one owner each (``moetrain.train.muon_owners``) or by every holder."""
    if cfg.muon_distributed == "owners":
        return OwnerMatrices(layouts)
    return WholeMatrices(layouts)


def expert_matrices(parts: list[nn.Module], meshes: Any, cfg: Any) -> WholeMatrices:
    """``matrices_for`` the job, knowing where this rank's expert slices sit under expert
    parallelism (``expert_layouts``; none without it). ``cfg``: the job's config."""
    found = expert_layouts(parts, meshes, cfg.parallel)
    layouts = {}
    for part in parts:
        for name, p in part.named_parameters():
            if fqn(name) in found:
                layouts[p] = found[fqn(name)]
    return matrices_for(cfg.optim, layouts)


def _hops(
    me: Coord, units: list[_Unit], owners: tuple[Coord, ...]
) -> list[tuple[list[list[Packet]], list[list[Packet]]]]:
    """For each routed dim k: (what this rank sends to each peer along k, what it receives
    from each), both in the order every rank lists them. Before hop k a rank holds the
    slices (i, c) with owner(i)[:k] = me[:k] and c[k:] = me[k:]; hop k sends each to the peer
    at owner(i)[k]. After the last hop a rank holds every slice of the units it owns."""
    coords = coords_of(units[0].sizes)
    out = []
    for k, n in enumerate(units[0].sizes):
        send: list[list[Packet]] = [[] for _ in range(n)]
        recv: list[list[Packet]] = [[] for _ in range(n)]
        for u, owner in zip(units, owners, strict=True):
            if owner[:k] != me[:k]:
                continue
            for c in coords:
                if c[k + 1 :] != me[k + 1 :]:
                    continue
                if c[k] == me[k]:  # held before the hop: goes to the owner's peer
                    send[owner[k]].append((u.index, c))
                if owner[k] == me[k]:  # peer c[k] holds it and sends it here
                    recv[c[k]].append((u.index, c))
        out.append((send, recv))
    return out


def _exchange(
    group: Any,
    held: dict[Packet, torch.Tensor],
    send: list[list[Packet]],
    recv: list[list[Packet]],
    numel: Callable[[Packet], int],
    like: torch.Tensor,
) -> dict[Packet, torch.Tensor]:
    """One all-to-all over ``group``: ``send[x]``'s slices to peer x, ``recv[x]``'s from it."""
    pieces = [held[key] for keys in send for key in keys]
    inp = torch.cat(pieces) if pieces else like.new_empty(0)
    in_splits = [sum(numel(k) for k in keys) for keys in send]
    out_splits = [sum(numel(k) for k in keys) for keys in recv]
    outp = like.new_empty(sum(out_splits))
    dist.all_to_all_single(outp, inp, out_splits, in_splits, group=group)
    got, start = {}, 0
    for key in (k for keys in recv for k in keys):
        got[key] = outp[start : start + numel(key)]
        start += numel(key)
    return got


def orthogonalize_owned(
    route: _Route, mine: dict[int, torch.Tensor], steps: int, dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """This rank's slice of each unit's orthogonalized update (``mine``: its slices of the
    updates, in the Newton-Schulz dtype): the slices sent to the owners, the owned units
    orthogonalized whole, the results' slices returned."""
    like = next(iter(mine.values()))

    def numel(key: Packet) -> int:
        return route.numels[key[0]][key[1]]

    held: dict[Packet, torch.Tensor] = {(i, route.me): t.reshape(-1) for i, t in mine.items()}
    hops = route.hops
    groups = [route.mesh.get_group(d) for d in route.dims]
    for group, (send, recv) in zip(groups, hops, strict=True):
        held = _exchange(group, held, send, recv, numel, like)
    results: dict[Packet, torch.Tensor] = {}
    for u, owner in zip(route.units, route.owners, strict=True):
        if owner != route.me:
            continue
        slices = Slices(u, like.device)
        full = like.new_empty(u.shape)
        slices.put(full, {c: held[(u.index, c)] for c in slices.coords})
        o = muon.newton_schulz(full, steps, dtype)
        for c, piece in slices.take(o).items():
            results[(u.index, c)] = piece
    for group, (send, recv) in reversed(list(zip(groups, hops, strict=True))):
        results = _exchange(group, results, recv, send, numel, like)
    return {u.index: results[(u.index, route.me)].view(mine[u.index].shape)
            for u in route.units}  # fmt: skip


__all__ = [
    "OwnerMatrices",
    "expert_matrices",
    "matrices_for",
    "assign_owners",
    "coords_of",
    "Slices",
    "orthogonalize_owned",
    "slice_of",
]
