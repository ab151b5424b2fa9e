"""``moetrain plan`` against published runs: writes docs/data/plan_published.csv, the table of
docs/plan.md ("Against published runs"; tests/plan/test_plan.py checks the page against the
file).

    python tools/plan_published.py                  # plans every row, rewrites the CSV
    python tools/plan_published.py --print          # and prints the markdown table

Each row is a published figure beside what the plan gives for the same model, cluster and
(as near as moetrain can express it) layout, and their ratio, whatever it is. Where
moetrain refuses the published layout, the row says why (the trainer's message) and the
plan prices the layout ``moetrain plan --search`` finds fastest among the stated ones.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "docs" / "data" / "plan_published.csv"
FIELDS = [
    "run", "gpus", "gpu", "figure", "published", "planned", "ratio", "layout", "refused",
    "step_peak_gb", "start_up_gb", "memory_gb", "source", "overrides", "plan_wall_s",
    "plan_max_rss_mb", "cpus",
]  # fmt: skip


@dataclass
class Run:
    name: str
    config: str
    world: int
    gpu: str
    figure: str
    """"gpu_hours_per_T_tokens" or "tflops_per_gpu"."""
    published: float
    source: str
    published_layout: list[str]
    """The published layout as moetrain overrides (validated first)."""
    search_fixed: list[str] = field(default_factory=list)
    """If moetrain refuses the published layout: the keys to hold while searching."""


DEEPSEEK_V3_STAGES = "[" + ",".join(["1"] + ["2"] * 30 + ["0"]) + "]"
"""DeepSeek-V3's 61 layers in the 32 stages of PP16 x DualPipe-V's 2 per rank, as
Megatron-Core's DeepSeek-V3 recipe splits them ("Et|(tt|)*30mL"): the embedding and 1
layer, 30 stages of 2, and a last stage of the multi-token-prediction module and the output
head alone -- each of those costs about a layer or more (the head: 6 D V FLOPs per token,
1.4 times a layer's), so the V's rank 0, which holds the first and the last stage, carries
about what the others' 4 layers do."""

RUNS = [
    Run(
        "DeepSeek-V3 671B (published layout: PP16 DualPipe, EP64, ZeRO-1 DP, no TP)",
        "configs/deepseek_v3.yaml",
        2048,
        "h800",
        "gpu_hours_per_T_tokens",
        180_000.0,
        "DeepSeek-V3 technical report (arXiv:2412.19437): 2,048 H800, 180K GPU-hours per "
        "trillion tokens, fits 80 GB without TP",
        ["parallel.pp=16", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
         f"parallel.pp_stage_layers={DEEPSEEK_V3_STAGES}", "parallel.ep=64",
         "parallel.zero_stage=1", "parallel.tp=1", "model.mtp_depth=1",
         "train.global_batch_size=15360"],
        ["parallel.tp=1", "parallel.pp=1", "parallel.pp_stage_layers=null", "parallel.cp=1",
         "parallel.activation_checkpointing=full", "train.global_batch_size=16384"],
    ),
    Run(
        "Mixtral 8x7B (Megatron-Core, bf16)",
        "configs/mixtral_8x7b.yaml",
        64,
        "h100",
        "tflops_per_gpu",
        468.0,
        "Megatron-Core MoE documentation: 468 TFLOP/s per H100 for Mixtral 8x7B bf16 (MCore "
        "v0.9); priced here as PP4 x EP8 x DP16, TP1 (the layout is ours: the figure comes "
        "without one)",
        ["parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
         "parallel.ep=8", "parallel.tp=1", "parallel.sequence_parallel=false",
         "parallel.zero_stage=1", "train.global_batch_size=256"],
    ),
    Run(
        "Qwen3-30B-A3B (NeMo AutoModel, BF16: EP8, FSDP8, GBS 512, MBS 4)",
        "configs/qwen3_30b_a3b.yaml",
        8,
        "h100",
        "tflops_per_gpu",
        277.0,
        "NeMo AutoModel performance summary (DGX-H100, BF16): Qwen3 MoE 30B, 8 GPUs, 277 "
        "model TFLOP/s per GPU",
        ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.ep=8",
         "parallel.zero_stage=3", "train.global_batch_size=512", "train.micro_batch_size=4"],
    ),
]  # fmt: skip


def _figure(run: Run, plan) -> float:
    cfg = plan.cfg
    if run.figure == "tflops_per_gpu":
        return plan.tflops_per_gpu
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return plan.step_s * plan.dims.world_size / 3600 * 1e12 / tokens


