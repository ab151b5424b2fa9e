"""Memory and communication accounting, measured on the real thing and set beside the
analytic figures (derived in ``docs/parallel.md``; measured ratios in ``docs/accounting.md``).

Model-state bytes: parameters, gradients and optimizer states actually allocated on this
rank (DTensor local shards, FSDP's gathered buffers, distinct storages counted once), sampled
after forward, after backward and after the optimizer step; the peak is compared with the
ZeRO formula. With fp32 training a parameter costs 4 (weights, their own master copy) + 4
(gradient) + 8 (Adam m, v) = 16 bytes, the same 16 as mixed precision's 2 + 2 + 12, split
replicated/sharded the same way:

    zero 0: 16      zero 1: 8 + 8/N      zero 2: 4 + 12/N      zero 3: 16/N

(mixed precision: 16, 4 + 12/N, 2 + 14/N, 16/N), N = dp_shard, per parameter this rank holds
before data-parallel sharding (its tensor-parallel shard and pipeline stage). The optimizer's
8 bytes are read from its real state's dtypes (``optimizer_state_bytes_per_param``): bf16
moments (``optim.moments_dtype``) make them 4, and DDP's 16 bytes 12.

Bytes sent: a ``TorchDispatchMode`` sees every collective issued, by ``torch.distributed``
(``c10d`` ops: DDP-style buckets, ZeRO-1, FSDP2, pipelining's p2p) and by DTensor
(``_c10d_functional`` ops: TP/SP), and charges this rank with the standard ring volumes:

    all-reduce 2 (n-1)/n S     all-gather, reduce-scatter (n-1)/n S_full     send S

with S the tensor's bytes and n the group size.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
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


# ----------------------------------------------------------------------------- memory


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class MemorySample:
    params: int = 0
    grads: int = 0
    optim: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


def model_state_bytes(parts: list[torch.nn.Module], optimizers: list[Any]) -> MemorySample:
    """Bytes of the distinct storages behind parameters, gradients and optimizer states."""
    seen: set[tuple[int, int]] = set()
    sample = MemorySample()

    def count(t: torch.Tensor | None, field_name: str) -> None:
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return
        key = _storage_key(t)
        if key in seen:
            return
        seen.add(key)
        setattr(sample, field_name, getattr(sample, field_name) + key[1])

    masters = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    for part in parts:
        for p in part.parameters():
            count(p, "params")
    for p in masters:
        count(p, "params")
    for part in parts:
        for p in part.parameters():
            count(p.grad, "grads")
    for p in masters:
        count(p.grad, "grads")
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    count(v, "optim")
    return sample


def optimizer_state_bytes_per_param(optimizers: list[Any], muon: bool | None = None) -> float:
    """Bytes of optimizer state per parameter element, read from the optimizers' real state:
    the state tensors of each parameter shaped like it (AdamW's two moments, Muon's one
    momentum buffer; step counts are scalars), in their own dtypes -- 8 for fp32 moments,
    4 for bf16 ones, 4 and 2 for Muon's matrices. Before the first step, when no state
    exists yet, from the dtype the optimizer declares for its moments (``moments_dtype``;
    None: each parameter's own) and the tensors its group keeps (Muon's group, flagged
    ``muon``: one). ``muon``: only Muon's matrices (True) or only the rest (False)."""
    state_bytes = elements = 0
    for opt in optimizers:
        declared = getattr(opt, "moments_dtype", None)
        for group in opt.param_groups:
            if muon is not None and bool(group.get("muon")) != muon:
                continue
            slots = 1 if group.get("muon") else 2
            for p in group["params"]:
                n = _local(p).numel()
                if n == 0:
                    continue
                elements += n
                tensors = [
                    _local(v) for v in opt.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                ]  # fmt: skip
                if tensors:
                    state_bytes += sum(t.numel() * t.element_size() for t in tensors)
                else:
                    itemsize = (declared or p.dtype).itemsize
                    state_bytes += slots * n * itemsize
    return state_bytes / elements if elements else 0.0


