"""Expert-parallel dispatchers: the same two methods as ``LocalDispatcher``, across ranks.

Rank r of an expert-parallel (EP) group of size ``ep`` owns experts
``[r * E/ep, (r+1) * E/ep)``. Routing, capacity and the dispatch plan are computed on the
*source* rank from its own tokens (``plan_dispatch`` over all E experts), exactly as a
single process would for the same token group; the dispatchers only move the rows the plan
keeps. That is what lets a single-process run reproduce drops, losses and gradients.

``AllToAllDispatcher``  permute locally (expert-major = grouped by destination rank), one
    small ``all_to_all_single`` of per-(rank, local expert) counts (the only host sync, and
    only when shapes are dynamic), ``all_to_all_single`` of the rows with uneven splits,
    regroup by local expert; ``combine`` reverses each step. With ``moe.pad_to_capacity``
    the splits are static and there is no count exchange at all. ``dispatch_overlapped``
    issues the row all-to-all asynchronously and runs a side computation (the shared
    experts, ``parallel.overlap_shared_experts``) before waiting for it.
``AllGatherDispatcher`` all-gather tokens, combine weights and plans over the EP group;
    every rank runs its local experts on all the group's tokens; a reduce-scatter returns
    each rank's partial sums. More bytes, no count exchange: for small ``ep``.

``ExpertTPDispatcher`` wraps either (or the local dispatcher) when every expert's FFN width
    is split over the tensor-parallel ranks: its tokens and combine weights enter, and the
    combined output leaves, the TP region once per layer.

The process group is handed in by ``moetrain.parallel.expert_parallel.apply_ep``; nothing
here creates one. Every collective is wrapped in a small autograd Function (the list form
of ``all_to_all`` fails on gloo with uneven sizes).

Shape legend: T local tokens, K top-k, D model dim, E experts, El = E / ep local experts,
P = ep ranks, N local buffer rows, R rows this rank's experts process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moetrain.kernels import permute, unpermute
from moetrain.model.dispatch import DispatchPlan

# ----------------------------------------------------------------------------- collectives


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


class AllToAllFunction(torch.autograd.Function):
    """``all_to_all_single`` with explicit uneven splits; backward is the same call with the
    splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


class AllToAllStartFunction(torch.autograd.Function):
    """The forward all-to-all issued asynchronously: returns the receive buffer at once and
    appends the work handle to ``works``; ``WaitFunction`` completes it. Backward is the
    synchronous call with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, works):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        works.append(
            dist.all_to_all_single(
                out,
                x.contiguous(),
                output_split_sizes=out_splits,
                input_split_sizes=in_splits,
                group=group,
                async_op=True,
            )
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None, None


class WaitFunction(torch.autograd.Function):
    """Identity on a buffer an asynchronous collective fills: waits for it first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, works: list) -> torch.Tensor:  # type: ignore[override]
        works.pop().wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
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


class ExpertTPDispatcher:
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

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.dispatch(CopyToTPFunction.apply(x_TD, self.group), plan, backend)

    def dispatch_overlapped(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str, side: Callable[[], torch.Tensor]
    ):
        return self.inner.dispatch_overlapped(
            CopyToTPFunction.apply(x_TD, self.group), plan, backend, side
        )

    @property
    def overlapped(self) -> int:
        return getattr(self.inner, "overlapped", 0)

    def combine(
        self, y_ND: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, backend: str
    ) -> torch.Tensor:
        weights_TK = CopyToTPFunction.apply(weights_TK, self.group)
        y_TD = self.inner.combine(y_ND, plan, weights_TK, backend)
        return ReduceFromTPFunction.apply(y_TD, self.group)

    @property
    def bytes_sent(self) -> float:
        return self.inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: float) -> None:
        self.inner.bytes_sent = value

    def pop_comm_bytes(self) -> float:
        return self.inner.pop_comm_bytes()


# ----------------------------------------------------------------------------- all-to-all