def plan_row(run: Run) -> dict[str, str]:
    from moetrain.config import ConfigError, load_config
    from moetrain.plan import hardware, planner, search
    from moetrain.plan.report import layout_line
    from moetrain.train.engine import build_optimizers

    gpu = hardware.gpu(run.gpu)
    refused = ""
    try:
        cfg = load_config(REPO / run.config, run.published_layout)
        plan = planner.plan(cfg, run.world, build_optimizers, gpu=gpu)
    except ConfigError as exc:
        refused = str(exc)
        cfg = load_config(REPO / run.config, run.search_fixed)
        fixed = frozenset(o.split("=")[0] for o in run.search_fixed if o.startswith("parallel."))
        cands = search.search(cfg, run.world, build_optimizers, gpu, 8, gpu.memory_gb, "cuda",
                              fixed)  # fmt: skip
        plan = next(c.plan for c in cands if c.plan is not None)
    value = _figure(run, plan)
    overrides = _layout_overrides(plan.cfg)
    wall, rss = _time_plan(run, overrides)
    return {
        "run": run.name,
        "gpus": str(run.world),
        "gpu": run.gpu.upper(),
        "figure": run.figure,
        "published": f"{run.published:g}",
        "planned": f"{value:.4g}",
        "ratio": f"{value / run.published:.2f}",
        "layout": layout_line(plan),
        "refused": refused,
        "step_peak_gb": f"{plan.step_peak() / 1e9:.1f}",
        "start_up_gb": f"{plan.start_up / 1e9:.0f}",
        "memory_gb": f"{gpu.memory_gb:g}",
        "source": run.source,
        "overrides": " ".join(overrides),
        "plan_wall_s": f"{wall:.1f}",
        "plan_max_rss_mb": f"{rss:.0f}",
        "cpus": str(os.cpu_count()),
    }


def _layout_overrides(cfg) -> list[str]:
    """The planned layout as command-line overrides."""
    p = cfg.parallel
    keys = ("tp", "sequence_parallel", "cp", "pp", "pp_schedule", "pp_virtual_stages", "ep",
            "zero_stage", "activation_checkpointing")  # fmt: skip
    out = [f"parallel.{k}={str(getattr(p, k)).lower()}" for k in keys]
    if p.pp_stage_layers is not None:
        out.append(f"parallel.pp_stage_layers=[{','.join(map(str, p.pp_stage_layers))}]")
    if cfg.model.mtp_depth:
        out.append(f"model.mtp_depth={cfg.model.mtp_depth}")
    return out + [f"train.global_batch_size={cfg.train.global_batch_size}",
                  f"train.micro_batch_size={cfg.train.micro_batch_size}"]  # fmt: skip


def _time_plan(run: Run, overrides: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident memory (MB) of ``moetrain plan`` of the planned
    layout, in a process of its own."""
    cmd = [sys.executable, "-m", "moetrain", "plan", "--config", str(REPO / run.config),
           "--world", str(run.world), "--gpu", run.gpu, *overrides]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=False)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1e3  # ru_maxrss: KB on Linux


FIGURE_NAMES = {
    "gpu_hours_per_T_tokens": "GPU-hours per trillion tokens",
    "tflops_per_gpu": "model TFLOP/s per GPU",
}


def render(rows: list[dict[str, str]]) -> str:
    """The markdown table of docs/plan.md."""
    lines = [
        "| run | GPUs | figure | published | plan | plan / published | layout planned | "
        "step peak / GPU memory (GB) | start-up (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        refused = f" (published layout refused: {r['refused']})" if r["refused"] else ""
        layout = r["layout"] + refused
        lines.append(
            f"| {r['run']} | {r['gpus']} {r['gpu']} | {FIGURE_NAMES[r['figure']]} | "
            f"{float(r['published']):,.0f} | {float(r['planned']):,.0f} | {r['ratio']} | "
            f"{layout} | {r['step_peak_gb']} / {r['memory_gb']} | {r['start_up_gb']} |"
        )
    first = rows[0]
    lines += [
        "",
        f"`moetrain plan` of the first row's layout took {first['plan_wall_s']} s of wall time "
        f"and {first['plan_max_rss_mb']} MB of peak memory on a machine of {first['cpus']} "
        f"CPU cores (`tools/plan_published.py` times it in a process of its own):",
        "",
        "```bash",
        f"moetrain plan --config configs/deepseek_v3.yaml --world {first['gpus']} --gpu "
        f"{first['gpu'].lower()} {_quoted(first['overrides'])}",
        "```",
    ]
    return "\n".join(lines)


def _quoted(overrides: str) -> str:
    """The overrides for a shell: a list value quoted (brackets are glob characters)."""
    import shlex

    return " ".join(shlex.quote(o) for o in overrides.split())


def read_rows(path: Path = CSV) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def table_main(argv: list[str] | None, doc: str, csv_path: Path, fields: list[str],
               plan_rows: Callable[[], list[dict[str, str]]],
               render_rows: Callable[[list[dict[str, str]]], str]) -> int:
    """The command line of a tool that plans rows into a CSV a docs page renders (this one,
    ``plan_overlap.py``): ``--csv`` where to write them, ``--print`` the markdown too."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the markdown table")
    parser.add_argument("--csv", default=str(csv_path), help="where to write the rows")
    args = parser.parse_args(argv)
    rows = plan_rows()
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    if args.print:
        print(render_rows(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, __doc__, CSV, FIELDS, lambda: [plan_row(run) for run in RUNS],
                      render)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
