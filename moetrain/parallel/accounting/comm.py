"""Bytes sent, measured: a ``TorchDispatchMode`` sees every collective this rank issues, by
``torch.distributed`` (``c10d`` ops: DDP-style buckets, ZeRO-1, FSDP2, pipelining's p2p,
expert parallelism's and Muon's ``all_to_all_single``) and by DTensor (``_c10d_functional``
ops: TP/SP), and charges it with the standard ring volumes:

    all-reduce 2 (n-1)/n S     all-gather, reduce-scatter (n-1)/n S_full     send S
    all-to-all (n-1)/n S_in (S_in: what the rank hands it, its own share included)

with S the tensor's bytes and n the group size (the analytic volumes beside them:
``analytic.analytic_sent``).
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_c10d = torch.ops.c10d
_fc = torch.ops._c10d_functional


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: Any) -> int:
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group).size()
    return group.size()


def _group_key(group: Any) -> str:
    if isinstance(group, str):
        return group
    try:
        return group.group_name
    except Exception:  # noqa: BLE001 - a ScriptObject without the attribute
        return str(id(group))


@dataclass
class Collective:
    kind: str
    group: str
    group_size: int
    payload: int
    """S: all-reduce/send: the tensor's bytes; all-gather/reduce-scatter: the full tensor's."""

    @property
    def sent(self) -> float:
        n = self.group_size
        if self.kind == "all_reduce":
            return 2 * (n - 1) / n * self.payload
        if self.kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            return (n - 1) / n * self.payload
        if self.kind == "send":
            return float(self.payload)
        return 0.0


def _classify(func: Any, args: tuple, kwargs: dict) -> list[Collective]:
    """The collectives one op issues (empty for any other op)."""
    p = func._overloadpacket
    out: list[Collective] = []

    def add(kind: str, group: Any, payload: int) -> None:
        out.append(Collective(kind, _group_key(group), _group_size(group), payload))

    if p is _c10d.allreduce_:
        for t in args[0]:
            add("all_reduce", args[1], _nbytes(t))
    elif p is _c10d._allgather_base_:
        add("all_gather", args[2], _nbytes(args[0]))
    elif p is _c10d.allgather_:
        for outs in args[0]:
            add("all_gather", args[2], sum(_nbytes(t) for t in outs))
    elif p is _c10d.allgather_into_tensor_coalesced_:
        for t in args[0]:
            add("all_gather", args[2], _nbytes(t))
    elif p is _c10d._reduce_scatter_base_:
        add("reduce_scatter", args[2], _nbytes(args[1]))
    elif p is _c10d.reduce_scatter_:
        for ins in args[1]:
            add("reduce_scatter", args[2], sum(_nbytes(t) for t in ins))
    elif p is _c10d.reduce_scatter_tensor_coalesced_:
        for t in args[1]:
            add("reduce_scatter", args[2], _nbytes(t))
    elif p is _c10d.broadcast_:
        for t in args[0]:
            add("broadcast", args[1], _nbytes(t))
    elif p is _c10d.alltoall_base_:
        add("all_to_all", args[2], _nbytes(args[1]))
    elif p is _c10d.send:
        for t in args[0]:
            add("send", args[1], _nbytes(t))
    elif p is _fc.all_reduce:
        add("all_reduce", args[2], _nbytes(args[0]))
    elif p is _fc.all_reduce_coalesced:
        for t in args[0]:
            add("all_reduce", args[2], _nbytes(t))
    elif p is _fc.all_gather_into_tensor:
        add("all_gather", args[2], _nbytes(args[0]) * args[1])
    elif p is _fc.all_gather_into_tensor_coalesced:
        for t in args[0]:
            add("all_gather", args[2], _nbytes(t) * args[1])
    elif p is _fc.reduce_scatter_tensor:
        add("reduce_scatter", args[3], _nbytes(args[0]))
    elif p is _fc.reduce_scatter_tensor_coalesced:
        for t in args[0]:
            add("reduce_scatter", args[3], _nbytes(t))
    elif p is _fc.all_to_all_single:
        add("all_to_all", args[3], _nbytes(args[0]))
    elif p is _fc.broadcast:
        add("broadcast", args[2], _nbytes(args[0]))
    return out


# torch.distributed's Python API, as FSDP2, pipelining and this package call it: these calls
# do not pass through a TorchDispatchMode, so they are wrapped while counting. Names differ
# across torch versions (all_gather_single / all_gather_into_tensor...): each one present is
# wrapped; nested calls (a deprecated name forwarding to its successor) count once. One
# wrapper object serves both torch.distributed and distributed_c10d, since P2POp checks the
# identity of isend.
_PY_COLLECTIVES: dict[str, tuple[str, Callable[..., tuple[torch.Tensor, Any]]]] = {
    "all_reduce": (
        "all_reduce",
        lambda t, *a, group=None, **k: (
            t,
            group if group is not None else (a[1] if len(a) > 1 else None),
        ),
    ),
    "all_gather_into_tensor": ("all_gather", lambda out, inp, group=None, **k: (out, group)),
    "all_gather_single": ("all_gather", lambda out, inp, group=None, **k: (out, group)),
    "reduce_scatter_tensor": (
        "reduce_scatter",
        lambda out, inp, *a, group=None, **k: (
            inp,
            group if group is not None else (a[1] if len(a) > 1 else None),
        ),
    ),
    "reduce_scatter_single": (
        "reduce_scatter",
        lambda output, input, *a, group=None, **k: (
            input,
            group if group is not None else (a[1] if len(a) > 1 else None),
        ),
    ),
    "broadcast": (
        "broadcast",
        lambda t, *a, group=None, **k: (
            t,
            group if group is not None else (a[1] if len(a) > 1 else None),
        ),
    ),
    "all_to_all_single": (
        "all_to_all",
        lambda out, inp, *a, group=None, **k: (
            inp,
            group if group is not None else (a[2] if len(a) > 2 else None),
        ),
    ),
    "send": ("send", lambda t, *a, group=None, **k: (t, group)),
    "isend": ("send", lambda t, *a, group=None, **k: (t, group)),
}


def _py_group(group: Any) -> tuple[str, int]:
    if group is None:
        return "default", dist.get_world_size()
    return group.group_name, dist.get_world_size(group)


class CommCounter(TorchDispatchMode):
    """Records every collective this rank issues while active (``with CommCounter() as c``):
    DTensor's functional collectives through the dispatch mode, ``torch.distributed`` calls
    through wrappers installed for the duration."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []
        self._depth = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        try:
            if func.namespace == "_c10d_functional":
                self.records.extend(_classify(func, args, kwargs))
        except Exception:  # noqa: BLE001 - accounting must never break training
            pass
        return func(*args, **kwargs)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, extract = _PY_COLLECTIVES[name]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                try:
                    tensor, group = extract(*args, **kwargs)
                    gname, size = _py_group(group)
                    self.records.append(Collective(kind, gname, size, _nbytes(tensor)))
                except Exception:  # noqa: BLE001
                    pass
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapper

    def _count_batch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
            for op in p2p_op_list:
                if getattr(op.op, "__name__", "") == "isend":
                    gname, size = _py_group(op.group)
                    self.records.append(Collective("send", gname, size, _nbytes(op.tensor)))
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                return fn(p2p_op_list)
            finally:
                self._depth.n -= 1

        return batch_isend_irecv

    def __enter__(self) -> CommCounter:
        import torch.distributed.distributed_c10d as c10d

        for name in [*_PY_COLLECTIVES, "batch_isend_irecv"]:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapper = self._count_batch(fn) if name == "batch_isend_irecv" else self._wrap(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, wrapper)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
        return super().__exit__(*exc)

    def sent_by_kind(self, groups: set[str] | None = None) -> dict[str, float]:
        """Bytes this rank sent, per collective kind (optionally only on ``groups``)."""
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            if groups is None or r.group in groups:
                out[r.kind] += r.sent
        return dict(out)
