"""Write kernels/measured.py, the measured kernel table, from docs/data/benchmarks.csv.

    python tools/kernel_table.py            # regenerate kernels/measured.py
    python tools/kernel_table.py --check    # exit 1 when the committed file is not this
    python tools/kernel_table.py --print    # the choices as docs/kernels.md shows them

``moe.kernels: auto`` picks each MoE op's implementation from the table's ``CHOICES``
(``moetrain.kernels.selection``), and ``moetrain plan`` prices GEMMs and copies from its
``RATES`` (``moetrain.plan.hardware``). Nothing in it is typed by hand: per GPU
architecture, op and measured shape class (an anchor model of the benchmarks), the figures
of the newest run that measured both implementations:

- grouped GEMM forward, dgrad, wgrad (``grouped_gemm`` rows, Triton vs ``torch._grouped_mm``,
  up and down projections, uniform and Zipf routing together), the router (``router``
  rows, fwd+bwd: what a training step runs), permute and unpermute (``permute`` rows,
  fwd+bwd). Speed-up = summed torch ms / summed Triton ms over the class's rows; Triton is
  picked where it is above 1. The gathered GEMM has no benchmark yet: no row, no choice.
- the rates ``moetrain plan`` reads: each GEMM implementation's TFLOP/s per class and op
  (summed FLOPs / summed ms), the dense matmul of the same FLOPs, the dense 8192^3 ceiling
  and the copy bandwidth measured in the same runs.

Rows with a status other than ``ok`` are left out. The architecture of a row comes from its
device name (``ARCH``); a device not named there is skipped with a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

OUT = os.path.join(bc.REPO, "kernels", "measured.py")

# Device names as torch reports them -> compute capability (NVIDIA's CUDA GPU table).
ARCH = {
    "H100": "sm_90", "H200": "sm_90", "H800": "sm_90", "GH200": "sm_90", "H20": "sm_90",
    "B200": "sm_100", "B100": "sm_100", "GB200": "sm_100", "B300": "sm_103",
    "A100": "sm_80", "A800": "sm_80", "A30": "sm_80", "A10": "sm_86", "A40": "sm_86",
    "L40": "sm_89", "L4": "sm_89", "RTX 4090": "sm_89", "RTX 5090": "sm_120",
}  # fmt: skip

# The shape classes: the benchmarks' anchor models (tools/bench_common.ANCHOR_SHAPES, the
# routers of tools/bench_router.ROUTERS). Features are what the MoE layer knows at its call.
ROUTERS = {  # tools/bench_router.ROUTERS without importing torch-heavy code twice
    "mixtral": (8, "softmax"),
    "qwen3-30b-a3b": (128, "softmax"),
    "deepseek-v3": (256, "sigmoid"),
}

# op of the table -> (benchmark, op rows, torch's impl name)
OPS = {
    "grouped_mm_fwd": ("grouped_gemm", "fwd", "torch_gmm"),
    "grouped_mm_dgrad": ("grouped_gemm", "dgrad", "torch_gmm"),
    "grouped_mm_wgrad": ("grouped_gemm", "wgrad", "torch_gmm"),
    "route": ("router", "fwd+bwd", "torch"),
    "permute": ("permute", "permute_fwd+bwd", "torch"),
    "unpermute": ("permute", "unpermute_fwd+bwd", "torch"),
}


def arch_of(device: str) -> str | None:
    """The compute capability of a device name ("NVIDIA H100 80GB HBM3" -> "sm_90")."""
    words = device.replace("NVIDIA", "").upper()
    for name in sorted(ARCH, key=len, reverse=True):  # "GH200" before "H200"
        if name.upper() in words.split() or f" {name.upper()} " in f" {words} ":
            return ARCH[name]
    return None


def _tokens(case: str) -> int | None:
    part = next((p for p in case.split("/") if p.startswith("T") and p[1:].isdigit()), None)
    return None if part is None else int(part[1:])


def features(benchmark: str, case: str) -> dict[str, float] | None:
    """The shape class of a row: the anchor model's dimensions at the row's token count."""
    name, tokens = case.split("/")[0], _tokens(case)
    if tokens is None:  # the copy-bandwidth rows
        return None
    if benchmark == "router":
        if name not in ROUTERS:
            return None
        experts, _ = ROUTERS[name]
        return {"experts": experts, "tokens": tokens}
    if name not in bc.ANCHOR_SHAPES:
        return None
    experts, dim, ffn, top_k = bc.ANCHOR_SHAPES[name]
    if benchmark == "grouped_gemm":
        return {"experts": experts, "dim": dim, "ffn": ffn, "rows_per_expert": tokens * top_k
                // experts}  # fmt: skip
    return {"dim": dim, "top_k": top_k, "tokens": tokens}  # permute


def _fmt_rows(rows: list[dict]) -> str:
    """A set of rows named compactly: '<timestamp> <device>: <benchmark> <cases> <routings>
    <ops> <impls> (n rows)'."""

    def union(key: str) -> str:
        vals = sorted({r[key] for r in rows})
        if len(vals) == 1:
            return vals[0]
        heads = {v.rsplit("/", 1)[0] for v in vals}
        if key == "case" and len(heads) == 1 and all("/" in v for v in vals):
            return f"{heads.pop()}/{{{','.join(v.rsplit('/', 1)[1] for v in vals)}}}"
        return "{" + ",".join(vals) + "}"

    stamps = sorted({r["timestamp"] for r in rows})
    return (f"docs/data/benchmarks.csv {stamps[-1]} {rows[0]['device']}: {union('benchmark')} "
            f"{union('case')} {union('routing')} {union('op')} {union('impl')} "
            f"({len(rows)} rows)")  # fmt: skip