class AllToAllDispatcher(_CommCounter):
    """Tokens travel to the rank owning their expert and back with ``all_to_all_single``."""

    def __init__(self, group, num_experts: int, padded: bool = False):
        """``padded``: the layer plans with ``moe.pad_to_capacity`` (static split sizes)."""
        super().__init__()
        self.padded = padded
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        self._ctx: tuple | None = None
        self.overlapped = 0
        """Dispatches that ran a side computation while the rows travelled."""

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x_RD, offs_L, _ = self._dispatch(x_TD, plan, backend, None)
        return x_RD, offs_L

    def dispatch_overlapped(
        self,
        x_TD: torch.Tensor,
        plan: DispatchPlan,
        backend: str,
        side: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dispatch``, with ``side()`` (the shared experts) computed while the row
        all-to-all is in flight; returns its result third. The same numbers as calling
        ``side()`` before or after."""
        self.overlapped += 1
        x_RD, offs_L, out = self._dispatch(x_TD, plan, backend, side)
        assert out is not None
        return x_RD, offs_L, out

    def _dispatch(
        self,
        x_TD: torch.Tensor,
        plan: DispatchPlan,
        backend: str,
        side: Callable[[], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        P, L = self.ep, self.local_experts
        x_ND = permute(x_TD, plan.dest_TK, plan.num_rows, backend=backend)
        if self.padded:
            # Padded: every expert has exactly num_rows / E rows. Static splits, no exchange.
            rows = plan.num_rows // self.num_experts
            counts_PL = torch.full((P, L), rows, dtype=torch.int64, device=x_TD.device)
            send = recv = [L * rows] * P
        else:
            kept_E = torch.diff(plan.offs_E.long(), prepend=plan.offs_E.new_zeros(1).long())
            send_PL = kept_E.view(P, L)
            counts_PL = torch.empty_like(send_PL)
            dist.all_to_all_single(counts_PL, send_PL, group=self.group)  # [p, l]: p -> my l
            # The one host synchronisation of dropless / capacity dispatch: the split sizes.
            both = torch.stack([send_PL.sum(1), counts_PL.sum(1)]).tolist()
            send, recv = both
        n_kept = sum(send)
        total = sum(recv)
        side_out = None
        if side is None:
            x_recv = AllToAllFunction.apply(x_ND[:n_kept], recv, send, self.group)
        else:
            works: list = []
            x_recv = AllToAllStartFunction.apply(x_ND[:n_kept], recv, send, self.group, works)
            side_out = side()  # while the rows travel
            x_recv = WaitFunction.apply(x_recv, works)
        index_R = regroup_index(counts_PL, total)
        x_RD = x_recv.index_select(0, index_R)
        offs_L = torch.cumsum(counts_PL.sum(0), 0).to(torch.int32)
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        self.bytes_sent += (n_kept - send[self.rank]) * row_bytes
        self._ctx = (send, recv, index_R, plan.num_rows, n_kept, row_bytes)
        return x_RD, offs_L, side_out

    def combine(
        self, y_RD: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, backend: str
    ) -> torch.Tensor:
        assert self._ctx is not None, "combine() without a matching dispatch()"
        send, recv, index_R, num_rows, n_kept, row_bytes = self._ctx
        self._ctx = None
        y_recv = y_RD.index_select(0, _inverse(index_R))
        y_kept = AllToAllFunction.apply(y_recv, send, recv, self.group)
        self.bytes_sent += (sum(recv) - recv[self.rank]) * y_RD.shape[1] * y_RD.element_size()
        y_ND = torch.nn.functional.pad(y_kept, (0, 0, 0, num_rows - n_kept))
        return unpermute(y_ND, plan.dest_TK, weights_TK, backend=backend)


# ----------------------------------------------------------------------------- all-gather


class AllGatherDispatcher(_CommCounter):
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
        self._ctx: torch.Tensor | None = None

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        self._ctx = local_dest
        return x_RD, offs_L

    def combine(
        self, y_RD: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, backend: str
    ) -> torch.Tensor:
        assert self._ctx is not None, "combine() without a matching dispatch()"
        local_dest, self._ctx = self._ctx, None
        weights_all = AllGatherFunction.apply(weights_TK, self.group)
        partial = unpermute(y_RD, local_dest, weights_all, backend=backend)  # (P*T, D)
        out = ReduceScatterFunction.apply(partial, self.group)
        self.bytes_sent += (self.ep - 1) * out.shape[0] * out.shape[1] * out.element_size()
        return out
