"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model splits into ``pp * pp_virtual_stages`` stages of contiguous layers, equal unless
``parallel.pp_stage_layers`` gives each stage its count (``stage_layer_counts``); stage s runs
on pp rank ``s % pp`` (the looped placement the interleaved schedules expect), so a rank with
v virtual stages holds chunks r, r + pp, r + 2 pp, ... The V-shaped schedules (``zbv``,
``dualpipev``) place two stages per rank in a V instead: rank r holds stages r and
2 pp - 1 - r, so the first and the last stage share rank 0 and a micro-batch turns around on
the last rank without a hop (``stage_ids``). Each chunk is a deep copy of the full
model with the layers it does not own deleted (torchtitan-style): names stay as in the full
model, so checkpoints do not depend on the layout. The first stage keeps the embedding, the
last the final norm and output, and with multi-token prediction the modules (layers
``n_layers``..) and a copy of the embedding for their inputs (``embedding_copy``;
``stage_modules`` says what each stage holds). The first and the last stage may hold no
transformer layer (the embedding alone, the head alone: Megatron-Core's DeepSeek-V3 layout
gives its last stage the multi-token-prediction module and the loss only).

The split happens before the other ``apply_*`` steps (a sharded module cannot be deep
copied); the ``PipelineStage`` objects and the schedule are built last, around the final
modules (``build_pipeline``).

Losses: the schedule runs ``loss_fn`` on the last stage for every micro-batch; it returns
the micro-batch's mean cross-entropy divided by the micro-batch count (``scale_grads=False``)
so the summed gradients are the step's mean, exactly as gradient accumulation does. The MoE
balancing losses of every stage ride on their layers' outputs (``AuxLossInjector``) with
scale 1 / micro-batches, so stages other than the last need nothing more.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetrain.config import V_SCHEDULES, ParallelConfig

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")
"""Schedules that take one stage per rank (torch's ``PipelineScheduleSingle``)."""


def stage_layer_counts(
    n_layers: int, num_stages: int, counts: list[int] | tuple[int, ...] | None = None
) -> list[int]:
    """Transformer layers per stage: ``counts`` (``parallel.pp_stage_layers``) when given,
    else ``n_layers / num_stages`` each (validation has checked that either holds:
    ``ParallelDims.validate``)."""
    if counts is not None:
        return list(counts)
    return [n_layers // num_stages] * num_stages


def stage_layers(
    n_layers: int, num_stages: int, stage: int, counts: list[int] | tuple[int, ...] | None = None
) -> list[int]:
    """Layer indices of ``stage``: the next ``stage_layer_counts(...)[stage]`` layers after
    the earlier stages' (contiguous blocks)."""
    per = stage_layer_counts(n_layers, num_stages, counts)
    start = sum(per[:stage])
    return list(range(start, start + per[stage]))


def stage_modules(
    n_layers: int,
    mtp_depth: int,
    num_stages: int,
    stage: int,
    counts: list[int] | tuple[int, ...] | None = None,
) -> tuple[list[int], bool, bool]:
    """What ``stage`` holds: its block indices (its transformer layers, and on the last stage
    the multi-token-prediction modules, blocks ``n_layers``.. : they run after the output
    head), whether it embeds the input (the first stage) and whether it holds the final norm
    and output head (the last)."""
    blocks = stage_layers(n_layers, num_stages, stage, counts)
    last = stage == num_stages - 1
    if last:
        blocks += list(range(n_layers, n_layers + mtp_depth))
    return blocks, stage == 0, last


def suggested_stage_layers(n_layers: int, num_stages: int) -> list[int] | None:
    """A ``parallel.pp_stage_layers`` for layers that do not split equally: as even as the
    counts allow, the layers left over one each on the stages in between first (the first
    and the last stage also hold the embedding and the output head), then on the first
    (the embedding costs memory, not compute). None when no valid split exists (fewer
    layers than the stages in between)."""
    per, extra = divmod(n_layers, num_stages)
    counts = [per] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1]
    for s in order[:extra]:
        counts[s] += 1
    if any(c == 0 for c in counts[1:-1]):
        return None
    return counts