def _newest(rows: list[dict]) -> list[dict]:
    """The rows of the newest timestamp among ``rows``."""
    last = max(r["timestamp"] for r in rows)
    return [r for r in rows if r["timestamp"] == last]


def _ok(r: dict) -> bool:
    return r["status"] == "ok"


def _timed(r: dict) -> bool:
    return r["ms"] not in ("", "nan")


def build(rows: list[dict]) -> dict:
    """CHOICES, RATES and RUNS from the rows of a results CSV."""
    by_arch: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        arch = arch_of(r["device"])
        if arch is None:
            if r["device"] and not r["device"].startswith("cpu"):
                print(f"WARNING: no architecture known for {r['device']!r}: rows skipped")
            continue
        by_arch[arch].append(r)
    choices: list[dict] = []
    rates: list[dict] = []
    runs: dict[str, str] = {}
    for arch in sorted(by_arch):
        arch_rows = [r for r in by_arch[arch] if _ok(r)]
        for op, (bench, row_op, torch_impl) in OPS.items():
            choices += _choices(arch, op, arch_rows, bench, row_op, torch_impl)
        rates += _rates(arch, arch_rows)
        runs[arch] = "; ".join(sorted({f"{r['device']}, torch {r['torch']}, triton "
                                        f"{r['triton']}, commit {r['commit']}"
                                        for r in arch_rows}))  # fmt: skip
    return {"CHOICES": choices, "RATES": rates, "RUNS": runs}


def _class_of(bench: str, case: str) -> str:
    """The shape class a row belongs to: the GEMM's model and token count (up and down
    together), the router's or permute's case."""
    return case.rsplit("/", 1)[0] if bench == "grouped_gemm" else case


def _choices(arch: str, op: str, rows: list[dict], bench: str, row_op: str, torch_impl: str):
    out = []
    for cls in sorted({_class_of(bench, r["case"]) for r in rows if r["benchmark"] == bench}):
        feats = features(bench, cls + ("/up" if bench == "grouped_gemm" else ""))
        if feats is None:
            continue
        mine = [r for r in rows if r["benchmark"] == bench and r["op"] == row_op
                and _class_of(bench, r["case"]) == cls
                and r["impl"] in ("triton", torch_impl) and _timed(r)]  # fmt: skip
        if not {r["impl"] for r in mine} >= {"triton", torch_impl}:
            continue
        mine = _newest(mine)
        ms = {impl: sum(float(r["ms"]) for r in mine if r["impl"] == impl)
              for impl in ("triton", torch_impl)}  # fmt: skip
        if not (ms["triton"] > 0 and ms[torch_impl] > 0):
            continue
        speedup = ms[torch_impl] / ms["triton"]
        out.append({
            "op": op, "arch": arch, "case": cls.split("/")[0] if bench != "router" else cls,
            "features": feats, "score_func": mine[0]["routing"] if bench == "router" else None,
            "dtype": mine[0]["dtype"], "triton_ms": round(ms["triton"], 4),
            "torch_ms": round(ms[torch_impl], 4), "speedup": round(speedup, 3),
            "pick": "triton" if speedup > 1 else "torch", "rows": _fmt_rows(mine),
        })  # fmt: skip
    return out


