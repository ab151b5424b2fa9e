"""``moetrain plan`` of two published MoE runs with and without hiding the expert all-to-all:
writes docs/data/plan_overlap.csv, the table of docs/plan.md ("Hiding the expert
all-to-all"; tests/plan/test_plan.py checks the page against the file).

    python tools/plan_overlap.py                  # plans every row, rewrites the CSV
    python tools/plan_overlap.py --print          # and prints the markdown table

Each run is planned in one layout of ours (its micro-batches of 2 or more sequences, which
``parallel.ep_overlap=halves`` needs) two ways: the plain schedule
(``parallel.ep_overlap=none``: the all-to-all exposed, but for the trip the shared experts
run beside where the model has them) and the other half of the micro-batch computed while
it travels (``parallel.ep_overlap=halves``). Each row: the
plan's step time, its expert all-to-all time and how much of it is exposed, and the model
TFLOP/s per GPU beside the published figure for the same model and cluster. AdamW's moments
are bf16 (``optim.moments_dtype``) so that each layout's step fits the H100's 80 GB.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_published  # noqa: E402  (the table tools' command line and CSV reading)

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "docs" / "data" / "plan_overlap.csv"
FIELDS = [
    "run", "gpus", "gpu", "schedule", "step_s", "ep_s", "ep_exposed_s", "tflops_per_gpu",
    "published", "layout", "step_peak_gb", "memory_gb", "source", "overrides",
]  # fmt: skip

SCHEDULES = {
    "plain": ["parallel.ep_overlap=none", "parallel.overlap_shared_experts=false"],
    "halves": ["parallel.ep_overlap=halves", "parallel.overlap_shared_experts=false"],
}
"""The schedules compared, as overrides."""


@dataclass
class Run:
    name: str
    config: str
    world: int
    gpu: str
    published: float
    """Model TFLOP/s per GPU."""
    source: str
    layout: list[str]
    """The layout planned, as moetrain overrides."""


DEEPSEEK_V3_STAGES = "[" + ",".join(["3"] + ["4"] * 14 + ["2"]) + "]"
"""DeepSeek-V3's 61 layers in PP8's 16 interleaved stages: the first (with the embedding)
and the last (with the output head) lighter."""

RUNS = [
    Run(
        "DeepSeek-V3 671B",
        "configs/deepseek_v3.yaml",
        256,
        "h100",
        250.0,
        "NeMo AutoModel performance summary (H100, BF16, DeepEP, a forced-balanced gate): "
        "DeepSeek-V3 on 256 GPUs, 250 model TFLOP/s per GPU; the layout planned is ours",
        ["parallel.pp=8", "parallel.pp_schedule=interleaved_1f1b",
         "parallel.pp_virtual_stages=2", f"parallel.pp_stage_layers={DEEPSEEK_V3_STAGES}",
         "parallel.ep=32",
         "parallel.zero_stage=1", "parallel.tp=1", "parallel.sequence_parallel=false",
         "parallel.activation_checkpointing=full", "model.mtp_depth=0",
         "moe.token_group_seqs=1", "optim.moments_dtype=bf16", "train.global_batch_size=1024",
         "train.micro_batch_size=2"],
    ),
    Run(
        "Qwen3-30B-A3B",
        "configs/qwen3_30b_a3b.yaml",
        8,
        "h100",
        277.0,
        "NeMo AutoModel performance summary (DGX-H100, BF16): Qwen3 MoE 30B, 8 GPUs, EP8, "
        "FSDP8, GBS 512, MBS 4, 277 model TFLOP/s per GPU; planned in that layout",
        ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.ep=8",
         "parallel.zero_stage=3", "parallel.activation_checkpointing=full",
         "moe.token_group_seqs=1", "optim.moments_dtype=bf16", "train.global_batch_size=512",
         "train.micro_batch_size=4"],
    ),
]  # fmt: skip


def plan_rows(run: Run) -> list[dict[str, str]]:
    """The run planned under each schedule that applies to it (``SCHEDULES``)."""
    from moetrain.config import load_config
    from moetrain.plan import hardware, planner
    from moetrain.plan.report import layout_line
    from moetrain.train.engine import build_optimizers

    gpu = hardware.gpu(run.gpu)
    rows = []
    for schedule, overrides in SCHEDULES.items():
        cfg = load_config(REPO / run.config, [*run.layout, *overrides])
        plan = planner.plan(cfg, run.world, build_optimizers, gpu=gpu)
        slowest = max(plan.ranks, key=lambda r: r.estimate.step_s).estimate
        rows.append({
            "run": run.name,
            "gpus": str(run.world),
            "gpu": run.gpu.upper(),
            "schedule": schedule,
            "step_s": f"{plan.step_s:.3f}",
            "ep_s": f"{slowest.comm_s.get('ep', 0.0):.3f}",
            "ep_exposed_s": f"{slowest.exposed_s.get('ep', 0.0):.3f}",
            "tflops_per_gpu": f"{plan.tflops_per_gpu:.0f}",
            "published": f"{run.published:g}",
            "layout": layout_line(plan),
            "step_peak_gb": f"{plan.step_peak() / 1e9:.1f}",
            "memory_gb": f"{gpu.memory_gb:g}",
            "source": run.source,
            "overrides": " ".join([*run.layout, *overrides]),
        })  # fmt: skip
    return rows


def render(rows: list[dict[str, str]]) -> str:
    """The markdown table of docs/plan.md, then each run's layout."""
    lines = [
        "| run | GPUs | schedule | step (s) | expert all-to-all (s) | of it exposed | "
        "model TFLOP/s per GPU | published |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ep, exposed = float(r["ep_s"]), float(r["ep_exposed_s"])
        share = f"{exposed:.3f} s ({exposed / ep:.0%})" if ep else "-"
        lines.append(
            f"| {r['run']} | {r['gpus']} {r['gpu']} | {r['schedule']} | {float(r['step_s']):.2f} "
            f"| {ep:.3f} | {share} | {r['tflops_per_gpu']} | {float(r['published']):,.0f} |"
        )
    lines.append("")
    seen = set()
    for r in rows:
        if r["run"] not in seen:
            seen.add(r["run"])
            lines.append(f"- {r['run']}: {r['layout']}; step peak {r['step_peak_gb']} of "
                         f"{r['memory_gb']} GB. Published: {r['source']}.")  # fmt: skip
    return "\n".join(lines)


def read_rows(path: Path = CSV) -> list[dict[str, str]]:
    return plan_published.read_rows(path)


def main(argv: list[str] | None = None) -> int:
    return plan_published.table_main(
        argv, __doc__, CSV, FIELDS, lambda: [row for run in RUNS for row in plan_rows(run)],
        render)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
