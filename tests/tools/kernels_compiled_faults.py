"""Injects the faults tools/kernels_compiled.py guards against and prints what it caught, as
JSON (run by tests/tools/test_kernels_compiled.py in a subprocess: the tool needs the Triton
interpreter off, which the test process keeps on).

- a spill in the K loop: a grouped-GEMM tile compiled with a register cap (maxnreg) far
  below its need; the spill bytes read from the cubin must equal what ptxas -v reports. A
  milder cap spills only around the loop, which the rule allows;
- shared memory past the target: a tile with more pipeline stages than fit;
- a GEMM off the warpgroup MMA: the same tile compiled for sm_80 (mma.sync), labelled sm_90;
- a kernel that no scenario launches;
- a committed row that no longer matches, a row gone, a table from another compiler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import kernels_compiled as kc  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from moetrain.kernels.grouped_gemm import triton_backend  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _gemm_launch(tune_index: int) -> kc.Launch:
    rec = kc.Recorder()
    with rec.active():
        kc.record_gemm(rec)
    return next(x for x in rec.launches if x.phase == "fwd" and x.dtype == "bf16"
                and x.tune_index == tune_index)  # fmt: skip


def _row(launch: kc.Launch, capability: int, label_target: int | None = None) -> dict:
    job = kc._job(launch, capability)
    res = kc.compile_job(job)
    return {"kernel": kc.kernel_name(launch.fn), "phase": "fwd", "cases": "fault",
            "target": f"sm_{label_target or capability}", "dtype": "bf16",
            "config": kc._config(job), "shared_limit": kc.SHARED_LIMIT[90], **res}  # fmt: skip


def _ptxas_report(launch: kc.Launch) -> str:
    job = kc._job(launch, 90)
    src = ASTSource(kc._jit_function(launch.fn), job.signature, job.constexprs, job.attrs)
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
                       options=job.options)  # fmt: skip
    return log.getvalue()


@triton.jit
def _never_launched(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)


def main() -> None:
    out = {}
    # The first tile (128x128x64, 4 warps) needs ~220 registers. Capped at 128 it spills
    # inside its K loop; capped at 168 only around it (values kept across the loop).
    base = _gemm_launch(0)
    capped = dataclasses.replace(base, kwargs={**base.kwargs, "maxnreg": 128})
    row = _row(capped, 90)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", _ptxas_report(capped))
    out["spill"] = {"row": {k: row[k] for k in ("registers", "spill_stores", "spill_loads",
                                                "spills_in_loop")},
                    "ptxas": [int(m.group(1)), int(m.group(2))] if m else None,
                    "problems": kc.problems([row], every_kernel=False)}  # fmt: skip
    row = _row(dataclasses.replace(base, kwargs={**base.kwargs, "maxnreg": 168}), 90)
    out["spill_outside_loop"] = {
        "row": {k: row[k] for k in ("spill_stores", "spills_in_loop")},
        "problems": kc.problems([row], every_kernel=False),
    }
    # 256x128x64 with 8 stages: 8 x (256x64 + 64x128) bf16 = 384 KiB of shared memory.
    deep = dataclasses.replace(base, kwargs={**base.kwargs, "BLOCK_N": 256, "BLOCK_M": 128,
                                             "num_warps": 8, "num_stages": 8})  # fmt: skip
    row = _row(deep, 90)
    out["smem"] = {"shared": row["shared"], "problems": kc.problems([row], every_kernel=False)}
    # The first tile compiled for Ampere: mma.sync, no wgmma; labelled as an sm_90 row.
    row = _row(base, 80, label_target=90)
    out["mma"] = {"wgmma": row["wgmma"], "mma": row["mma"],
                  "problems": kc.problems([row], every_kernel=False)}  # fmt: skip
    # A kernel defined in kernels/ that no scenario launches.
    triton_backend._never_launched = _never_launched
    out["coverage"] = [p for p in kc.problems([]) if "_never_launched" in p]
    # A committed row that differs.
    committed = kc.read_csv(kc.DEFAULT_CSV)
    changed = [dict(r) for r in committed]
    changed[0]["registers"] += 8
    out["compare"] = kc.compare(changed, committed) + kc.compare(changed[1:], committed)
    # Another compiler: every figure may move, one line says so.
    out["compiler"] = kc.compare([{**r, "compiler": "Triton 0.0"} for r in committed], committed)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
