"""Capacity, dropping and token permutation: where each (token, choice) goes.

The dispatch plan maps every routed assignment (token t, choice k) to a row of an
expert-contiguous buffer, or to -1 when capacity drops it. Capacity is applied per expert
within each *token group* (``moe.token_group_seqs`` sequences, or the whole micro-batch),
so a reference run that forms the same groups drops exactly the same assignments.

The dispatcher is the seam where expert parallelism plugs in: ``LocalDispatcher`` moves
rows within one process; an all-to-all dispatcher exposes the same phases.

Shape legend: T tokens, K top-k, E experts, G token groups, N buffer rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetrain.kernels import permute, unpermute
from moetrain.kernels.common import bin_counts, sorted_bin_ends


@dataclass
class DispatchPlan:
    dest_TK: torch.Tensor
    """int64 row of each assignment in the expert-contiguous buffer; -1 = dropped."""
    offs_E: torch.Tensor
    """int32 cumulative end row of each expert's segment (the grouped-GEMM offsets)."""
    num_rows: int
    """Rows of the buffer (static: T*K, or E*G*capacity when padded)."""
    tokens_per_expert_E: torch.Tensor
    """int64 assignments each expert was chosen for, before dropping."""
    dropped: torch.Tensor
    """int64 scalar: assignments dropped by capacity."""
    capacity: int | None
    """Per-expert, per-group capacity (None: dropless)."""
    expert_rows: int | None = None
    """The most rows one expert's segment can hold, known without reading the plan: its
    capacity in every token group, and no more than one row a token (None: dropless). Expert
    parallelism sends this many rows per expert, so the split sizes are static."""


