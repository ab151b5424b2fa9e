"""``moetrain plan --search``: the layouts of a cluster ranked by estimated step time, and why
the others do not fit.

Candidates: tp within a node (a divisor of gpus_per_node), cp for sequences of 8K tokens and
more, pp dividing the layers (equal stages; uneven ones, ``parallel.pp_stage_layers``, when
the command line fixes pp and the split), ep dividing the experts, ZeRO 1-3, activation
checkpointing none / selective / full; the config's micro-batch size and pipeline schedule
(1F1B where its own does not apply). Each is validated with the trainer's own checks (a
refusal keeps its message) and planned like ``moetrain plan``; builds are shared between
candidates that differ only in activation checkpointing.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from moetrain.config import ConfigError, JobConfig
from moetrain.model.precision import Precision
from moetrain.plan import planner
from moetrain.plan.build import BuildOptimizers
from moetrain.plan.hardware import GPU

GB = 1e9


@dataclass
class Candidate:
    overrides: dict[str, object]
    plan: planner.Plan | None = None
    refused: str = ""

    @property
    def label(self) -> str:
        return " ".join(f"{k.split('.')[-1]}={v}" for k, v in self.overrides.items())


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def candidates(
    cfg: JobConfig, world: int, gpus_per_node: int, fixed: frozenset[str] = frozenset()
) -> list[dict[str, object]]:
    """Every combination of the varied degrees (``fixed``: ``parallel.*`` keys kept as the
    config has them)."""
    m, mo = cfg.model, cfg.moe
    tps = [t for t in _divisors(gpus_per_node) if world % t == 0]
    cps = [c for c in (1, 2, 4, 8) if c == 1 or cfg.data.seq_len >= 8192]
    eps = _divisors(mo.num_experts) if mo.num_experts else [1]
    uneven = "parallel.pp_stage_layers" in fixed  # the split is the command line's
    out = []
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp):
            continue
        pps = [cfg.parallel.pp] if "parallel.pp" in fixed else _divisors(world // (tp * cp))
        for pp in pps:
            if world % (tp * cp * pp) or not uneven and (m.n_layers % pp or pp > m.n_layers):
                continue
            dp = world // (tp * cp * pp)
            for ep in eps:
                if (dp * cp) % ep:
                    continue
                for zero in (1, 2, 3):
                    for ac in ("none", "selective", "full"):
                        out.append(
                            {
                                "parallel.tp": tp,
                                "parallel.cp": cp,
                                "parallel.pp": pp,
                                "parallel.ep": ep,
                                "parallel.zero_stage": zero,
                                "parallel.activation_checkpointing": ac,
                            }
                        )
    p = cfg.parallel
    keep = {k: getattr(p, k.split(".")[1]) for k in fixed}
    seen, unique = set(), []
    for c in out:
        c = {k: v for k, v in c.items() if k not in keep}
        if tuple(sorted(c.items())) not in seen and _fits_fixed(c, keep, world):
            seen.add(tuple(sorted(c.items())))
            unique.append(c)
    return unique


def _fits_fixed(c: dict[str, object], keep: dict[str, object], world: int) -> bool:
    """Whether the varied degrees leave a data-parallel degree with the fixed ones."""
    degrees = {**keep, **c}
    prod = 1
    for key in ("parallel.tp", "parallel.cp", "parallel.pp"):
        prod *= int(degrees.get(key, 1))  # type: ignore[arg-type]
    return world % prod == 0


def _apply(cfg: JobConfig, overrides: dict[str, object], fixed: frozenset[str]) -> JobConfig:
    """The config with a candidate's degrees (sequence parallelism with any tp > 1 unless the
    command line fixed it; the data-parallel degree what the world leaves)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    if "parallel.dp_shard" not in fixed:
        p.dp_shard = -1
    for key, value in overrides.items():
        setattr(p, key.split(".")[1], value)
    if "parallel.sequence_parallel" not in fixed:
        p.sequence_parallel = p.tp > 1
    if p.pp == 1:
        p.pp_virtual_stages, p.pp_microbatches = 1, None
    elif p.pp_schedule in ("gpipe", "1f1b"):
        p.pp_virtual_stages = 1
    if "parallel.pp_stage_layers" not in fixed:
        p.pp_stage_layers = None  # equal stages: the candidates' pp divide the layers
    out.parallel.validate()
    return out


