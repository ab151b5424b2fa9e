"""Expert-parallel dispatchers: the same phases as ``LocalDispatcher``, across ranks.

Rank r of an expert-parallel (EP) group of size ``ep`` owns experts
``[r * E/ep, (r+1) * E/ep)``. Routing, capacity and the dispatch plan are computed on the
*source* rank from its own tokens (``plan_dispatch`` over all E experts), exactly as a
single process would for the same token group; the dispatchers only move the rows the plan
keeps. That is what lets a single-process run reproduce drops, losses and gradients.

``AllToAllDispatcher``  permute locally (expert-major = grouped by destination rank), one
    small ``all_to_all_single`` of per-(rank, local expert) counts, ``all_to_all_single`` of
    the rows, regroup by local expert; the combine reverses each step. Dropless, the rows
    travel as they were kept, with uneven splits the host reads from the counts (its only
    host sync, once per layer). With a capacity factor every expert's segment travels in
    as many slots as it can hold (``DispatchPlan.expert_rows``): static splits, no host
    sync. With ``moe.pad_to_capacity`` the segments are that size already and there is no
    count exchange at all. Every row transfer is issued by one autograd node and waited
    for by another (``Transfer``), forward and backward, so that work between the phases
    overlaps it: the shared experts (``parallel.overlap_shared_experts``: the side
    computation of ``finish_dispatch``) and the other half of the tokens
    (``parallel.ep_overlap=halves``: ``moetrain.model.transformer``).
``AllGatherDispatcher`` all-gather tokens, combine weights and plans over the EP group;
    every rank runs its local experts on all the group's tokens; a reduce-scatter returns
    each rank's partial sums. More bytes, no count exchange: for small ``ep``.

``ExpertTPDispatcher`` wraps either (or the local dispatcher) when every expert's FFN width
    is split over the tensor-parallel ranks: its tokens and combine weights enter, and the
    combined output leaves, the TP region once per layer.

The process group is handed in by ``moetrain.parallel.expert_parallel.apply_ep``; nothing
here creates one. Every collective is wrapped in a small autograd Function (the list form
of ``all_to_all`` fails on gloo with uneven sizes). Each dispatch carries its own state in
its ``Flight``: two may be in flight at once.

Shape legend: T local tokens, K top-k, D model dim, E experts, El = E / ep local experts,
P = ep ranks, N local buffer rows, R rows this rank's experts process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrain.kernels import permute, unpermute
from moetrain.model.dispatch import DispatchPlan, Flight, Phases

# ----------------------------------------------------------------------------- collectives


class Transfer:
    """One all-to-all whose issue and wait are two autograd nodes (``IssueFunction``,
    ``AwaitFunction``), so that work between them overlaps it, in both directions: forward,
    the issue node sends the rows and the await node waits for them; backward runs the nodes
    in reverse, so the await node sends the gradients and the issue node waits for them.
    Whatever autograd runs between the two (the nodes created between them in forward:
    another token set's, the shared experts) overlaps the gradients' transfer too."""

    def __init__(self, out_splits: list[int], in_splits: list[int], group) -> None:
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = None
        self.grad: torch.Tensor | None = None

    def issue(self, out: torch.Tensor, x: torch.Tensor, out_splits, in_splits) -> None:
        self.work = dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
            group=self.group, async_op=True)  # fmt: skip

    def wait(self) -> None:
        assert self.work is not None, "waited for a transfer that was not issued"
        self.work.wait()
        self.work = None


class IssueFunction(torch.autograd.Function):
    """Forward: issue the rows' all-to-all (``Transfer``) and return the receive buffer, to
    be read after ``AwaitFunction``. Backward: wait for the gradients' all-to-all that
    ``AwaitFunction``'s backward issued, and return them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: Transfer) -> torch.Tensor:  # type: ignore[override]
        out = x.new_empty((sum(t.out_splits), *x.shape[1:]))
        t.issue(out, x, t.out_splits, t.in_splits)
        ctx.t = t
        return out

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):  # type: ignore[override]
        t = ctx.t
        t.wait()
        grad, t.grad = t.grad, None
        return grad, None