def expert_capacity(group_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """ceil(capacity_factor * group_tokens * top_k / num_experts), at least 1.

    Rounded to 9 decimals before the ceiling so that a factor like 1.1, whose binary value is
    a hair above 1.1, does not add a row (1.1 * 50 tokens -> 55, not 56)."""
    return max(1, math.ceil(round(capacity_factor * group_tokens * top_k / num_experts, 9)))


def plan_dispatch(
    ids_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    num_experts: int,
    num_groups: int,
    capacity_factor: float | None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> DispatchPlan:
    """Assign buffer rows expert-major, then group, then priority within (expert, group).

    ``scores_TK`` (the router scores of the chosen experts) orders assignments for the
    "probs" drop policy; "position" keeps the earliest tokens of the group. All on device,
    no host synchronisation: the buffer size is static.
    """
    T, K = ids_TK.shape
    E, G = num_experts, num_groups
    if T % G:
        raise ValueError(f"{T} tokens do not split into {G} token groups")
    device = ids_TK.device
    ids_A = ids_TK.reshape(-1)
    group_A = torch.arange(T, device=device).repeat_interleave(K) // (T // G)

    if capacity_factor is None:
        # Dropless: any order within an expert is fine; a stable sort by expert keeps tokens
        # in position order, which is also what the padded/capacity paths produce. The sorted
        # ids give every count (no bincount: it syncs on CUDA).
        order_A = torch.argsort(ids_A, stable=True)
        dest_A = torch.empty_like(order_A)
        dest_A[order_A] = torch.arange(order_A.numel(), device=device)
        ends_E = sorted_bin_ends(ids_A[order_A], E)
        tokens_per_expert_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
        offs_E = ends_E.to(torch.int32)
        return DispatchPlan(
            dest_A.view(T, K),
            offs_E,
            T * K,
            tokens_per_expert_E,
            torch.zeros((), dtype=torch.int64, device=device),
            None,
        )

    cap = expert_capacity(T // G, K, E, capacity_factor)
    # Priority first, then a stable sort by (expert, group) segment: within each segment the
    # assignments end up in priority order.
    if drop_policy == "probs":
        prio_order = torch.argsort(scores_TK.reshape(-1).detach(), descending=True, stable=True)
    elif drop_policy == "position":
        prio_order = torch.arange(T * K, device=device)
    else:
        raise ValueError(f"moe.drop_policy: expected 'probs' or 'position', got {drop_policy!r}")
    segment_A = ids_A * G + group_A
    order_A = prio_order[torch.argsort(segment_A[prio_order], stable=True)]
    seg_sorted = segment_A[order_A]
    seg_end = sorted_bin_ends(seg_sorted, E * G)
    seg_counts = torch.diff(seg_end, prepend=seg_end.new_zeros(1))
    seg_start = seg_end - seg_counts
    tokens_per_expert_E = seg_counts.view(E, G).sum(1)
    pos_sorted = torch.arange(T * K, device=device) - seg_start[seg_sorted]
    keep_sorted = pos_sorted < cap
    if pad_to_capacity:
        dest_sorted = torch.where(keep_sorted, seg_sorted * cap + pos_sorted, -1)
        offs_E = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (G * cap)
        num_rows = E * G * cap
    else:
        dest_sorted = torch.where(keep_sorted, torch.cumsum(keep_sorted, 0) - 1, -1)
        kept_E = seg_counts.clamp(max=cap).view(E, G).sum(1)
        offs_E = torch.cumsum(kept_E, 0).to(torch.int32)
        num_rows = T * K
    dest_A = torch.empty_like(dest_sorted)
    dest_A[order_A] = dest_sorted
    dropped = (~keep_sorted).sum()
    return DispatchPlan(dest_A.view(T, K), offs_E, num_rows, tokens_per_expert_E, dropped, cap,
                        G * cap if pad_to_capacity else min(G * cap, T))


def plan_dispatch_sharded(
    ids_TK: torch.Tensor,
    ids_all_TK: torch.Tensor,
    scores_all_TK: torch.Tensor | None,
    positions_s: torch.Tensor,
    num_experts: int,
    num_groups: int,
    capacity_factor: float | None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> DispatchPlan:
    """The plan of this process's tokens when it holds only some positions of every sequence
    (context parallelism), keeping exactly the assignments ``plan_dispatch`` keeps for the
    whole sequences.

    ``ids_TK``: this process's tokens (B sequences x s positions, sequence-major);
    ``ids_all_TK`` / ``scores_all_TK``: every token of the same B whole sequences (B x S,
    in position order; scores only needed to drop by score); ``positions_s``: the positions
    this process holds. Capacity is decided over the whole token groups -- the ranking of
    each (expert, group) segment needs every assignment of the group -- and this process
    keeps the rows of its own tokens. Token and drop counts are this process's (summed over
    the processes of a sequence they are the whole batch's)."""
    if capacity_factor is None:  # dropless: nothing is decided across tokens
        return plan_dispatch(ids_TK, torch.zeros_like(ids_TK), num_experts, num_groups, None)
    K = ids_TK.shape[1]
    B = ids_TK.shape[0] // positions_s.numel()
    whole = plan_dispatch(
        ids_all_TK,
        scores_all_TK if scores_all_TK is not None else torch.zeros_like(ids_all_TK),
        num_experts,
        num_groups,
        capacity_factor,
        drop_policy,
    )
    keep_TK = (whole.dest_TK >= 0).view(B, -1, K)[:, positions_s].reshape(-1, K)
    assert whole.capacity is not None
    return plan_kept(ids_TK, keep_TK, num_experts, num_groups, whole.capacity, pad_to_capacity)


def plan_kept(
    ids_TK: torch.Tensor,
    keep_TK: torch.Tensor,
    num_experts: int,
    num_groups: int,
    capacity: int,
    pad_to_capacity: bool = False,
) -> DispatchPlan:
    """A plan that keeps the assignments ``keep_TK`` marks (decided elsewhere, at most
    ``capacity`` per expert and token group): rows expert-major, then group, then position;
    with ``pad_to_capacity`` each (expert, group) segment padded to ``capacity`` rows, as
    ``plan_dispatch`` lays them out."""
    T, K = ids_TK.shape
    E, G = num_experts, num_groups
    if T % G:
        raise ValueError(f"{T} tokens do not split into {G} token groups")
    device = ids_TK.device
    ids_A, keep_A = ids_TK.reshape(-1), keep_TK.reshape(-1)
    group_A = torch.arange(T, device=device).repeat_interleave(K) // (T // G)
    tokens_per_expert_E = bin_counts(ids_A, E)
    # Kept assignments by (expert, group) segment in position order; dropped ones last.
    segment_A = torch.where(keep_A, ids_A * G + group_A, E * G)
    order_A = torch.argsort(segment_A, stable=True)
    seg_sorted = segment_A[order_A]
    kept_sorted = seg_sorted < E * G
    seg_end = sorted_bin_ends(seg_sorted, E * G + 1)
    seg_counts = torch.diff(seg_end, prepend=seg_end.new_zeros(1))
    if pad_to_capacity:
        pos_sorted = torch.arange(T * K, device=device) - (seg_end - seg_counts)[seg_sorted]
        dest_sorted = torch.where(kept_sorted, seg_sorted * capacity + pos_sorted, -1)
        offs_E = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (G * capacity)
        num_rows = E * G * capacity
    else:
        dest_sorted = torch.where(kept_sorted, torch.arange(T * K, device=device), -1)
        offs_E = seg_end[G - 1 : E * G : G].to(torch.int32)  # each expert's last segment
        num_rows = T * K
    dest_A = torch.empty_like(dest_sorted)
    dest_A[order_A] = dest_sorted
    dropped = (~keep_A).sum()
    return DispatchPlan(dest_A.view(T, K), offs_E, num_rows, tokens_per_expert_E, dropped, capacity,
                        G * capacity if pad_to_capacity else min(G * capacity, T))


@dataclass
class Flight:
    """One dispatch of a layer's tokens between its phases: what a dispatcher carries from
    ``start_dispatch`` to ``finish_combine``. Each call has its own, so two token sets may be
    in flight through one dispatcher at once (``parallel.ep_overlap=halves``)."""

    plan: DispatchPlan
    backend: str
    state: Any = None
    """The dispatcher's own (its route, the transfers in flight)."""


class Dispatcher(Protocol):
    """Moves token rows to the experts that process them and back, in four phases that let
    other work run while rows travel:

    ``start_dispatch`` plans and issues the rows (returns a ``Flight``); ``finish_dispatch``
    returns the rows this rank's experts process and their int32 group offsets, running a
    side computation first if given (it overlaps the transfer); ``start_combine`` issues the
    experts' output rows back; ``finish_combine`` returns the weighted sum per token.
    ``dispatch`` / ``combine`` (``Phases``) run them back to back, one flight at a time.
    """

    def start_dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str) -> Flight: ...

    def finish_dispatch(
        self, flight: Flight, side: Callable[[], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def start_combine(self, flight: Flight, y_ND: torch.Tensor) -> None: ...

    def finish_combine(self, flight: Flight, weights_TK: torch.Tensor) -> torch.Tensor: ...

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(
        self, y_ND: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, backend: str
    ) -> torch.Tensor: ...

    bytes_sent: float
    """Token bytes sent to other ranks since the last ``pop_comm_bytes`` (settable: activation
    checkpointing restores it after a recomputed forward)."""

    def pop_comm_bytes(self) -> float:
        """Token bytes sent to other ranks by forward dispatch + combine since the last call."""
        ...


class Phases:
    """``dispatch`` and ``combine`` over a dispatcher's four phases, one flight at a time
    (the flight waits between the two calls)."""

    _flight: Flight | None = None

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._flight = self.start_dispatch(x_TD, plan, backend)  # type: ignore[attr-defined]
        x_ND, offs, _ = self.finish_dispatch(self._flight)  # type: ignore[attr-defined]
        return x_ND, offs

    def combine(
        self, y_ND: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, backend: str
    ) -> torch.Tensor:
        flight, self._flight = self._flight, None
        assert flight is not None and flight.plan is plan, "combine() without its dispatch()"
        self.start_combine(flight, y_ND)  # type: ignore[attr-defined]
        return self.finish_combine(flight, weights_TK)  # type: ignore[attr-defined]


class LocalDispatcher(Phases):
    """All experts live in this process: dispatch is a permutation, combine its inverse."""

    bytes_sent = 0.0  # nothing leaves the process

    def start_dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, backend: str) -> Flight:
        return Flight(plan, backend, permute(x_TD, plan.dest_TK, plan.num_rows, backend=backend))

    def finish_dispatch(
        self, flight: Flight, side: Callable[[], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return flight.state, flight.plan.offs_E, side() if side is not None else None

    def start_combine(self, flight: Flight, y_ND: torch.Tensor) -> None:
        flight.state = y_ND

    def finish_combine(self, flight: Flight, weights_TK: torch.Tensor) -> torch.Tensor:
        return unpermute(flight.state, flight.plan.dest_TK, weights_TK, backend=flight.backend)

    def pop_comm_bytes(self) -> float:
        return 0.0