def zero_bytes_per_param(
    zero_stage: int, n: int, mixed_precision: bool = False, optim_bytes: float = 8.0
) -> float:
    """Model-state bytes per parameter of the ZeRO formula (docs/parallel.md), N = shard
    degree, ``optim_bytes`` of optimizer state per parameter (Adam's fp32 moments: 8; bf16:
    4; ``optimizer_state_bytes_per_param`` reads it from the real state). fp32 training:
    weights 4 + gradients 4 + O; mixed precision: bf16 weights 2 + gradients 2 + fp32 master
    weights 4 + O (the ZeRO paper's 2 + 2 + 12 at O = 8)."""
    o = optim_bytes
    if mixed_precision:
        return {0: 8 + o, 1: 4 + (4 + o) / n, 2: 2 + (6 + o) / n, 3: (8 + o) / n}[zero_stage]
    return {0: 8 + o, 1: 8 + o / n, 2: 4 + (4 + o) / n, 3: (8 + o) / n}[zero_stage]


# ----------------------------------------------------------------------------- activations


class SavedActivations:
    """Bytes of the tensors autograd keeps for backward (the activations), live at once,
    while active (``with SavedActivations(parts) as a``): a tensor counts from when a
    forward saves it until the backward that used it frees it; ``peak`` is the most held at
    any moment. Storages are counted once however many saved tensors view them; parameters
    (and FSDP's gathered copies of them, which are model state) are left out. Activation
    checkpointing's own hooks take precedence inside checkpointed regions, so what they keep
    (block inputs) is what is counted there."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.params = {_storage_key(_local(p)) for part in parts for p in part.parameters()}
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        # A parameter, or a view of one (a linear layer saves its weight transposed): FSDP's
        # gathered parameters are parameters too, at storages this count has not seen.
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        if t.device.type == "meta":
            return t
        try:
            key = _storage_key(_local(t))  # a DTensor's own shard
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return t
        if key in self.params:
            return t
        if key not in self._refs:
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, key, self)

    def _release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= key[1]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    """A saved tensor and its place in ``SavedActivations``' count (released on collection,
    when autograd frees the graph node holding it)."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], owner: SavedActivations):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner._release(self.key)