def _rates(arch: str, rows: list[dict]) -> list[dict]:
    """TFLOP/s per (class, op, GEMM implementation), dense matmuls, copy GB/s."""
    out = []
    gemm = [r for r in rows if r["benchmark"] == "grouped_gemm" and r["tflops"] and _timed(r)]
    for name in sorted({r["case"].split("/")[0] for r in gemm}):
        for impl, key in (("triton", "triton"), ("torch_gmm", "torch"), ("dense", "dense")):
            for op in ("fwd", "dgrad", "wgrad"):
                mine = [r for r in gemm if r["case"].startswith(name + "/") and r["impl"] == impl
                        and r["op"] == op]  # fmt: skip
                if not mine:
                    continue
                mine = _newest(mine)
                ms = sum(float(r["ms"]) for r in mine)
                flops = sum(float(r["ms"]) * float(r["tflops"]) for r in mine)
                kind = "dense" if key == "dense" else "grouped_mm"  # dense: timed once (fwd)
                out.append({"arch": arch, "kind": kind, "impl": key, "case": name, "op": op,
                            "features": features("grouped_gemm", mine[0]["case"]),
                            "tflops": round(flops / ms, 1), "rows": _fmt_rows(mine)})  # fmt: skip
    ceiling = [r for r in rows if r["op"] == "dense_ceiling" and r["tflops"]]
    if ceiling:
        mine = _newest(ceiling)
        out.append({"arch": arch, "kind": "dense", "impl": "dense", "case": "8192^3", "op": "fwd",
                    "features": None, "tflops": round(max(float(r["tflops"]) for r in mine), 1),
                    "rows": _fmt_rows(mine)})  # fmt: skip
    copy = [r for r in rows if r["impl"] == "memcpy" and r["gbs"]]
    if copy:
        mine = _newest(copy)
        out.append({"arch": arch, "kind": "copy", "impl": "memcpy", "case": "copy", "op": "copy",
                    "features": None, "gbs": round(max(float(r["gbs"]) for r in mine), 1),
                    "rows": _fmt_rows(mine)})  # fmt: skip
    return out


HEADER = '''"""Measured kernel figures per GPU architecture: GENERATED by tools/kernel_table.py from
docs/data/benchmarks.csv. Do not edit: run the tool (tests/tools/test_kernel_table.py fails when
this file is not what it writes).

CHOICES: per op, architecture and measured shape class, the class's features, the summed
milliseconds of Triton and of torch over its rows, the speed-up of Triton (torch ms /
Triton ms), the implementation picked (Triton where the speed-up is above 1) and the rows it
comes from. ``moe.kernels: auto`` takes, per op, the pick of the class nearest to the
layer's shape (``moetrain.kernels.selection``).

RATES: per architecture, each GEMM implementation's TFLOP/s per class and op, the dense
matmuls of the same FLOPs, the dense 8192^3 ceiling and the copy bandwidth: what ``moetrain
plan`` prices a step with (``moetrain.plan.hardware``).

RUNS: the runs the rows come from.
"""

# ruff: noqa: E501
# fmt: off
'''


def _record(d: dict) -> str:
    return "    {" + ", ".join(f"{k!r}: {v!r}" for k, v in d.items()) + "},"


def render(tables: dict) -> str:
    body = [HEADER]
    for name in ("CHOICES", "RATES"):
        body.append(f"{name} = [")
        body += [_record(d) for d in tables[name]]
        body.append("]\n")
    body.append("RUNS = {")
    body += [f"    {k!r}: {v!r}," for k, v in sorted(tables["RUNS"].items())]
    body.append("}")
    return "\n".join(body) + "\n"


OP_NAMES = {"grouped_mm_fwd": "grouped GEMM forward", "grouped_mm_dgrad": "grouped GEMM dgrad",
            "grouped_mm_wgrad": "grouped GEMM wgrad", "route": "router (fwd+bwd)",
            "permute": "permute (fwd+bwd)", "unpermute": "unpermute (fwd+bwd)"}  # fmt: skip


def render_choices(choices: list[dict]) -> str:
    """The measured choices as docs/kernels.md shows them (tests hold the page to it)."""
    lines = ["| arch | op | shape class | dtype | Triton ms | torch ms | Triton speed-up | auto "
             "takes |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in choices:
        lines.append(f"| {c['arch']} | {OP_NAMES[c['op']]} | {c['case']}"
                     f"{' ' + c['score_func'] if c['score_func'] else ''} | {c['dtype']} | "
                     f"{c['triton_ms']:g} | {c['torch_ms']:g} | {c['speedup']:.2f}x | "
                     f"{c['pick']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=bc.DEFAULT_CSV, help="the results file")
    parser.add_argument("--out", default=OUT, help="the table to write")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--print", action="store_true", help="print the docs table instead")
    args = parser.parse_args(argv)
    tables = build(bc.read_rows(args.csv))
    if args.print:
        print(render_choices(tables["CHOICES"]), end="")
        return 0
    text = render(tables)
    if args.check:
        with open(args.out) as f:
            if f.read() != text:
                print(f"{args.out} is not what tools/kernel_table.py writes from {args.csv}: "
                      "run python tools/kernel_table.py")  # fmt: skip
                return 1
        print(f"{args.out} is current")
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