def stage_ids(
    pp_rank: int, pp: int, virtual_stages: int, schedule: str = "interleaved_1f1b"
) -> list[int]:
    """The stages pp rank ``pp_rank`` runs, in order: looped (r, r + pp, ...), or the V of
    the ``zbv`` / ``dualpipev`` schedules (r, 2 pp - 1 - r)."""
    if schedule in V_SCHEDULES:
        if virtual_stages != 2:
            raise ValueError(
                f"pp_schedule={schedule!r} places 2 stages per rank, not {virtual_stages}"
            )
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual_stages)]


def pipeline_split(
    model: nn.Module, pp_rank: int, cfg: ParallelConfig
) -> tuple[list[nn.Module], list[int]]:
    """This pp rank's model chunks (deep copies of ``model`` without the other stages'
    layers) and their stage indices. pp=1: ``[model]`` itself. The chunks share ``model``'s
    step context (``moetrain.model.step_context``): its owner's settings reach them all."""
    if cfg.pp == 1:
        return [model], [0]
    num_stages = cfg.pp * cfg.pp_virtual_stages
    n_layers = model.cfg.n_layers
    mtp_depth = model.cfg.mtp_depth
    parts, ids = [], stage_ids(pp_rank, cfg.pp, cfg.pp_virtual_stages, cfg.pp_schedule)
    for s in ids:
        context = model.step_context
        part = copy.deepcopy(model, {id(context): context})
        blocks, first, last = stage_modules(n_layers, mtp_depth, num_stages, s, cfg.pp_stage_layers)
        keep = {str(i) for i in blocks}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if not first:
            part.embeds_input = False
            # Multi-token-prediction modules (on the last stage) read the embedding of later
            # tokens: that stage keeps a copy of it.
            if not (last and mtp_depth):
                part.tok_embeddings = None
        if not last:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts, ids


def embedding_copy(part: nn.Module) -> nn.Parameter | None:
    """The embedding weight of a chunk that holds it without embedding its input: the last
    stage's copy under multi-token prediction (``pipeline_split``), else None.

    The first and the last stage each hold ``tok_embeddings.weight`` under that one name. The
    engine sums the two gradients after backward, so that both copies take the same optimizer
    step and stay equal; checkpoints keep the name once (``torch.distributed.checkpoint``
    writes a tensor that two ranks hold alike once); the gradient norm counts the copy once."""
    emb = getattr(part, "tok_embeddings", None)
    if emb is None or getattr(part, "embeds_input", True):
        return None
    return emb.weight


_EMBEDDING_GROUPS: dict[Any, Any] = {}


def embedding_group(meshes: Any, dims: Any, schedule: str) -> Any:
    """The process group of this rank's first-stage embedding and last-stage copy (the ranks
    of pp index 0 and of the last stage's pp index with this rank's other coordinates), or
    None when one rank holds both (the V placement puts the first and the last stage on pp
    rank 0). Collective on first use for pp > 2 (every rank creates every pair's group);
    then reused, like the meshes."""
    pp = dims.pp
    if schedule in V_SCHEDULES:
        return None
    if pp == 2:
        return meshes.pp.get_group()
    import torch.distributed as dist

    key = (id(dist.group.WORLD), dims)
    if key not in _EMBEDDING_GROUPS:
        ranks = meshes.world.mesh.reshape(pp, -1)  # looped: the last stage is on pp rank pp - 1
        pairs = [[int(ranks[0, j]), int(ranks[pp - 1, j])] for j in range(ranks.shape[1])]
        _EMBEDDING_GROUPS[key] = dist.new_subgroups_by_enumeration(pairs)[0]
    return _EMBEDDING_GROUPS[key]


