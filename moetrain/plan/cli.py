"""``moetrain plan``: what a layout costs at its world size, before anyone rents a GPU.

    moetrain plan --config configs/qwen3_30b_a3b.yaml --world 8 --gpu h100
    moetrain plan --config configs/deepseek_v3.yaml --world 2048 --gpu h800
    moetrain plan --config configs/mixtral_8x7b.yaml --world 64 --gpu h100 --search

Exit status: 0 when the plan fits (or no memory figure was given), 1 when it does not, 2 when
the layout is refused (the trainer's own message). docs/plan.md explains every figure.
"""

from __future__ import annotations

import argparse
import json
import sys

from moetrain.config import ConfigError, load_config
from moetrain.plan.build import BuildOptimizers


def _constants(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: {item!r} is written name=value")
        out[key] = float(value)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetrain plan",
        description="Per-rank memory, traffic and step time of a layout at any world size, "
        "from the real model and parallelize code on the meta device (docs/plan.md).",
    )
    p.add_argument("--config", help="YAML experiment file (see configs/)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--world", type=int, required=True, help="ranks of the job (GPUs)")
    p.add_argument("--gpu", default=None, help="price it on this GPU: h100, h200, h800, b200, a100")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory per GPU to fit (default: the GPU's)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a hardware constant (e.g. matmul_efficiency=0.5) or an "
                   "overlap (overlap_tp=0.5)")  # fmt: skip
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the run trains (default: cuda with --gpu, else cpu)")  # fmt: skip
    p.add_argument("--search", action="store_true", help="rank the layouts that fit")
    p.add_argument("--top", type=int, default=10, help="rows per section of --search")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None, build_optimizers: BuildOptimizers) -> int:
    args = parser().parse_args(argv)
    from moetrain.plan import hardware, planner, report, search

    try:
        cfg = load_config(args.config, args.overrides)
        consts = _constants(args.set)
        overlap = {
            k.removeprefix("overlap_"): v for k, v in consts.items() if k.startswith("overlap_")
        }
        gpu = None
        if args.gpu is not None:
            gpu = hardware.gpu(
                args.gpu,
                {
                    k: v
                    for k, v in consts.items()
                    if k not in overlap and not k.startswith("overlap_")
                },
            )
        elif args.search:
            raise ValueError("--search needs --gpu (it ranks layouts by estimated step time)")
        device = args.device or ("cuda" if gpu is not None else "cpu")
        memory = args.memory_gb if args.memory_gb is not None else (gpu.memory_gb if gpu else None)
        source = args.config or "defaults"
        if args.search:
            fixed = frozenset(
                o.split("=")[0].lstrip("-")
                for o in args.overrides
                if o.lstrip("-").startswith("parallel.")
            )
            cands = search.search(
                cfg, args.world, build_optimizers, gpu, args.gpus_per_node, memory, device, fixed
            )
            print(
                f"search: {source} at {args.world} ranks on {gpu.name} "
                f"({args.gpus_per_node} per node, {memory:g} GB)"
            )
            print(search.render(cands, memory, args.top))
            return (
                0 if any(c.plan is not None and c.plan.peak() <= memory * 1e9 for c in cands) else 1
            )
        plan = planner.plan(cfg, args.world, build_optimizers, device_type=device, gpu=gpu,
                            gpus_per_node=args.gpus_per_node, overlap=overlap)  # fmt: skip
    except (ConfigError, ValueError) as exc:
        print(f"moetrain: config error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(plan, memory), indent=1))
    else:
        print(report.render(plan, memory, source))
    return 0 if memory is None or plan.peak() <= memory * 1e9 else 1
