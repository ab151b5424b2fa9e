"""What ``moetrain plan`` prints: the layout, memory per distinct rank (each figure marked
exact or estimated), traffic per axis and link, the step estimate, the verdict and advice;
and the same as a JSON-ready dict."""

from __future__ import annotations

from typing import Any

from moetrain.plan.estimate import AFTER_PASSES
from moetrain.plan.planner import Plan, RankPlan

GB = 1e9


def layout_line(plan: Plan) -> str:
    d, p = plan.dims, plan.cfg.parallel
    parts = [f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} "
             f"x tp {d.tp}"]  # fmt: skip
    if d.tp > 1 and p.sequence_parallel:
        parts[0] += " (sequence parallel)"
    if d.ep > 1:
        parts.append(f"ep {d.ep}{' with expert tp' if p.expert_tp and d.tp > 1 else ''}")
    parts.append(f"ZeRO-{p.zero_stage if d.dp_cp > 1 else 0}")
    if d.pp > 1:
        parts.append(f"{p.pp_schedule} x {d.virtual_stages} chunks per rank")
        if p.pp_stage_layers is not None:
            parts.append(f"stages of {stage_counts(p.pp_stage_layers)} layers")
    parts.append(f"activation checkpointing {p.activation_checkpointing}")
    parts.append(f"{d.microbatches(plan.cfg)} micro-batches of {d.micro_batch_size(plan.cfg)}")
    return ", ".join(parts)


def stage_counts(counts: list[int]) -> str:
    """Layer counts per stage with repeats folded: [1, 2, 2, 2, 0] -> "1, 2 x 3, 0"."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}" if j - i == 1 else f"{counts[i]} x {j - i}")
        i = j
    return "[" + ", ".join(out) + "]"


def _rank_head(plan: Plan, r: RankPlan) -> str:
    """A rank's column: its stages and, under a pipeline, their transformer layers."""
    chunks = r.state.chunks
    head = f"rank {r.state.rank} (stages {','.join(str(c.stage) for c in chunks)}"
    if plan.dims.pp > 1:
        n = plan.cfg.model.n_layers
        layers = "+".join(str(sum(1 for x in c.layers if x.index < n)) for c in chunks)
        head += f": {layers} layers"
        if any(x.index >= n for c in chunks for x in c.layers):
            head += " + MTP"
    return head + ")"


def memory_rows(plan: Plan, r: RankPlan) -> list[tuple[str, str, float]]:
    """(what, exact|est., bytes) per line of a rank's memory."""
    s = r.state
    optim = ", ".join(sorted(s.optim_dtypes)) or "none"
    fl = " + ".join(
        f"{n} x {b / GB:.2f}" for n, b in zip(r.in_flight, r.per_microbatch, strict=True)
    )
    rows = [
        ("parameters (local shards)", "exact", s.params),
        ("gradients (end of backward)", "exact", s.grads),
        (f"optimizer states ({optim})", "exact", s.optim),
        ("master weights", "exact", s.masters),
        ("gathered parameters (FSDP2)", "exact" if s.gathered_exact else "est.", s.gathered),
        ("buffers", "exact", s.buffers),
        (f"activations ({fl} GB in flight)", "est.", r.activations + r.rope),
    ]
    if r.recompute:
        rows.append(("recomputation (one block, checkpointing)", "est.", r.recompute))
    if r.staging:
        where = "its memory" if plan.device_type == "cpu" else "pinned host memory, not summed"
        rows.append((f"checkpoint staging (train.checkpoint_async; {where})", "exact", r.staging))
    return rows


