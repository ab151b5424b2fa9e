"""The plan's step estimate against the GPU run it can be checked on: docs/data/plan_check.csv.

    python tools/plan_check.py              # docs/data/plan_check.csv from the kept censuses
    python tools/plan_check.py --check      # exit 1 when docs/data/plan_check.csv is not this
    python tools/plan_check.py --print      # the tables docs/plan.md shows
    python tools/plan_check.py --census     # census this tree's step again first (as the
                                            # measured code while its experts are fp32, else
                                            # as "bf16 experts")

The censuses (``moetrain.plan.stepmix.census_step`` of configs/gpu_1b.yaml's proxy, bf16)
are kept in docs/data/plan_census.json, each with the commit whose code it counted:

- ``measured code``: the code of the measured run (commit 96e2259, unchanged in the model
  and kernels since): the routed experts' GEMMs in fp32 under bf16 autocast;
- ``bf16 experts``: the code since the compute-dtype policy (``moetrain.model.precision``):
  the expert GEMMs' operands in bf16, each weight rounded once per micro-batch, the router
  gates fp32 forward and backward: the figure the next GPU run checks.

Each is priced by ``moetrain plan`` (h100, one rank, the measured rates of
kernels/measured.py) and set beside the measured step of docs/data/benchmarks.csv (the newest
``e2e gpu_1b`` step row of the torch path, eager) and the measured profile's breakdown
(docs/data/profiles/, read by ``tools/bench_e2e.breakdown``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

CONFIG = os.path.join(bc.REPO, "configs", "gpu_1b.yaml")
CENSUS = os.path.join(bc.REPO, "docs", "data", "plan_census.json")
OUT = os.path.join(bc.REPO, "docs", "data", "plan_check.csv")
PROFILE = os.path.join(bc.REPO, "docs", "data", "profiles", "e2e_profile_torch_eager_96e2259.txt")
PROFILE_STEPS = 3  # tools/bench_e2e.py --profile-steps of that run
MEASURED = ("e2e", "gpu_1b/b16xs1024", "step", "torch/eager")
VARIANTS = ("measured code", "bf16 experts")
PARTS = ("expert GEMMs", "attention", "other matmuls", "elementwise and copies", "optimizer")
FIELDS = ["variant", "commit", "what", "planned_ms", *[p.replace(" ", "_") + "_ms" for p in PARTS],
          "measured_ms", "planned_over_measured", "measured_source"]  # fmt: skip


def census() -> dict:
    """Census this tree's step of configs/gpu_1b.yaml's proxy (bf16): the "bf16 experts"
    entry, and the "measured code" entry too while the tree's expert GEMMs run in fp32 (as
    the measured commit's did)."""
    import torch

    from moetrain.config import load_config
    from moetrain.plan.stepmix import census_step
    from moetrain.train.engine import build_optimizers

    cfg = load_config(CONFIG, ["model.vocab_size=4096"])
    commit = bc.git_head(bc.REPO) or "unknown"
    mix = json.loads(census_step(cfg, torch.bfloat16, build_optimizers).to_json())
    if set(mix["flops"]["experts"]) == {"float32"}:
        return {"measured code": {"commit": commit, "what": "the code as it is (fp32 expert "
                                  "GEMMs)", "mix": mix}}  # fmt: skip
    return {"bf16 experts": {"commit": commit, "what": "the code with the compute-dtype policy "
                             "(moetrain.model.precision): expert GEMMs on bf16 operands",
                             "mix": mix}}  # fmt: skip


def measured_step() -> dict:
    """The newest measured step of configs/gpu_1b.yaml on the torch path, eager."""
    bench, case, op, impl = MEASURED
    rows = [r for r in bc.read_rows(bc.DEFAULT_CSV) if (r["benchmark"], r["case"], r["op"],
            r["impl"]) == MEASURED and r["status"] == "ok" and r["ms"]]  # fmt: skip
    r = max(rows, key=lambda r: r["timestamp"])
    source = (f"docs/data/benchmarks.csv {r['timestamp']} {r['device']}: {bench} {case} {op} "
              f"{impl} (commit {r['commit']})")  # fmt: skip
    return {"ms": float(r["ms"]), "source": source}


def profile_breakdown() -> dict[str, float]:
    """ms per step of each part in the measured profile (tools/bench_e2e.breakdown)."""
    import bench_e2e

    with open(PROFILE) as f:
        return bench_e2e.breakdown(f.read(), PROFILE_STEPS, fp32_matmuls="expert GEMMs")