class AwaitFunction(torch.autograd.Function):
    """Forward: wait for the rows ``IssueFunction`` sent (identity on its buffer). Backward:
    issue the gradients' all-to-all, splits swapped, for ``IssueFunction``'s backward to
    wait for (the gradient it passes on is a placeholder)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, t: Transfer) -> torch.Tensor:  # type: ignore[override]
        t.wait()
        ctx.t = t
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        t = ctx.t
        t.grad = grad.new_empty((sum(t.in_splits), *grad.shape[1:]))
        t.issue(t.grad, grad, t.in_splits, t.out_splits)
        return grad, None


class AllGatherFunction(torch.autograd.Function):
    """Concatenate equal-shaped tensors of the group along dim 0; backward reduce-scatters
    (sums) the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.group), None


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class ReduceScatterFunction(torch.autograd.Function):
    """Sum over the group, each rank keeping its own dim-0 chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class CopyToTPFunction(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the expert-TP group (each TP
    rank only holds the input gradient of its slice of the FFN width)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTPFunction(torch.autograd.Function):
    """All-reduce forward (partial expert outputs of the FFN slices); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _all_gather_nograd(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


# ----------------------------------------------------------------------------- helpers


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def regroup_index(counts_PL: torch.Tensor, total: int) -> torch.Tensor:
    """Rows arrive ordered (source rank p, local expert l); return the gather index that
    orders them (l, p), i.e. expert-contiguous. ``total`` = counts_PL.sum() (known on host)."""
    P, L = counts_PL.shape
    src_start_PL = _exclusive_cumsum(counts_PL.reshape(-1)).view(P, L)
    counts_LP = counts_PL.t().reshape(-1)
    block_R = torch.repeat_interleave(
        torch.arange(P * L, device=counts_PL.device), counts_LP, output_size=total
    )
    offset_R = torch.arange(total, device=counts_PL.device) - _exclusive_cumsum(counts_LP)[block_R]
    return src_start_PL.t().reshape(-1)[block_R] + offset_R


def _kept_per_expert(plan: DispatchPlan) -> torch.Tensor:
    """int64 rows the plan keeps for each of the E experts (its group offsets' steps)."""
    offs_E = plan.offs_E.long()
    return torch.diff(offs_E, prepend=offs_E.new_zeros(1))


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv


class _CommCounter:
    """Bytes this rank sent to *other* ranks in forward dispatch + combine since the last pop.
    Host numbers (the split sizes are on the host anyway): no device sync to count them."""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def pop_comm_bytes(self) -> float:
        out, self.bytes_sent = float(self.bytes_sent), 0
        return out


# ----------------------------------------------------------------------------- expert TP


class AmaxOverGroup:
    """The elementwise max of an FP8 amax over ``group`` (``GroupedExperts.amax_reduce``):
    under expert tensor parallelism a scale over the FFN width covers every rank's slice."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        out = amax.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out


class ExpertTPDispatcher(Phases):
    """Expert tensor parallelism around any dispatcher: every rank of ``group`` routes the
    same tokens and holds a slice of every expert's FFN width, so its expert outputs are
    partial sums. Megatron's f/g pair at the token level, where it is cheapest:

    - the tokens enter through ``CopyToTPFunction`` (identity; backward all-reduces the
      input gradient, which each rank has for its slice only): T x D, not the T x K rows;
    - the combine weights too (their gradient <y_tk, dL/dy_t> is partial: T x K scalars);
    - the weighted sum leaves through ``ReduceFromTPFunction`` (all-reduce): T x D.

    ``inner`` (``LocalDispatcher`` or an expert-parallel dispatcher over this rank's EP
    group, of its own TP index) moves the rows as it would without tensor parallelism."""

    def __init__(self, inner, group) -> None:
        self.inner = inner
        self.group = group

    def start_dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str) -> Flight:
        return self.inner.start_dispatch(CopyToTPFunction.apply(x_TD, self.group), plan, backend)

    def finish_dispatch(
        self, flight: Flight, side: Callable[[], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.inner.finish_dispatch(flight, side)

    def start_combine(self, flight: Flight, y_ND: torch.Tensor) -> None:
        self.inner.start_combine(flight, y_ND)

    def finish_combine(self, flight: Flight, weights_TK: torch.Tensor) -> torch.Tensor:
        weights_TK = CopyToTPFunction.apply(weights_TK, self.group)
        return ReduceFromTPFunction.apply(self.inner.finish_combine(flight, weights_TK), self.group)

    @property
    def overlapped(self) -> int:
        return getattr(self.inner, "overlapped", 0)

    @property
    def bytes_sent(self) -> float:
        return self.inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: float) -> None:
        self.inner.bytes_sent = value

    def pop_comm_bytes(self) -> float:
        return self.inner.pop_comm_bytes()


@dataclass
class _Route:
    """How one dispatch's rows travel when the kept rows go as they lie: the split sizes
    (host lists), the rows each local expert receives from each source (``counts_PL``, on
    the device) and the gather that orders the received rows expert-contiguous
    (``index_R``). ``pack`` / ``unpack`` turn the sender's expert-contiguous buffer of
    ``rows`` rows into the ``sent`` rows that travel, and the returned rows back."""

    send: list[int]
    recv: list[int]
    counts_PL: torch.Tensor
    index_R: torch.Tensor
    sent: int
    rows: int

    def pack(self, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND[: self.sent]

    def settle(self) -> None:
        """Before the received rows are read: what the route still waits for (nothing)."""

    def unregroup(self, y_RD: torch.Tensor) -> torch.Tensor:
        """The experts' output rows back in arrival order (the inverse of ``index_R``)."""
        return y_RD.index_select(0, _inverse(self.index_R))

    def unpack(self, y_back: torch.Tensor) -> torch.Tensor:
        """The returned rows as the sender's buffer (the rows past the kept ones zero)."""
        return torch.nn.functional.pad(y_back, (0, 0, 0, self.rows - self.sent))


@dataclass
class _SlotRoute(_Route):
    """Every expert's segment travels in C slots (``AllToAllDispatcher._slot_route``):
    ``send_src`` / ``send_kept`` the sender's row and whether it holds one for each slot
    (E C), ``offs_E`` / ``kept_E`` the sender's segments. The counts travel beside the rows
    (``counts``, in flight until ``settle``); then ``recv_kept`` says which received slots
    hold a row and ``index_R`` orders them."""

    send_src: torch.Tensor
    send_kept: torch.Tensor
    offs_E: torch.Tensor
    kept_E: torch.Tensor
    slots: int
    counts: Transfer | None = None
    recv_kept: torch.Tensor | None = None

    def pack(self, x_ND: torch.Tensor) -> torch.Tensor:
        return torch.where(self.send_kept[:, None], x_ND.index_select(0, self.send_src), 0)

    def settle(self) -> None:
        """The counts arrived: slot (p, l, i) holds a row when i < counts[p, l]; the kept
        rows go first, expert-contiguous in (l, p, i) order (the dropless route's), the
        empty slots after the last offset in arrival order."""
        if self.counts is None:
            return
        self.counts.wait()
        self.counts = None
        counts_PL, C = self.counts_PL, self.slots
        P, L = counts_PL.shape
        slot_C = torch.arange(C, device=counts_PL.device)
        self.recv_kept = (slot_C < counts_PL[..., None]).reshape(-1)
        start_PL = _exclusive_cumsum(counts_PL.t().reshape(-1)).view(L, P).t()
        kept_at = (start_PL[..., None] + slot_C).reshape(-1)
        pad_at = counts_PL.sum() + _exclusive_cumsum((~self.recv_kept).long())
        self.index_R = _inverse(torch.where(self.recv_kept, kept_at, pad_at))

    def unregroup(self, y_RD: torch.Tensor) -> torch.Tensor:
        assert self.recv_kept is not None, "combine before the counts arrived"
        return torch.where(self.recv_kept[:, None], super().unregroup(y_RD), 0)

    def unpack(self, y_back: torch.Tensor) -> torch.Tensor:
        offs_E, kept_E = self.offs_E, self.kept_E
        n_N = torch.arange(self.rows, device=offs_E.device)
        e_N = torch.searchsorted(offs_E, n_N, right=True).clamp(max=offs_E.numel() - 1)
        kept_N = n_N < offs_E[-1]
        src_N = torch.where(kept_N, e_N * self.slots + n_N - (offs_E - kept_E)[e_N], 0)
        return torch.where(kept_N[:, None], y_back.index_select(0, src_N), 0)


# ----------------------------------------------------------------------------- all-to-all


@dataclass
class _AllToAllFlight:
    """An all-to-all dispatch between its phases: its route, and the rows in flight (out,
    then back) with their transfer."""

    route: _Route
    transfer: Transfer
    rows: torch.Tensor


class AllToAllDispatcher(_CommCounter, Phases):
    """Tokens travel to the rank owning their expert and back with ``all_to_all_single``."""

    def __init__(
        self, group, num_experts: int, padded: bool = False, dropless_slots: bool = False
    ):
        """``padded``: the layer plans with ``moe.pad_to_capacity`` (static split sizes).
        ``dropless_slots``: dropless plans travel like capacity plans, every expert's segment
        in one slot per token (the most it can receive), so that nothing waits on the host
        (``parallel.ep_dropless_transport=slots``)."""
        super().__init__()
        self.padded = padded
        self.dropless_slots = dropless_slots
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        self.overlapped = 0
        """Dispatches that ran a side computation while the rows travelled."""

    def start_dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str) -> Flight:
        """Permute the tokens expert-major (grouped by destination rank), choose the route
        and issue the rows."""
        x_ND = permute(x_TD, plan.dest_TK, plan.num_rows, backend=backend)
        if self.padded:
            route = self._padded_route(plan, x_TD.device)
        elif plan.expert_rows is not None:
            route = self._slot_route(plan, plan.expert_rows)
        elif self.dropless_slots:  # one slot per token: an expert receives a token once
            route = self._slot_route(plan, plan.dest_TK.shape[0])
        else:
            route = self._dropless_route(plan)
        out = Transfer(route.recv, route.send, self.group)
        rows = IssueFunction.apply(route.pack(x_ND), out)
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        self.bytes_sent += (sum(route.send) - route.send[self.rank]) * row_bytes
        return Flight(plan, backend, _AllToAllFlight(route, out, rows))

    def finish_dispatch(
        self, flight: Flight, side: Callable[[], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``side()`` (the shared experts) runs while the rows travel; the received rows
        regrouped by local expert, and their offsets."""
        f: _AllToAllFlight = flight.state
        side_out = None
        if side is not None:
            side_out = side()
            self.overlapped += 1
        x_recv = AwaitFunction.apply(f.rows, f.transfer)
        f.route.settle()
        x_RD = x_recv.index_select(0, f.route.index_R)
        offs_L = torch.cumsum(f.route.counts_PL.sum(0), 0).to(torch.int32)
        return x_RD, offs_L, side_out

    def start_combine(self, flight: Flight, y_RD: torch.Tensor) -> None:
        f: _AllToAllFlight = flight.state
        f.transfer = Transfer(f.route.send, f.route.recv, self.group)
        f.rows = IssueFunction.apply(f.route.unregroup(y_RD), f.transfer)
        row_bytes = y_RD.shape[1] * y_RD.element_size()
        self.bytes_sent += (sum(f.route.recv) - f.route.recv[self.rank]) * row_bytes

    def finish_combine(self, flight: Flight, weights_TK: torch.Tensor) -> torch.Tensor:
        f: _AllToAllFlight = flight.state
        y_back = f.route.unpack(AwaitFunction.apply(f.rows, f.transfer))
        return unpermute(y_back, flight.plan.dest_TK, weights_TK, backend=flight.backend)

    def _padded_route(self, plan: DispatchPlan, device: torch.device) -> _Route:
        """``moe.pad_to_capacity``: every expert's segment is its capacity in every group,
        padding included; static splits, no count exchange."""
        P, L = self.ep, self.local_experts
        rows = plan.num_rows // self.num_experts
        counts_PL = torch.full((P, L), rows, dtype=torch.int64, device=device)
        split = [L * rows] * P
        return _Route(split, split, counts_PL, regroup_index(counts_PL, P * L * rows),
                      plan.num_rows, plan.num_rows)  # fmt: skip

    def _dropless_route(self, plan: DispatchPlan) -> _Route:
        """Dropless: the kept rows exactly. The split sizes depend on the routing, so the
        host reads them: one synchronisation per layer (``docs/expert_parallel.md``)."""
        P, L = self.ep, self.local_experts
        send_PL = _kept_per_expert(plan).view(P, L)
        counts_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(counts_PL, send_PL, group=self.group)  # [p, l]: p -> my l
        send, recv = torch.stack([send_PL.sum(1), counts_PL.sum(1)]).tolist()
        index_R = regroup_index(counts_PL, sum(recv))
        return _Route(send, recv, counts_PL, index_R, sum(send), plan.num_rows)

    def _slot_route(self, plan: DispatchPlan, C: int) -> _Route:
        """Each expert's segment travels padded to ``C`` slots, the most rows it can hold
        (a capacity factor: ``DispatchPlan.expert_rows``; dropless with ``dropless_slots``:
        one per token), so the split sizes are static and the host reads nothing. The
        counts travel beside the rows (a device all-to-all); the receiver moves the kept
        rows to the front, expert-contiguous in the order the dropless route gives, and the
        padding rows behind the last offset, where the grouped GEMM computes nothing. The
        price: C rows per expert on the wire and in the receive buffer, as
        ``pad_to_capacity`` spends them, whatever was kept."""
        P, L = self.ep, self.local_experts
        offs_E, kept_E = plan.offs_E.long(), _kept_per_expert(plan)
        # The counts travel beside the rows: awaited when the rows are (``settle``).
        counts_PL = torch.empty_like(kept_E.view(P, L))
        counts = Transfer([L] * P, [L] * P, self.group)
        counts.issue(counts_PL.view(-1), kept_E, counts.out_splits, counts.in_splits)
        slot_C = torch.arange(C, device=offs_E.device)
        # Sender: row i of expert e's segment goes to slot e * C + i.
        send_kept = (slot_C < kept_E[:, None]).reshape(-1)
        send_src = ((offs_E - kept_E)[:, None] + slot_C).reshape(-1).clamp(max=plan.num_rows - 1)
        split = [L * C] * P
        return _SlotRoute(split, split, counts_PL, torch.empty(0, dtype=torch.long),
                          L * C * P, plan.num_rows, send_src, send_kept, offs_E, kept_E, C,
                          counts)  # fmt: skip

# ----------------------------------------------------------------------------- all-gather


@dataclass
class _GatherFlight:
    """An all-gather dispatch between its phases: where each gathered assignment's row lies
    in this rank's buffer, the rows (gathered, then the experts' outputs) and the offsets."""

    local_dest: torch.Tensor
    rows: torch.Tensor
    offs_L: torch.Tensor


class AllGatherDispatcher(_CommCounter, Phases):
    """Every rank sees every token of its EP group and runs its own experts on them.

    The gathered plans are re-based onto a local buffer ordered (local expert, source rank);
    its size is a static upper bound (rows past the last offset compute zeros), so there is
    no host synchronisation at all. All ranks must hold the same number of tokens.
    """

    def __init__(self, group, num_experts: int, padded: bool = False):
        super().__init__()
        self.group = group
        self.padded = padded
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep

    def start_dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str) -> Flight:
        """Gathers synchronously: the rows are there when it returns."""
        P, L, E = self.ep, self.local_experts, self.num_experts
        T, K = plan.dest_TK.shape
        lo = self.rank * L
        x_all = AllGatherFunction.apply(x_TD, self.group)  # (P*T, D)
        dest_PA = _all_gather_nograd(plan.dest_TK.reshape(1, -1), self.group)  # (P, T*K)
        offs_PE = _all_gather_nograd(plan.offs_E.long().view(1, E), self.group)  # (P, E)
        counts_PE = torch.diff(offs_PE, dim=1, prepend=offs_PE.new_zeros(P, 1))
        counts_PL = counts_PE[:, lo : lo + L]
        # Expert of each gathered assignment: its row lies in [offs[e-1], offs[e]).
        e_PA = torch.searchsorted(offs_PE, dest_PA, right=True)
        local_PA = e_PA - lo
        mine_PA = (dest_PA >= 0) & (local_PA >= 0) & (local_PA < L)
        l_PA = local_PA.clamp(0, L - 1)
        row_in_expert_PA = dest_PA - (offs_PE - counts_PE).gather(1, e_PA.clamp(max=E - 1))
        base_LP = _exclusive_cumsum(counts_PL.t().reshape(-1)).view(L, P)
        p_PA = torch.arange(P, device=x_TD.device)[:, None].expand_as(dest_PA)
        local_dest = torch.where(mine_PA, base_LP[l_PA, p_PA] + row_in_expert_PA, -1)
        local_dest = local_dest.view(P * T, K)
        rows = L * (plan.num_rows // E) if self.padded else T * min(K, L)
        x_RD = permute(x_all, local_dest, P * rows, backend=backend)
        offs_L = torch.cumsum(counts_PL.sum(0), 0).to(torch.int32)
        self.bytes_sent += (P - 1) * T * x_TD.shape[1] * x_TD.element_size()
        return Flight(plan, backend, _GatherFlight(local_dest, x_RD, offs_L))

    def finish_dispatch(
        self, flight: Flight, side: Callable[[], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        f: _GatherFlight = flight.state
        return f.rows, f.offs_L, side() if side is not None else None

    def start_combine(self, flight: Flight, y_RD: torch.Tensor) -> None:
        flight.state.rows = y_RD  # combined when the weights come (finish_combine)

    def finish_combine(self, flight: Flight, weights_TK: torch.Tensor) -> torch.Tensor:
        local_dest, y_RD = flight.state.local_dest, flight.state.rows
        weights_all = AllGatherFunction.apply(weights_TK, self.group)
        partial = unpermute(y_RD, local_dest, weights_all, backend=flight.backend)  # (P*T, D)
        out = ReduceScatterFunction.apply(partial, self.group)
        self.bytes_sent += (self.ep - 1) * out.shape[0] * out.shape[1] * out.element_size()
        return out