def render(plan: Plan, memory_gb: float | None, source: str = "") -> str:
    cfg, d = plan.cfg, plan.dims
    s0 = plan.ranks[0].state
    dtype = str(plan.dtype).removeprefix("torch.")
    where = f" on {plan.gpu.name} ({plan.gpus_per_node} per node)" if plan.gpu else ""
    moe = sum(1 for i in range(cfg.model.n_layers) if _is_moe(cfg, i))
    lines = [
        f"plan: {source or 'config'} at {d.world_size} ranks{where}, {dtype}",
        f"layout: {layout_line(plan)}",
        f"model: {s0.n_params / 1e9:.2f}B parameters ({s0.n_active / 1e9:.2f}B active per token), "
        f"{cfg.model.n_layers} layers ({moe} MoE), {cfg.data.seq_len} tokens per sequence, "
        f"{cfg.train.global_batch_size} sequences per step",
        "",
        "memory per rank (GB = 1e9 bytes)",
    ]
    heads = [_rank_head(plan, r) for r in plan.ranks]
    width = max(len(h) for h in heads) + 2
    label_w = max(len(w) for w, _, _ in memory_rows(plan, plan.ranks[0])) + 2
    label_w = max(label_w, 48)
    lines.append(" " * (label_w + 8) + "".join(h.rjust(width) for h in heads))
    table = [memory_rows(plan, r) for r in plan.ranks]
    for i, (what, kind, _) in enumerate(table[0]):
        vals = "".join(f"{t[i][2] / GB:.2f}".rjust(width) for t in table)
        lines.append(f"  {what.ljust(label_w)}{kind:>6}{vals}")
    lines.append(f"  {'= at the step peak'.ljust(label_w)}{'':>6}"
                 + "".join(f"{(r.steady + plan.staging_on_device(r)) / GB:.2f}".rjust(width)
                           for r in plan.ranks))  # fmt: skip
    lines.append(f"  {'start-up: local shards + one init block'.ljust(label_w)}{'exact':>6}"
                 + "".join(f"{plan.start_up_of(r) / GB:.2f}".rjust(width)
                           for r in plan.ranks))  # fmt: skip
    if plan.gpu is not None:
        lines.append(f"  {'runtime reserve (CUDA context, NCCL)'.ljust(label_w)}{'est.':>6}"
                     + f"{plan.gpu.runtime_reserve_gb:.2f}".rjust(width))  # fmt: skip
    peak = plan.peak()
    verdict = ""
    if memory_gb is not None:
        fits = peak <= memory_gb * GB
        verdict = (f": fits {memory_gb:g} GB" if fits
                   else f": DOES NOT FIT {memory_gb:g} GB")  # fmt: skip
    lines.append(f"  {'peak of the worst rank'.ljust(label_w)}{'':>6}"
                 + f"{peak / GB:.2f}".rjust(width) + verdict)  # fmt: skip
    worst = max(plan.ranks, key=lambda r: r.dropless_worst)
    if worst.dropless_worst:
        unlucky = plan.peak(worst) + worst.dropless_worst
        # Dropless EP: one MoE layer whose every token of the EP group picks this rank.
        lines.append(f"  {'+ dropless worst case (one layer, every token)'.ljust(label_w)}"
                     f"{'est.':>6}" + f"{worst.dropless_worst / GB:.2f}".rjust(width)
                     + f"  rank {worst.state.rank}: peak {unlucky / GB:.2f}")  # fmt: skip
    # One rank's traffic stands for the others': the busiest (the estimate's pace-setter),
    # else the first.
    shown = [r for r in plan.ranks if r.axes]
    if shown and any(r.estimate for r in shown):
        shown = [max((r for r in shown if r.estimate), key=lambda r: r.estimate.busy_s)]
    for r in shown[:1]:
        lines += ["", f"traffic per step, rank {r.state.rank}: bytes sent, link, seconds"]
        for a in r.axes:
            link = "NVLink" if a.nodes == 1 else f"network ({a.nodes} nodes)"
            t = r.estimate.comm_s.get(a.name, 0.0) if r.estimate else 0.0
            x = r.estimate.exposed_s.get(a.name, 0.0) if r.estimate else 0.0
            lines.append(f"  {a.name:4s} group of {a.group:<5d} {a.bytes / GB:10.2f} GB  "
                         f"{link:22s} {t:8.3f} s ({x:.3f} s exposed)")  # fmt: skip
    if plan.step_s is not None:
        # The step's longest rank (every rank's pipeline passes end together; its data-
        # parallel traffic and optimizer step come after them).
        worst = max((r for r in plan.ranks if r.estimate), key=lambda r: r.estimate.step_s)
        e = worst.estimate
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        per_mb = sum(v for k, v in e.exposed_s.items() if k not in AFTER_PASSES)
        dp = e.exposed_s.get("dp", 0.0) + e.exposed_s.get("edp", 0.0)
        dp += e.exposed_s.get("muon", 0.0)
        lines += [
            "",
            f"estimate on {e.gpu} (slowest rank {worst.state.rank}): step {e.step_s:.3f} s = "
            f"(compute {e.compute_s:.3f} s + exposed tp/cp/ep/pp {per_mb:.3f} s) x "
            f"(1 + bubble {e.bubble:.3f}) + exposed dp {dp:.3f} s + optimizer "
            f"{e.optimizer_s:.3f} s",
            *_muon_line(worst),
            f"  {plan.tflops_per_gpu:.0f} model TFLOP/s per GPU (MFU "
            f"{plan.tflops_per_gpu / plan.gpu.bf16_tflops:.1%} of {plan.gpu.bf16_tflops:g}), "
            f"{tokens / e.step_s / d.world_size:,.0f} tokens/s per GPU",
        ]
        lines += estimate_lines(e)
        estimated = [r for r in plan.ranks if r.estimate]
        if d.pp > 1 and len(estimated) > 1:  # unequal stages: the busiest sets the pace
            pace = max(estimated, key=lambda r: r.estimate.busy_s)
            b = pace.estimate
            lines.append(
                f"  pipeline passes {b.busy_s * (1 + b.bubble):.3f} s on every rank, paced by "
                f"the busiest, rank {pace.state.rank} ({b.busy_s:.3f} s busy, bubble "
                f"{b.bubble:.3f})"
            )
    tips = advice(plan, memory_gb)
    if tips:
        lines += ["", "advice:"] + [f"  - {t}" for t in tips]
    return "\n".join(lines)