def build_pipeline(
    parts: list[nn.Module],
    ids: list[int],
    pp_group: Any,
    device: torch.device,
    cfg: ParallelConfig,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """``PipelineStage`` per chunk and the configured schedule around them."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    num_stages = cfg.pp * cfg.pp_virtual_stages
    stages = [
        PipelineStage(part, s, num_stages, device, group=pp_group)
        for part, s in zip(parts, ids, strict=True)
    ]
    cls = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
    if cfg.pp_schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ----------------------------------------------------------------------------- bubble


class _StageShape:
    """What torch's schedule constructors read of a ``PipelineStage`` to lay out their
    action lists: enough to build a schedule for any pp without processes."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = nn.Identity()
        self.has_backward = True


def schedule_actions(schedule: str, pp: int, virtual_stages: int, n_microbatches: int):
    """The compute actions (``pipeline_order``: rank -> actions, None for an idle slot) of
    torch's ``schedule`` for pp ranks, ``virtual_stages`` stages each and
    ``n_microbatches``, built without processes (the constructors only lay out the list)."""
    from torch.distributed import pipelining

    cls = getattr(pipelining, SCHEDULES[schedule])
    num_stages = pp * virtual_stages
    stages = [_StageShape(s, num_stages, pp, 0) for s in stage_ids(0, pp, virtual_stages, schedule)]
    kw: dict[str, Any] = {"n_microbatches": n_microbatches, "loss_fn": lambda out, tgt: out}
    if schedule in SINGLE_STAGE:
        return _forwards_in_order(cls(stages[0], **kw)._get_pipeline_order())
    return cls(stages, **kw).pipeline_order


def _forwards_in_order(order: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """Number each rank's forwards 0, 1, ... in list order. torch 2.13's
    ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1 (F1 .. Fm,
    an off-by-one in a list its runtime does not execute: it runs its own loop); the
    single-stage schedules run every micro-batch's forward in order on every rank."""
    out = {}
    for rank, acts in order.items():
        seen = 0
        fixed = []
        for a in acts:
            if a is not None and a.computation_type.value == "F":
                a = a._replace(microbatch_index=seen)
                seen += 1
            fixed.append(a)
        out[rank] = fixed
    return out


UNIT_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
"""Cost of an action on one stage in the bubble model: forward = backward for inputs =
backward for weights, a full backward both (the zero-bubble papers' T_F = T_B = T_W)."""


def simulate_schedule(
    order: dict[int, list[Any]], num_stages: int, stage_cost: list[float] | None = None
) -> dict[str, Any]:
    """Run the action lists on an ideal machine: each rank executes its actions in order,
    an action starts when its rank is free and its inputs exist (the previous stage's
    forward of that micro-batch; the next stage's input gradient and its own forward for a
    backward; its own input gradient for a weight gradient), costs ``UNIT_COST`` times its
    stage's ``stage_cost`` (1 each when not given: equal stages) and communication is free.
    An overlapped forward + backward (DualPipe-V) costs both.

    Returns ``makespan``, ``busy`` (the work of the busiest rank), ``bubble`` = (makespan -
    busy) / busy: idle time over useful time, the unit of the analytic (p - 1)/m, and
    ``busy_by_rank``. With unequal stages the busiest rank sets the pace and the others
    idle more: their own idle fraction is makespan / busy_by_rank[r] - 1."""
    compute = ("F", "I", "W", "B", "OVERLAP_F_B")  # REDUCE_GRAD and the like cost nothing
    pending = {
        r: [a for a in acts if a is not None and a.computation_type.value in compute]
        for r, acts in order.items()
    }
    weight = list(stage_cost) if stage_cost is not None else [1.0] * num_stages

    def cost(a: Any) -> float:
        return UNIT_COST[a.computation_type.value] * weight[a.stage_index]

    done: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(pending, 0.0)
    busy = dict.fromkeys(pending, 0.0)

    def parts(a: Any) -> list[Any]:
        return list(a.sub_actions) if a.sub_actions is not None else [a]

    def ready(a: Any) -> float | None:
        s, kind, m = a.stage_index, a.computation_type.value, a.microbatch_index
        needs: list[tuple[int, str, int]] = []
        if kind == "F" and s > 0:
            needs = [(s - 1, "F", m)]
        elif kind in ("B", "I"):
            needs = [(s, "F", m)] + ([(s + 1, "I", m)] if s < num_stages - 1 else [])
        elif kind == "W":
            needs = [(s, "I", m)]
        times = [done.get(n) for n in needs]
        return None if any(t is None for t in times) else max(times, default=0.0)

    while any(pending.values()):
        progressed = False
        for rank, acts in pending.items():
            while acts:
                subs = parts(acts[0])
                starts = []
                t = clock[rank]
                for sub in subs:  # the sub-actions of an overlapped pair run back to back
                    r = ready(sub)
                    if r is None:
                        break
                    t = max(t, r)
                    starts.append(t)
                    t += cost(sub)
                    _finish(done, sub, t)
                if len(starts) < len(subs):  # undo a partial pair: wait for its inputs
                    for sub in subs[: len(starts)]:
                        _unfinish(done, sub)
                    break
                busy[rank] += sum(cost(sub) for sub in subs)
                clock[rank] = t
                acts.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action lists deadlock")
    makespan = max(clock.values())
    work = max(busy.values())
    return {
        "makespan": makespan,
        "busy": work,
        "bubble": (makespan - work) / work,
        "busy_by_rank": busy,
    }


def _finish(done: dict, a: Any, t: float) -> None:
    s, kind, m = a.stage_index, a.computation_type.value, a.microbatch_index
    done[(s, kind, m)] = t
    if kind == "B":  # a full backward is the input and the weight gradient at once
        done[(s, "I", m)] = done[(s, "W", m)] = t


def _unfinish(done: dict, a: Any) -> None:
    s, kind, m = a.stage_index, a.computation_type.value, a.microbatch_index
    for k in (kind,) if kind != "B" else ("B", "I", "W"):
        done.pop((s, k, m), None)


def analytic_bubble(schedule: str, pp: int, virtual_stages: int, n_microbatches: int) -> float:
    """The textbook bubble (idle over useful time per rank) of ``schedule`` with equal
    forward, input-gradient and weight-gradient times (``UNIT_COST``): GPipe and 1F1B
    (p - 1)/m; interleaved 1F1B and breadth-first (p - 1)/(v m); zero-bubble H1 per chunk
    (p - 1)/(3 v m) (Qi et al.: (p - 1)(T_F + T_B - T_W) of idle time); ZB-V 0 ((p - 1)(T_F
    + T_B - 2 T_W)); DualPipe-V (p - 1)(F&B + B - 3W) / (6 m) per rank of 2 chunks, with
    F&B = F + B (no overlap of computation with communication on an ideal machine):
    (p - 1)/(3 m)."""
    p, v, m = pp, virtual_stages, n_microbatches
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m)
    if schedule == "zbv":
        return 0.0
    if schedule == "dualpipev":
        return (p - 1) / (3 * m)
    raise ValueError(f"unknown schedule {schedule!r}")


def forward_only(schedule: Any) -> None:
    """Make ``schedule`` run forwards only, in place (the evaluation schedule).

    ``eval()`` of torch's multi-stage schedules that run an action list still performs the
    list's backward actions on stages without backward; where two adjacent stages share a
    rank (the V placement of ``zbv`` and ``dualpipev``) the backward hand-off between them
    raises. The lowered list (compute and p2p actions) without its backward actions and
    backward p2p, overlapped forward-backward pairs reduced to their forward, is a valid
    forward-only list: the forwards and their sends and receives keep their order per rank,
    and forwards only wait on earlier forwards. Single-stage schedules skip backward
    themselves and are left as they are."""
    from torch.distributed.pipelining import schedules as S

    if not isinstance(schedule, S._PipelineScheduleRuntime):
        return
    dropped = {S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT, S.SEND_B, S.RECV_B,
               S.REDUCE_GRAD}  # fmt: skip

    def forwards(action: Any) -> list[Any]:
        if action.computation_type == S.OVERLAP_F_B and action.sub_actions is not None:
            return [a for a in action.sub_actions if a.computation_type == S.FORWARD]
        return [] if action.computation_type in dropped else [action]

    schedule.pipeline_order_with_comms = {
        rank: [f for a in actions for f in forwards(a)]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
