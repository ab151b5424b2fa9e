"""What a layout really did, observed while it ran, and what its request says it must do.

``observe(engine)`` hooks a trainer's engine before its first step and records what ran:

- the order of the micro-batches' forwards and backwards (a forward hook on this rank's first
  model chunk; a gradient hook on its output marks the backward; a marker at every run of
  the pipeline schedule): how many micro-batches a step ran and in passes of how many;
- the shapes of the queries, keys and values the first attention core saw (heads per tp
  rank, positions per cp rank, sequences per micro-batch);
- the positions that attention's RoPE rows belong to (matched against the model's table;
  "per token" where rows come per token, positions restarting at every document).

``layout_facts(trainer, records)`` adds what the built model is (placements, FSDP units,
ZeRO-1 shards, checkpoint wrappers, experts per rank, the dispatcher) and the collectives of
the first step with the ranks of their groups (``CommCounter`` records).

``expected_layout(overrides, world, rank)`` computes every fact from the raw request -- the
``parallel.*`` overrides as written, the declared defaults of the keys not given --
with its own arithmetic: it never calls the config validation or ``ParallelDims`` that the
run itself uses, so a layout the code silently changes (``parallel.cp`` forced to 1, a
breadth-first setting the engine ignores) cannot change the expectation with it.
``check_layout`` compares the two and returns one line per differing fact.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from typing import Any

import torch

# --------------------------------------------------------------------------- observation


class StepObserver:
    """Records what this rank's first model chunk ran during one step (``observe``)."""

    def __init__(self, engine: Any) -> None:
        self.events: list[str] = []  # F: a training forward, B: its backward, C: counting
        self.shapes: tuple[tuple[int, ...], ...] | None = None
        self.cos: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self._undo: list[Any] = []
        part = engine.parts[0]
        self._undo.append(part.register_forward_hook(self._after_forward).remove)
        if engine.schedule is not None:  # a pass = one run of the schedule
            schedule, run = engine.schedule, engine.schedule.step

            def step(*args: Any, **kwargs: Any) -> Any:
                self.events.append("|")
                return run(*args, **kwargs)

            schedule.step = step
            self._undo.append(lambda: delattr(schedule, "step"))
        # The first attention this rank runs: its first chunk that holds a block (the first
        # stage may hold the embedding alone).
        with_blocks = [p for p in engine.parts if len(p.layers)]
        self.table = getattr(with_blocks[0], "rope_cos", None) if with_blocks else None
        if not with_blocks:
            return
        block = with_blocks[0].layers[next(iter(with_blocks[0].layers))]
        attention = getattr(block.attention, "_checkpoint_wrapped_module", block.attention)
        attend = attention.attend

        def recorded(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **kw: Any
        ) -> Any:
            if self.shapes is None:
                self.shapes = tuple(tuple(t.shape) for t in (q, k, v))
            return attend(q, k, v, *rest, **kw)

        def before(module: Any, args: tuple[Any, ...]) -> None:
            if self.cos is None and len(args) > 1:
                self.cos = args[1].detach().clone()

        attention.attend = recorded
        self._undo.append(lambda: setattr(attention, "attend", attend))
        self._undo.append(attention.register_forward_pre_hook(before).remove)

    def _after_forward(self, module: Any, args: Any, out: Any) -> None:
        t = out[0] if isinstance(out, tuple) else out
        if not (torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad):
            self.events.append("C")  # the counting pass (no grad) of the global-batch loss
            return
        self.events.append("F")
        t.register_hook(lambda grad: self.events.append("B"))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def facts(self) -> dict[str, Any]:
        order = "".join(e for e in self.events if e in "FB")
        if "|" in self.events:  # pipeline: the forwards of each run of the schedule
            runs = "".join(e for e in self.events if e in "F|").split("|")
            passes = tuple(r.count("F") for r in runs if r)
        else:  # forwards before backwards: each run of forwards is a pass
            passes = tuple(len(r) for r in order.replace("B", " ").split())
        positions: Any = None
        if self.cos is not None and self.cos.dim() == 3:
            positions = "per token"  # positions restarting at every document (of the data)
        elif self.cos is not None and self.table is not None and self.shapes is not None:
            used = self.cos[: self.shapes[0][1]].float()
            dist = torch.cdist(used, self.table.to(used.device).float())
            positions = tuple(int(i) for i in dist.argmin(1))
        return {
            "microbatches": order.count("F"),
            "backwards": order.count("B"),
            "breadth_first": passes,
            "order": order,
            "attention_shapes": self.shapes,
            "positions": positions,
        }