def estimate_lines(e: Any) -> list[str]:
    """What the compute is made of (``moetrain.plan.estimate``): each part's seconds, the
    work and the rate it was priced at, each rate's source."""
    by_part: dict[str, list[str]] = {}
    for key, f in sorted(e.flops.items()):
        cls, dtype = key.split("/")
        part = {"experts": "expert GEMMs", "attention": "attention"}.get(cls, "other matmuls")
        by_part.setdefault(part, []).append(
            f"{f / 1e12:.2f} TFLOP {dtype} at {e.rates[key].value:.0f} TFLOP/s"
        )
    moved = e.bytes.get("activations", 0.0) + e.bytes.get("weights", 0.0)
    by_part["elementwise and copies"] = [f"{moved / GB:.0f} GB at {e.rates['copy'].value:.0f} "
                                         "GB/s"]  # fmt: skip
    out = [
        "  compute: "
        + "; ".join(
            f"{part} {e.parts.get(part, 0.0):.3f} s ({', '.join(by_part.get(part, ['-']))})"
            for part in e.parts
        )
        + f"; optimizer {e.optimizer_s:.3f} s ({e.bytes.get('optimizer', 0.0) / GB:.0f} GB)"
    ]
    out.append("  rates:")
    for key, r in sorted(e.rates.items()):
        out.append(f"    {key} {r.value:.0f} {'GB/s' if key == 'copy' else 'TFLOP/s'}: "
                   f"{r.source}")  # fmt: skip
    return out
def _muon_line(r: RankPlan) -> list[str]:
    """Muon's share of the step (``optim.name=muon``): what it sends to make matrices whole
    and its Newton-Schulz."""
    s = r.state
    if not s.muon_flops:
        return []
    return [
        f"  Muon: {s.muon_sent / 1e6:,.1f} MB sent (exact), {s.muon_flops / 1e9:,.1f} GFLOP "
        "of Newton-Schulz per step on this rank (exact), in the optimizer time"
    ]