def full_sequence_kv_bytes(
    model_cfg: Any,
    dims: Any,
    micro_batch_size: int,
    seq_len: int,
    n_attention: int,
    checkpointing: str = "none",
    bytes_per_elem: int = 4,
) -> int:
    """Bytes of the keys and values of whole sequences that the attention of ``n_attention``
    layers keeps for backward on one rank (per micro-batch in flight): what context
    parallelism does not divide by cp (each rank attends its queries over the whole
    sequence's K and V, kept at full length with every query head's copy, as SDPA sees
    them), plus its (s x S) boolean causal mask. 0 when activation checkpointing recomputes
    the attention (``checkpointing`` selective or full): only its input is kept."""
    if checkpointing != "none":
        return 0
    h_local = model_cfg.n_heads // dims.tp
    if model_cfg.attention == "mla":
        dk = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim
        dv = model_cfg.v_head_dim
    else:
        dk = dv = model_cfg.attn_head_dim
    kv = micro_batch_size * seq_len * h_local * (dk + dv) * bytes_per_elem
    mask = (seq_len // dims.cp) * seq_len if dims.cp > 1 else 0
    return n_attention * (kv + mask)


def analytic_cp_activations(
    one_rank_cp1: float, kv_bytes_cp1: float, cp: int, kv_bytes_cp: float
) -> float:
    """Activation bytes per rank under context parallelism: everything but the whole
    sequence's keys and values scales with the tokens a rank holds (1/cp of every
    sequence), those stay whole: (A_1 - KV_1)/cp + KV_cp, with A_1 measured at cp = 1 on the
    same micro-batch and KV from ``full_sequence_kv_bytes``."""
    return (one_rank_cp1 - kv_bytes_cp1) / cp + kv_bytes_cp


# ----------------------------------------------------------------------------- one step


@dataclass
class StepReport:
    """What one measured training step allocated and sent on this rank."""

    rank: int
    params_per_rank: int
    """Parameters this rank holds before data-parallel sharding (its TP shard, its stages)."""
    memory: dict[str, MemorySample] = field(default_factory=dict)
    activations: int = 0
    """Peak bytes of the tensors saved for backward during the step (``SavedActivations``)."""
    result: Any = None
    """The trainer's StepResult of the measured step."""
    sent: dict[str, float] = field(default_factory=dict)
    sent_by_group: dict[str, dict[str, float]] = field(default_factory=dict)
    expert_flops: float = 0.0
    """Forward FLOPs of this rank's routed experts in the step, counted from the rows they
    received and the weight slices they hold (2 x rows x D x F per projection, 3 of them;
    recomputation under activation checkpointing counts again)."""

    @property
    def peak(self) -> MemorySample:
        return max(self.memory.values(), key=lambda s: s.total)

    def as_scalars(self) -> dict[str, float]:
        out = {f"comm/bytes_sent/{k}": v for k, v in self.sent.items()}
        peak = self.peak
        out.update(
            {
                "memory/model_state_bytes": float(peak.total),
                "memory/param_bytes": float(peak.params),
                "memory/grad_bytes": float(peak.grads),
                "memory/optim_bytes": float(peak.optim),
                "memory/activation_bytes": float(self.activations),
            }
        )
        return out


def params_before_dp(parts: list[torch.nn.Module]) -> int:
    """Elements of this rank's parameters counted before data-parallel sharding."""
    total = 0
    for part in parts:
        for p in part.parameters():
            if not hasattr(p, "device_mesh"):
                total += p.numel()
                continue
            names = p.device_mesh.mesh_dim_names or ()
            denom = 1
            for name, placement, size in zip(names, p.placements, p.device_mesh.shape, strict=True):
                if name == "tp" and not placement.is_replicate():
                    denom *= size
            total += p.numel() // denom
    return total


def measure_step(trainer: Any) -> StepReport:
    """Run one training step of ``trainer`` under a ``CommCounter`` with memory probes after
    forward, backward and the optimizer step. Call it after a first step (Adam states exist)."""
    engine = trainer.engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    report = StepReport(rank, engine.params_at_rest)

    def probe(phase: str) -> None:
        report.memory[phase] = model_state_bytes(engine.parts, engine.optimizers)

    def count_expert_flops(module: Any, args: tuple, out: torch.Tensor) -> None:
        x_ND, offs_E = args[0], args[1]
        rows = int(offs_E[-1]) if offs_E.numel() else 0
        w1 = module.w1.to_local() if hasattr(module.w1, "to_local") else module.w1
        report.expert_flops += 3 * 2 * rows * x_ND.shape[1] * w1.shape[2]

    from moetrain.model.experts import GroupedExperts

    hooks = [
        m.register_forward_hook(count_expert_flops)
        for part in engine.parts
        for m in part.modules()
        if isinstance(m, GroupedExperts)
    ]
    engine.probe = probe
    try:
        with CommCounter() as counter, SavedActivations(engine.parts) as saved:
            report.result = trainer.train_step()
    finally:
        engine.probe = None
        for h in hooks:
            h.remove()
    report.activations = saved.peak
    report.sent = counter.sent_by_kind()
    by_group: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in counter.records:
        by_group[r.group][r.kind] += r.sent
    report.sent_by_group = {g: dict(v) for g, v in by_group.items()}
    return report


# ----------------------------------------------------------------------------- analytic


def analytic_sent(
    cfg: Any,
    dims: Any,
    params_per_rank: int,
    n_stage_layers: dict[str, int],
    bytes_per_elem: int = 4,
) -> dict[str, float]:
    """Analytic bytes one rank sends in one step, by axis (docs/parallel.md), for one micro-batch
    per data-parallel rank where FSDP is used (FSDP gathers and reduces per micro-batch).

    dp:  zero 0 all-reduce 2 Psi (d-1)/d; zero 1 and 2: reduce-scatter + all-gather
         2 Psi (n-1)/n; zero 3: 3 Psi (n-1)/n (+ the hybrid all-reduce of the 1/n shard).
    tp:  per micro-batch (b s h (t-1)/t) x (8 per dense layer, 6 per MoE layer with SP / 4
         without, + 2 each for the vocabulary-parallel embedding and output; with expert TP
         each MoE layer adds 4 + 2 K / h for its routed experts and 4 for shared experts).
    pp:  b s h (/t with SP) per micro-batch and stage boundary between ranks, forward and
         backward (summed over the pp ranks: 2 m (stages - 1) b s h; 2 m (stages - 2) b s h
         for the V placement, whose turn at the last rank stays on the rank).
    cp:  per micro-batch and attention layer the whole sequence's K and V, (cp-1)/cp of them
         all-gathered forward and reduce-scattered backward, plus the routing decisions of
         every MoE layer (``context_parallel.analytic_cp_bytes``). With cp, s above is the
         seq_len / cp positions a rank holds, and dp reduces over dp x cp ranks.
    """
    psi = params_per_rank * bytes_per_elem
    # Gradients are averaged over dp x cp; ZeRO shards over dp_shard x cp.
    n, r, d = dims.dp_shard * dims.cp, dims.dp_replicate, dims.dp * dims.cp
    zero = cfg.parallel.zero_stage if d > 1 else 0
    out: dict[str, float] = {}
    if d > 1:
        if zero == 0:
            out["dp"] = 2 * psi * (d - 1) / d
        else:
            out["dp"] = (3 if zero == 3 else 2) * psi * (n - 1) / n
            out["dp"] += 2 * (psi / n) * (r - 1) / r
    m = dims.microbatches(cfg)
    # A cp rank holds seq_len / cp positions of every sequence: tp and pp move 1/cp of it.
    b, s, h, t = dims.micro_batch_size(cfg), cfg.data.seq_len // dims.cp, cfg.model.dim, dims.tp
    bsh = b * s * h * bytes_per_elem
    if t > 1:
        moe_factor = 6 if cfg.parallel.sequence_parallel else 4
        if cfg.parallel.expert_tp and cfg.moe.num_experts:
            # Expert TP (ExpertTPDispatcher): the combined output all-reduced in forward, the
            # input's and the combine weights' (T x K) gradients in backward; the shared
            # experts column/row-wise: their output in forward, their input gradient back.
            moe_factor += 4 + 2 * cfg.moe.top_k / cfg.model.dim
            if cfg.moe.num_shared_experts:
                moe_factor += 4
        per_mb = (
            8 * n_stage_layers.get("dense", 0)
            + moe_factor * n_stage_layers.get("moe", 0)
            + 2 * n_stage_layers.get("boundary", 0)
        )
        out["tp"] = m * per_mb * bsh * (t - 1) / t
    if dims.pp > 1:
        act = bsh / (t if cfg.parallel.sequence_parallel else 1)
        # The V placement (zbv, dualpipev) holds stages pp - 1 and pp on one rank: that
        # boundary is crossed without a send.
        local = 1 if cfg.parallel.pp_schedule in ("zbv", "dualpipev") else 0
        out["pp_all_ranks"] = 2 * m * (dims.num_stages - 1 - local) * act
    if dims.cp > 1:
        from moetrain.parallel.context_parallel import analytic_cp_bytes

        mc, moe = cfg.model, cfg.moe
        if mc.attention == "mla":
            kv = (mc.qk_nope_head_dim + mc.qk_rope_head_dim + mc.v_head_dim) * mc.n_heads
        else:
            kv = 2 * mc.attn_head_dim * mc.kv_heads
        scores = moe.capacity_factor is not None and moe.drop_policy == "probs"
        ac = cfg.parallel.activation_checkpointing
        n_attn = n_stage_layers.get("dense", 0) + n_stage_layers.get("moe", 0)
        n_moe = n_stage_layers.get("moe", 0)
        out["cp"] = analytic_cp_bytes(
            dims.micro_batch_size(cfg),
            cfg.data.seq_len,
            dims.cp,
            kv // dims.tp,
            moe.top_k * (8 + (4 if scores else 0)),
            n_attn,
            n_moe,
            m,
            recomputed_attention=n_attn if ac != "none" else 0,
            recomputed_moe=n_moe if ac == "full" else 0,
            bytes_per_elem=bytes_per_elem,
        )
    return out


def analytic_expert_flops(cfg: Any, dims: Any, n_moe_layers: int) -> float:
    """Forward FLOPs of routed experts per rank in one step if every token's top-k
    assignments are computed (no drops) and spread evenly: 6 D F per assignment, over the
    global batch's T K assignments per MoE layer, divided among the dp x cp ranks (each computes
    its share of the tokens' experts, under expert parallelism for its EP peers) and the tp
    ranks when ``parallel.expert_tp`` splits every expert's FFN width. With experts
    replicated over tp each tp rank computes all of its dp rank's: tp x this figure.
    ``n_moe_layers``: the MoE layers this rank's pipeline stages hold."""
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    per_assignment = 6 * cfg.model.dim * cfg.moe.expert_ffn_dim
    split = dims.dp * dims.cp * (dims.tp if cfg.parallel.expert_tp else 1)
    return per_assignment * tokens * cfg.moe.top_k * n_moe_layers / split


def step_figures(trainer: Any, report: StepReport) -> dict[str, Any]:
    """What ``measure_step`` measured on this rank beside the analytic figure for each: model
    state against the ZeRO formula, bytes sent by kind (and over the cp group) against
    ``analytic_sent``, saved activations with the whole-sequence K/V term cp keeps, expert
    FLOPs against ``analytic_expert_flops``. What tools/comm_report.py prints and
    tests/parallel/test_accounting.py asserts."""
    cfg, d, engine = trainer.cfg, trainer.dims, trainer.engine
    counts = layer_counts(engine.parts)
    zero = cfg.parallel.zero_stage if d.dp * d.cp > 1 else 0
    cp_group = engine.meshes.cp.get_group().group_name if d.cp > 1 else None
    params = report.params_per_rank
    optim_bytes = optimizer_state_bytes_per_param(engine.optimizers)
    return {
        "params": params,
        "memory": report.peak.total,
        "optim_bytes": optim_bytes,
        # Muon's matrices and the rest apart (optim.name=muon; the rest is all under AdamW)
        "optim_bytes_muon": optimizer_state_bytes_per_param(engine.optimizers, muon=True),
        "optim_bytes_rest": optimizer_state_bytes_per_param(engine.optimizers, muon=False),
        "formula": zero_bytes_per_param(zero, d.dp_shard * d.cp, optim_bytes=optim_bytes) * params,
        "zero": zero,
        "sent": report.sent,
        "sent_cp": report.sent_by_group.get(cp_group, {}) if cp_group else {},
        "analytic": analytic_sent(cfg, d, params, counts),
        "moe_layers": counts["moe"],
        "dense_layers": counts["dense"],
        "expert_flops": report.expert_flops,
        "expert_flops_analytic": analytic_expert_flops(cfg, d, counts["moe"]),
        "activations": report.activations,
        "kv": full_sequence_kv_bytes(
            cfg.model,
            d,
            d.micro_batch_size(cfg),
            cfg.data.seq_len,
            counts["dense"] + counts["moe"],
            cfg.parallel.activation_checkpointing,
        ),
        "cp": d.cp,
    }


def layer_counts(parts: list[torch.nn.Module]) -> dict[str, int]:
    """Dense and MoE layers of this rank's chunks, and how many of the embedding and the
    output it holds (the inputs of ``analytic_sent``)."""
    from moetrain.model.moe import MoELayer

    out = {"dense": 0, "moe": 0, "boundary": 0}
    for part in parts:
        for block in part.layers.values():
            is_moe = any(isinstance(m, MoELayer) for m in block.modules())
            out["moe" if is_moe else "dense"] += 1
        out["boundary"] += (part.tok_embeddings is not None) + (part.output is not None)
    return out