def observe(engine: Any) -> StepObserver:
    return StepObserver(engine)


def watch_fsdp(engine: Any) -> dict[str, bool]:
    """After the first FSDP block's forward (FSDP's own post-forward hook runs first), note
    whether its parameters went back to their sharded DTensors: ZeRO-3 reshards, ZeRO-2
    keeps them gathered for backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    seen: dict[str, bool] = {}
    for part in engine.parts:
        for block in part.layers.values():
            if isinstance(block, FSDPModule):

                def after(module: Any, args: Any, out: Any) -> None:
                    p = next(module.parameters())
                    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
                    seen.setdefault("resharded", bool({"dp_shard", "dp_shard_cp"} & set(names)))

                block.register_forward_hook(after)
                return seen
    return seen


def _group_ranks(name: str) -> tuple[int, ...]:
    """The ranks of the process group named ``name`` (every rank for the default group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - "default" or a group already destroyed
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


def layout_facts(trainer: Any, records: list[Any] | None) -> dict[str, Any]:
    """What this rank's layout is, read off the built model and one step's collectives
    (``records`` of a ``CommCounter``; None: no traffic facts). The step's own observations
    (``StepObserver.facts``) are added by the caller."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from moetrain.model.moe import MoELayer
    from moetrain.train.tensors import fqn as _fqn

    eng = trainer.engine
    # The first column-parallel attention projection (GQA's wq, MLA's per-head up-projection;
    # MLA's latent down-projections stay replicated), wrapper prefixes and all; on a rank
    # without a block (a pipeline stage of the embedding or the head alone) the embedding
    # or the output, split over the vocabulary (dim 0) as wq over its heads.
    named = [(_fqn(n), p) for part in eng.parts for n, p in part.named_parameters()]
    wq = next(
        (p for n, p in named if n.endswith(("attention.wq.weight", "attention.wkv_b.weight"))),
        None,
    )
    if wq is None:
        wq = next(p for n, p in named if n in ("tok_embeddings.weight", "output.weight"))
    tp_placement = None
    zero_shards = 1  # into how many pieces the dp ranks cut the model state
    if isinstance(wq, DTensor):
        names = wq.device_mesh.mesh_dim_names or ()
        for name, placement, size in zip(names, wq.placements, wq.device_mesh.shape, strict=True):
            if name == "tp":
                tp_placement = str(placement)
            elif name in ("dp_shard", "dp_shard_cp") and not placement.is_replicate():
                zero_shards = size  # FSDP (ZeRO-2/3), over dp_shard (x cp) only under HSDP
    if eng.grad_sync is not None and eng.grad_sync.shards:
        zero_shards = eng.grad_sync.shards[0].n  # ZeRO-1
    wrapped: Counter[str] = Counter()
    for part in eng.parts:
        for name, module in part.named_modules():
            if isinstance(module, CheckpointWrapper):
                wrapped["attention" if name.endswith("attention") else "block"] += 1
    moe = [m for part in eng.parts for m in part.modules() if isinstance(m, MoELayer)]
    blocks = [part.layers[name] for part in eng.parts for name in part.layers]
    attention = blocks[0].attention if blocks else None
    attention = getattr(attention, "_checkpoint_wrapped_module", attention)
    facts: dict[str, Any] = {
        "stages": tuple(eng.stage_ids),
        # The blocks each of this rank's chunks holds, by index, in chunk order.
        "stage_layers": tuple(tuple(int(n) for n in part.layers) for part in eng.parts),
        "schedule": type(eng.schedule).__name__ if eng.schedule is not None else None,
        "attend": type(attention.attend).__name__ if attention is not None else None,
        "moe_whole_sequences": bool(moe) and all(m.seq_shard is not None for m in moe),
        "shared_overlap": bool(moe) and getattr(moe[0].dispatcher, "overlapped", 0) > 0,
        "ep_halves": any(getattr(b, "_checkpoint_wrapped_module", b).halves for b in blocks),
        "ep_dropless_slots": bool(moe) and _a2a_dispatcher(moe[0].dispatcher) is not None
        and _a2a_dispatcher(moe[0].dispatcher).dropless_slots,
        "tp_placement": tp_placement,
        "fsdp_units": sum(isinstance(m, FSDPModule) for p in eng.parts for m in p.modules()),
        "zero1_sharded": bool(eng.grad_sync is not None and eng.grad_sync.shards),
        "zero_shards": zero_shards,
        "checkpointed": dict(wrapped),
        "experts": _experts_per_rank(moe[0].experts.w1) if moe else None,
        "dispatcher": _dispatcher_name(moe[0].dispatcher) if moe else None,
    }
    if records is not None:
        groups: dict[tuple[int, ...], set[str]] = {}
        for r in records:
            if r.sent > 0 and r.kind != "send":  # point to point: a peer, not a group
                groups.setdefault(_group_ranks(r.group), set()).add(r.kind)
        facts["traffic_groups"] = {g: tuple(sorted(k)) for g, k in sorted(groups.items())}
    return facts


def _a2a_dispatcher(d: Any) -> Any:
    """The all-to-all dispatcher inside ``d`` (expert TP wraps it), or None."""
    while d is not None and not hasattr(d, "dropless_slots"):
        d = getattr(d, "inner", None)
    return d


def _dispatcher_name(d: Any) -> str:
    inner = getattr(d, "inner", None)
    return type(d).__name__ + (f"({_dispatcher_name(inner)})" if inner is not None else "")


def _experts_per_rank(w1: Any) -> tuple[int, int]:
    """(experts, FFN width) of one expert weight that this rank computes with: a slice of E
    under expert parallelism, of F under expert tensor parallelism (a DTensor over tp, or a
    plain slice under ep > 1). FSDP's sharding of dim 0 over dp is storage, not compute."""
    from torch.distributed.tensor import DTensor, Shard

    experts, _, ffn = w1.shape
    if isinstance(w1, DTensor):
        names = w1.device_mesh.mesh_dim_names or ()
        for name, placement, size in zip(names, w1.placements, w1.device_mesh.shape, strict=True):
            if name == "tp" and isinstance(placement, Shard) and placement.dim == 2:
                ffn //= size
    return (experts, ffn)


# --------------------------------------------------------------------------- the request


SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining's class for each ``parallel.pp_schedule`` (written here, not
read from moetrain's table)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """A layout as asked for: the ``parallel.*`` values of the overrides (the declared
    defaults for the keys not given) on ``world`` ranks, with the degrees derived by this
    file's own arithmetic (the documented rank order: pp, dp_replicate, dp_shard, cp, tp)."""

    world: int
    values: dict[str, Any]

    def __getattr__(self, key: str) -> Any:
        try:
            return self.values[key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def dp_shard(self) -> int:
        v = self.values
        others = v["pp"] * v["dp_replicate"] * v["cp"] * v["tp"]
        if v["dp_shard"] != -1:
            return v["dp_shard"]
        if self.world % others:
            raise ValueError(f"{others} ranks per data-parallel rank do not divide {self.world}")
        return self.world // others

    @property
    def dp(self) -> int:
        return self.values["dp_replicate"] * self.dp_shard

    def mesh(self) -> list[tuple[str, int]]:
        v = self.values
        return [("pp", v["pp"]), ("dp_replicate", v["dp_replicate"]),
                ("dp_shard", self.dp_shard), ("cp", v["cp"]), ("tp", v["tp"])]  # fmt: skip

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in reversed(self.mesh()):
            out[name], rank = rank % size, rank // size
        return out

    def ep_mesh(self) -> list[tuple[str, int]]:
        """Expert parallelism's view of the same ranks: (pp, edp, ep, tp), the ep groups
        consecutive ranks of the flattened (dp_replicate, dp_shard, cp)."""
        v = self.values
        dp_cp = self.dp * v["cp"]
        return [("pp", v["pp"]), ("edp", dp_cp // v["ep"]), ("ep", v["ep"]), ("tp", v["tp"])]


def request(overrides: list[str] | tuple[str, ...], world: int) -> Request:
    """The ``parallel.*`` values of ``overrides`` as written (YAML scalars; the last one of a
    key wins), on top of the defaults ``ParallelConfig`` declares."""
    import yaml

    from moetrain.config import ParallelConfig

    values = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("parallel."):
            values[key.removeprefix("parallel.")] = yaml.safe_load(value)
    return Request(world, values)


def _options_config(overrides: list[str] | tuple[str, ...]):
    """The model, MoE, data and training sections of the request (no parallel key: the
    layout is read from the raw overrides, never through config validation)."""
    return _options_config_of(tuple(o for o in overrides if not o.startswith("parallel.")))


@functools.cache
def _options_config_of(options: tuple[str, ...]):
    from micro import micro_config

    return micro_config("unused", *options)


def expected_layout(overrides: list[str], world_size: int, rank: int) -> dict[str, Any]:
    """Every fact ``layout_facts`` and ``StepObserver`` report, as ``overrides`` on the micro
    MoE ask for it on ``rank``, computed from the raw request (see the module doc). Raises
    ValueError when the request cannot form a layout on ``world_size`` ranks."""
    p = request(overrides, world_size)
    cfg = _options_config(overrides)
    m, moe, t = cfg.model, cfg.moe, cfg.train
    pp, tp, cp, ep, v = p.pp, p.tp, p.cp, p.ep, p.pp_virtual_stages
    dp = p.dp
    c = p.coords(rank)
    if pp == 1:
        stages: tuple[int, ...] = (0,)
    elif p.pp_schedule in ("zbv", "dualpipev"):  # the V: rank r holds r and 2 pp - 1 - r
        if v != 2:
            raise ValueError(f"the V places 2 stages per rank, not {v}")
        stages = (c["pp"], 2 * pp - 1 - c["pp"])
    else:  # looped: r, r + pp, ...
        stages = tuple(c["pp"] + i * pp for i in range(v))
    n_stages = pp * v
    if p.pp_stage_layers is not None and pp > 1:  # the counts as written, stage by stage
        counts = list(p.pp_stage_layers)
        if len(counts) != n_stages or sum(counts) != m.n_layers:
            raise ValueError(f"{counts} layers for {n_stages} stages of {m.n_layers}")
    elif m.n_layers % n_stages:
        raise ValueError(f"{m.n_layers} layers in {n_stages} stages")
    else:
        counts = [m.n_layers // n_stages] * n_stages
    starts = list(itertools.accumulate([0, *counts]))
    per_stage = [list(range(starts[s], starts[s + 1])) for s in stages]
    # Multi-token-prediction modules: blocks n_layers.. of the last stage.
    mtp = range(m.n_layers, m.n_layers + m.mtp_depth)
    for s, blocks in zip(stages, per_stage, strict=True):
        if s == n_stages - 1:
            blocks += list(mtp)
    layers = [i for blocks in per_stage for i in blocks]
    moe_layers = [
        i
        for i in layers
        if moe.num_experts
        and i % moe.every_n_layers == moe.every_n_layers - 1
        and (i not in moe.dense_layers or i >= m.n_layers)
    ]
    gbs = t.global_batch_size
    if pp > 1 and p.pp_microbatches is not None:
        n_micro = p.pp_microbatches
    else:
        if gbs % (dp * t.micro_batch_size):
            raise ValueError(f"{gbs} sequences over {dp} dp ranks of {t.micro_batch_size}")
        n_micro = gbs // (dp * t.micro_batch_size)
    mbs = gbs // (dp * n_micro)  # sequences per forward
    if p.breadth_first_micro_batches is not None:
        breadth = p.breadth_first_micro_batches
    elif p.depth_first_micro_batches is not None:
        breadth = n_micro // p.depth_first_micro_batches
    else:
        breadth = n_micro if pp > 1 else 1
    if not breadth or n_micro % breadth:
        raise ValueError(f"passes of {breadth} in {n_micro} micro-batches")
    seq = cfg.data.seq_len
    if cp > 1:  # chunks c and 2 cp - 1 - c of 2 cp
        chunk = seq // (2 * cp)
        r = c["cp"]
        positions = tuple(range(r * chunk, (r + 1) * chunk)) + tuple(
            range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
        )
    else:
        positions = tuple(range(seq))
    if m.attention == "mla":
        qk, vd, kv_heads = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.n_heads
    else:
        qk = vd = m.head_dim or m.dim // m.n_heads
        kv_heads = m.n_kv_heads or m.n_heads
    s = seq // cp
    # parallel.ep_overlap=halves: a block with an MoE layer (not an MTP module) attends to
    # each half of the micro-batch on its own
    halves = [i for i in moe_layers if i < m.n_layers] if p.ep_overlap == "halves" else []
    b = mbs // 2 if layers and layers[0] in halves else mbs
    shapes = ((b, s, m.n_heads // tp, qk), (b, s, kv_heads // tp, qk),
              (b, s, kv_heads // tp, vd))  # fmt: skip
    zero = p.zero_stage if dp * cp > 1 else 0
    ep_split = ep > 1 and moe.num_experts > 0
    experts = dispatcher = None
    if moe_layers:
        experts = (moe.num_experts // ep, moe.expert_ffn_dim // (tp if p.expert_tp else 1))
        dispatcher = "LocalDispatcher"
        if ep_split:
            dispatcher = {"all_to_all": "AllToAllDispatcher",
                          "all_gather": "AllGatherDispatcher"}[p.ep_dispatcher]  # fmt: skip
        if p.expert_tp and tp > 1:
            dispatcher = f"ExpertTPDispatcher({dispatcher})"
    ac = p.activation_checkpointing
    want: dict[str, Any] = {
        "stages": stages,
        "stage_layers": tuple(tuple(blocks) for blocks in per_stage),
        "schedule": SCHEDULE_CLASSES[p.pp_schedule] if pp > 1 else None,
        "microbatches": n_micro,
        "backwards": n_micro,
        "breadth_first": (breadth,) * (n_micro // breadth),
        "positions": positions if layers else None,
        "attention_shapes": shapes if layers else None,
        "attend": ("ContextParallelAttention" if cp > 1 else "function") if layers else None,
        "moe_whole_sequences": cp > 1 and bool(moe_layers),
        "shared_overlap": bool(p.overlap_shared_experts and moe_layers and moe.num_shared_experts),
        "ep_halves": bool(halves),
        "ep_dropless_slots": p.ep_dropless_transport == "slots" and bool(moe_layers),
        "tp_placement": "S(0)" if tp > 1 else None,
        # A unit per block and per chunk root; under bf16 each MoE router is one more (it is
        # gathered in fp32).
        "fsdp_units": (
            len(layers) + len(stages) + (len(moe_layers) if t.dtype == "bf16" else 0)
            if zero >= 2
            else 0
        ),
        "zero1_sharded": zero == 1,
        "zero_shards": p.dp_shard * cp if zero >= 1 else 1,
        # (a rank without blocks, on a pipeline's empty first or last stage, wraps nothing)
        "checkpointed": {"attention": len(layers)}
        if ac == "selective" and layers
        else ({"block": len(layers)} if ac == "full" and layers else {}),
        "experts": experts,
        "dispatcher": dispatcher,
        "traffic_axes": sorted(
            axis for axis, n in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)) if n > 1
        ),
        "foreign_groups": _embedding_pair(p, m, rank),
        "sequence_parallel_traffic": p.sequence_parallel,
        "fsdp_resharded_after_forward": (zero == 3) if zero >= 2 else None,
        "ep_bytes_sent": ep_split,
    }
    if pp == 1:  # without a pipeline: each pass's forwards, then its backwards
        want["order"] = ("F" * breadth + "B" * breadth) * (n_micro // breadth)
    if m.document_positions:  # positions restart at the documents the data hold: not a layout
        del want["positions"]
    return want


def _embedding_pair(p: Request, m: Any, rank: int) -> list[tuple[int, int]]:
    """Multi-token prediction under a looped pipeline of more than two stages: the group of
    the first stage's rank and the last stage's with this rank's other coordinates, which
    sums the embedding's two copies' gradients (no axis of the mesh: pp=2 uses the pp group,
    the V schedules one rank)."""
    pp = p.pp
    if not m.mtp_depth or pp <= 2 or p.pp_schedule in ("zbv", "dualpipev"):
        return []
    per = p.world // pp  # the mesh is (pp, ...) row-major
    rest = rank % per
    pair = (rest, (pp - 1) * per + rest)
    return [pair] if rank in pair else []


# --------------------------------------------------------------------------- comparison

AXIS = {"dp_replicate": "dp", "dp_shard": "dp", "edp": "dp", "ep": "dp"}
"""The axes traffic is reported under: the data-parallel ones (and expert parallelism's
groups, carved out of the data-parallel ranks) read dp."""
TRAFFIC_FACTS = ("traffic_axes", "foreign_groups", "sequence_parallel_traffic")


def _subgrids(mesh: list[tuple[str, int]], rank: int) -> dict[tuple[int, ...], tuple[str, ...]]:
    """Every group of ranks through ``rank`` that varies along some axes of ``mesh`` (row
    major) and keeps the others: its ranks -> those axes (size-1 axes left out)."""
    sizes = [n for _, n in mesh]
    coords, r = [], rank
    for n in reversed(sizes):
        coords.append(r % n)
        r //= n
    coords.reverse()
    axes = [i for i, n in enumerate(sizes) if n > 1]
    out: dict[tuple[int, ...], tuple[str, ...]] = {}
    for k in range(1, len(axes) + 1):
        for chosen in itertools.combinations(axes, k):
            ranks = []
            for values in itertools.product(*(range(sizes[i]) for i in chosen)):
                c = list(coords)
                for i, val in zip(chosen, values, strict=True):
                    c[i] = val
                flat = 0
                for i, n in enumerate(sizes):
                    flat = flat * n + c[i]
                ranks.append(flat)
            out.setdefault(tuple(sorted(ranks)), tuple(mesh[i][0] for i in chosen))
    return out


def traffic_facts(groups: dict[tuple[int, ...], Any], p: Request, rank: int) -> dict[str, Any]:
    """From the groups that carried collectives (ranks -> kinds): the axes of the requested
    mesh they span, the groups that are no combination of its axes through this rank
    (``foreign_groups``: a collective over ranks the layout does not group), and whether
    the tensor-parallel group reduce-scattered (sequence parallelism)."""
    known = _subgrids(p.mesh(), rank)
    if p.ep > 1:
        known = {**_subgrids(p.ep_mesh(), rank), **known}
    axes, foreign, sp = set(), [], False
    for ranks, kinds in groups.items():
        if ranks not in known:
            foreign.append(ranks)
            continue
        axes |= {AXIS.get(a, a) for a in known[ranks]}
        sp = sp or (known[ranks] == ("tp",) and "reduce_scatter" in kinds)
    return {"traffic_axes": sorted(axes), "foreign_groups": foreign,
            "sequence_parallel_traffic": sp}  # fmt: skip


def check_layout(
    facts: dict[str, Any],
    overrides: list[str] | tuple[str, ...],
    world: int,
    rank: int,
    want: dict[str, Any] | None = None,
) -> list[str]:
    """The facts of a run that differ from what its request asks (``want``: its
    ``expected_layout``, computed here when not given), one line each (traffic only when the
    run counted its collectives)."""
    if want is None:
        want = expected_layout(list(overrides), world, rank)
    facts = dict(facts)
    if "traffic_groups" in facts:
        facts.update(traffic_facts(facts["traffic_groups"], request(overrides, world), rank))
    return layout_mismatches(facts, want)


def layout_mismatches(facts: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The facts that differ from what the request asks, one line each (traffic facts only
    when the run counted its collectives)."""
    return [
        f"{key}: the request asks for {want[key]!r}, the run has {facts.get(key)!r}"
        for key in want
        if (key in facts or key not in TRAFFIC_FACTS) and facts.get(key) != want[key]
    ]