def rows(censuses: dict) -> list[dict]:
    from moetrain.config import load_config
    from moetrain.plan import hardware, planner
    from moetrain.plan.stepmix import StepMix
    from moetrain.train.engine import build_optimizers

    cfg = load_config(CONFIG, ["model.vocab_size=4096"])
    meas = measured_step()
    out = []
    for name in VARIANTS:
        c = censuses[name]
        mix = StepMix(**c["mix"])
        plan = planner.plan(cfg, 1, build_optimizers, gpu=hardware.gpu("h100"), mix=mix)
        e = plan.ranks[0].estimate
        parts = {**e.parts, "optimizer": e.optimizer_s}
        row = {"variant": name, "commit": c["commit"], "what": c["what"],
               "planned_ms": f"{e.step_s * 1e3:.1f}"}  # fmt: skip
        for p in PARTS:
            row[p.replace(" ", "_") + "_ms"] = f"{parts[p] * 1e3:.1f}"
        if name == "measured code":
            row["measured_ms"] = f"{meas['ms']:.1f}"
            row["planned_over_measured"] = f"{e.step_s * 1e3 / meas['ms']:.3f}"
            row["measured_source"] = meas["source"]
        else:
            row["measured_ms"] = row["planned_over_measured"] = ""
            row["measured_source"] = "the next GPU run (tools/bench_e2e.py)"
        out.append(row)
    prof = profile_breakdown()
    row = {"variant": "measured profile", "commit": "96e2259", "what": "torch.profiler, 3 "
           "steps of the torch/eager run (device time)", "planned_ms": ""}  # fmt: skip
    for p in PARTS:
        row[p.replace(" ", "_") + "_ms"] = f"{prof.get(p, 0.0):.1f}"
    row["measured_ms"] = f"{prof['device total']:.1f}"
    row["planned_over_measured"] = ""
    row["measured_source"] = ("docs/data/profiles/e2e_profile_torch_eager_96e2259.txt (unlisted "
                              f"kernels: {prof['unlisted']:.1f} ms)")  # fmt: skip
    out.append(row)
    return out


def to_csv(table: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


def read_rows(path: str = OUT) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def render_rates() -> str:
    """The rates configs/gpu_1b.yaml is priced at on an H100, with their sources."""
    from moetrain.config import load_config
    from moetrain.parallel.dims import ParallelDims
    from moetrain.plan import hardware
    from moetrain.plan.estimate import moe_shape

    cfg = load_config(CONFIG, ["model.vocab_size=4096"])
    dims = ParallelDims.from_config(cfg.parallel, 1).validate(cfg)
    table = hardware.rates(hardware.gpu("h100"), moe_shape(cfg, dims), cfg.moe.kernels)
    lines = ["| work | rate on an H100 | source |", "|---|---|---|"]
    for key in ("experts/bfloat16", "experts/float32", "matmul/bfloat16", "attention/bfloat16",
                "copy"):  # fmt: skip
        r = table[key]
        unit = "GB/s" if key == "copy" else "TFLOP/s"
        lines.append(f"| {key} | {r.value:.1f} {unit} | {r.source} |")
    return "\n".join(lines) + "\n"


def render(table: list[dict]) -> str:
    """The table docs/plan.md shows (tests/plan/test_plan_check.py holds it to the file)."""
    head = ["step of configs/gpu_1b.yaml on one H100 (ms)", *PARTS, "step", "measured step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = [r["variant"], *[r[p.replace(" ", "_") + "_ms"] for p in PARTS]]
        cells += [r["planned_ms"] or "-", r["measured_ms"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--census", action="store_true", help="census this tree's step first")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--print", action="store_true", help="print the docs table")
    args = parser.parse_args(argv)
    if args.census:
        with open(CENSUS) as f:
            kept = json.load(f)
        fresh = census()  # this tree's entry; the other is kept as it was counted
        print(
            f"census of this tree: {', '.join(fresh)}; kept: "
            f"{', '.join(k for k in kept if k not in fresh)}"
        )
        fresh = {**kept, **fresh}
        with open(CENSUS, "w") as f:
            json.dump(fresh, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {CENSUS}")
    with open(CENSUS) as f:
        table = rows(json.load(f))
    text = to_csv(table)
    if args.check:
        with open(OUT) as f:
            if f.read() != text:
                print(f"{OUT} is not what tools/plan_check.py computes: run it again")
                return 1
        print(f"{OUT} is current")
    elif not args.print:
        with open(OUT, "w") as f:
            f.write(text)
        print(f"wrote {OUT}")
    if args.print:
        print(render(table) + "\n" + render_rates(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