def _is_moe(cfg: Any, i: int) -> bool:
    from moetrain.model.transformer import is_moe_layer

    return is_moe_layer(i, cfg.moe)


def advice(plan: Plan, memory_gb: float | None) -> list[str]:
    """What to change when the plan does not fit (empty when it does or no memory is set)."""
    if memory_gb is None or plan.peak() <= memory_gb * GB:
        return []
    cfg, d = plan.cfg, plan.dims
    p = cfg.parallel
    r = plan.worst
    s = r.state
    cap = memory_gb * GB
    out = []
    state = s.params + s.grads + s.optim + s.masters + s.gathered
    if r.steady > cap:
        if s.expert_elements and d.ep < cfg.moe.num_experts and state > r.activations:
            out.append(
                f"experts are {s.expert_elements * 16 / GB:.1f} GB of model state per rank and "
                "ZeRO does not shard them (they are replicated over the expert-data-parallel "
                f"ranks): raise parallel.ep (now {d.ep}) to spread them further"
            )
        if state > r.activations and p.zero_stage < 3 and d.dp_cp > 1:
            out.append(f"raise parallel.zero_stage (now {p.zero_stage}): 3 shards parameters, "
                       "gradients and optimizer states over the data-parallel ranks")  # fmt: skip
        if r.activations + r.recompute > state / 2:
            if p.activation_checkpointing != "full":
                out.append("parallel.activation_checkpointing=full keeps only each block's input")
            if d.micro_batch_size(cfg) > 1:
                out.append(f"lower train.micro_batch_size (now {d.micro_batch_size(cfg)})")
            if d.tp > 1 and not p.sequence_parallel:
                out.append("parallel.sequence_parallel=true splits the norms' activations by tp")
            if cfg.data.seq_len >= 8192 and d.cp == 1:
                out.append("parallel.cp splits long sequences over ranks")
        if d.pp == 1 and cfg.model.n_layers > 1:
            out.append("parallel.pp splits the layers (and their state) over stages")
    out.append("moetrain plan --search ranks the layouts that fit this cluster by step time")
    return out


def as_dict(plan: Plan, memory_gb: float | None) -> dict[str, Any]:
    """The plan as plain values (``moetrain plan --json``)."""
    ranks = []
    for r in plan.ranks:
        s = r.state
        ranks.append(
            {
                "rank": s.rank,
                "coords": s.coords,
                "stages": [c.stage for c in s.chunks],
                "layers": [[x.index for x in c.layers] for c in s.chunks],
                "params": s.params,
                "grads": s.grads,
                "optim": s.optim,
                "masters": s.masters,
                "gathered": s.gathered,
                "buffers": s.buffers,
                "activations": r.activations + r.rope,
                "recompute": r.recompute,
                "in_flight": r.in_flight,
                "steady": r.steady,
                "staging": r.staging,
                "start_up": plan.start_up_of(r),
                "traffic": {a.name: a.bytes for a in r.axes},
                "muon_sent": s.muon_sent,
                "muon_flops": s.muon_flops,
                "step_s": r.estimate.step_s if r.estimate else None,
                "step_parts_s": (
                    {**r.estimate.parts, "optimizer": r.estimate.optimizer_s}
                    if r.estimate
                    else None
                ),
            }
        )
    return {
        "world_size": plan.dims.world_size,
        "layout": layout_line(plan),
        "start_up": plan.start_up,
        "peak": plan.peak(),
        "memory_gb": memory_gb,
        "fits": None if memory_gb is None else plan.peak() <= memory_gb * GB,
        "step_s": plan.step_s,
        "tflops_per_gpu": plan.tflops_per_gpu,
        "ranks": ranks,
        "advice": advice(plan, memory_gb),
    }