def _checked(c: JobConfig, world: int, device_type: str):
    """The trainer's checks; where the config's pipeline schedule does not fit the candidate's
    pp (its micro-batch rules), 1F1B is tried before refusing."""
    try:
        return planner.check_layout(c, world, device_type)
    except ConfigError:
        p = c.parallel
        if p.pp == 1 or p.pp_schedule in ("gpipe", "1f1b") or p.pp_stage_layers is not None:
            raise  # (a fixed split has its stage count: 1F1B's would not match it)
    c.parallel.pp_schedule, c.parallel.pp_virtual_stages = "1f1b", 1
    return planner.check_layout(c, world, device_type)


def search(
    cfg: JobConfig,
    world: int,
    build_optimizers: BuildOptimizers,
    gpu: GPU,
    gpus_per_node: int,
    memory_gb: float,
    device_type: str = "cuda",
    fixed: frozenset[str] = frozenset(),
) -> list[Candidate]:
    """Every candidate, planned or refused; those that fit first, fastest first. ``fixed``:
    the ``parallel.*`` keys not to vary (those the command line sets)."""
    from moetrain.plan.activations import shapes
    from moetrain.plan.estimate import estimate_ranks
    from moetrain.plan.stepmix import cached_census
    from moetrain.plan.traffic import traffic

    built: dict[tuple, list] = {}
    out = []
    for overrides in candidates(cfg, world, gpus_per_node, fixed):
        cand = Candidate(overrides)
        out.append(cand)
        try:
            c = _apply(cfg, overrides, fixed)
            dims = _checked(c, world, device_type)
        except ConfigError as exc:
            cand.refused = str(exc)
            continue
        if c.parallel.pp_schedule != cfg.parallel.pp_schedule and c.parallel.pp > 1:
            cand.overrides = {**overrides, "parallel.pp_schedule": c.parallel.pp_schedule}
        key = (dims, c.parallel.zero_stage, c.parallel.pp_schedule, c.parallel.sequence_parallel)
        if key not in built:
            built[key] = [
                planner.build_rank(c, dims, r, build_optimizers, device_type)
                for r in planner.distinct_ranks(dims)
            ]
        dtype = Precision.choose(c.train.dtype, device_type).dtype
        ranks = []
        for state in built[key]:
            rp = planner.plan_rank(c, dims, state, dtype, device_type)
            sh = shapes(c, dims, dtype, device_type)
            rp.axes = traffic(c, dims, state, sh, dtype, gpus_per_node)
            ranks.append(rp)
        mix = cached_census(c, dtype, build_optimizers)
        pairs = [(r.state, r.axes) for r in ranks]
        estimates = estimate_ranks(c, dims, pairs, gpu, mix, device_type=device_type)
        for rp, e in zip(ranks, estimates, strict=True):
            rp.estimate = e
        cand.plan = planner.Plan(c, dims, device_type, dtype, ranks, gpu, gpus_per_node)
    cap = memory_gb * GB

    def order(cand: Candidate) -> tuple:
        if cand.plan is None:
            return (2, 0.0)
        fits = cand.plan.peak() <= cap
        return (0 if fits else 1, cand.plan.step_s if fits else cand.plan.peak())

    return sorted(out, key=order)


def render(cands: list[Candidate], memory_gb: float, top: int = 10) -> str:
    """Ranked by the peak of the worst rank (its step's, or its start-up's where larger)."""
    cap = memory_gb * GB
    fit = [c for c in cands if c.plan is not None and c.plan.peak() <= cap]
    over = [c for c in cands if c.plan is not None and c.plan.peak() > cap]
    refused = [c for c in cands if c.plan is None]
    lines = [f"{len(cands)} layouts: {len(fit)} fit {memory_gb:g} GB, "
             f"{len(over)} do not, {len(refused)} refused by validation", ""]  # fmt: skip
    if fit:
        lines.append("fastest that fit (estimated):")
        lines.append(f"  {'step s':>8} {'TFLOP/s':>8} {'peak GB':>8}  layout")
        for c in fit[:top]:
            p = c.plan
            lines.append(
                f"  {p.step_s:8.3f} {p.tflops_per_gpu:8.0f} {p.peak() / GB:8.1f}  {c.label}"
            )
    if over:
        lines += ["", "closest that do not fit (peak GB, and what fills it):"]
        for c in over[:top]:
            p = c.plan
            r = p.worst
            s = r.state
            state = s.params + s.grads + s.optim + s.masters + s.gathered
            lines.append(f"  {p.peak() / GB:8.1f}  {c.label}: model state "
                         f"{state / GB:.1f} GB, activations "
                         f"{(r.activations + r.recompute) / GB:.1f} GB")  # fmt: skip
    if refused:
        reasons: dict[str, int] = {}
        for c in refused:
            reasons[c.refused] = reasons.get(c.refused, 0) + 1
        lines += ["", "refused by validation (the trainer's message, how many layouts):"]
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {n:4d} x {reason}")
    return "\n".join(lines)
