"""Every Triton kernel of moetrain.kernels compiled ahead of time for Hopper and Blackwell.

    python tools/kernels_compiled.py            # writes docs/data/kernels_compiled.csv and
                                                # docs/kernels_compiled.md
    python tools/kernels_compiled.py --check    # compares with them: exit 1 and the changed rows
    python tools/kernels_compiled.py --json out.json --targets 90 --jobs 2

No GPU is needed. Triton compiles for a named target (`GPUTarget("cuda", 90, 32)`) on any
machine, and the ptxas it ships assembles the PTX into a cubin and reports registers and
spills. What is compiled is what the launchers launch: the launch code of every op
(`GroupedMMFunction`, `RouteFunction`, `PermuteFunction`, `UnpermuteFunction`, forward and
backward) runs on CPU tensors of the benchmarks' anchor shapes, each kernel launch is
recorded instead of run (an autotuned kernel once per autotune configuration), and every
distinct launch is compiled with the specialisation Triton's launcher gives it (pointer
alignment; integer arguments divisible by 16 or equal to 1).

Each row: kernel, phase, the anchor cases it serves, target, dtype, configuration,
registers per thread, spill stores / loads (bytes), shared memory (bytes, against the
target's limit), tensor memory (sm_100), and the PTX instruction mix (wgmma, mma.sync,
tcgen05.mma, ldmatrix, cp.async, TMA). `problems(rows)` lists what must not happen (see
docs/kernels_compiled.md, "What the test checks").

The table depends on the Triton version that compiles it (written in the page): the
committed one comes from the version the CPU test suite installs.

    python tools/kernels_compiled.py --oldest   # the same, under the oldest supported Triton

`--oldest` compiles every kernel at every configuration under OLDEST_TRITON (what the oldest
supported torch brings), in a virtual environment of its own (`.cache/triton-<version>`,
built on first use: torch and that Triton from the package index, about a minute), and
writes docs/data/kernels_compiled_oldest.csv: the same rows, with a hash of each kernel's
source. tests/tools/test_kernels_compiled.py holds that record to the code: the same launches
(kernel, phase, target, dtype, configuration) as the kernels make now, from the same source,
none of them with a problem. Besides, every tile of a `tl.dot` is checked against the
minimum shapes of every supported Triton (DOT_MIN_K), without compiling anything.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from unittest import mock

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import bench_router  # noqa: E402
from moetrain.kernels import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CSV = os.path.join(REPO, "docs", "data", "kernels_compiled.csv")
DEFAULT_MD = os.path.join(REPO, "docs", "kernels_compiled.md")


def kernel_modules() -> tuple:
    """The Triton modules of moetrain.kernels (each op stem's ``triton_backend``), compiled
    kernels (not the interpreter's)."""
    if common.interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET is set: under the interpreter @triton.jit gives "
                           "Python functions, which cannot be compiled; unset it (main() "
                           "runs itself again without it)")  # fmt: skip
    from moetrain.kernels.grouped_gemm import triton_backend as grouped_gemm
    from moetrain.kernels.permutation import triton_backend as permutation
    from moetrain.kernels.router import triton_backend as router

    return grouped_gemm, router, permutation


# Compute capability -> what the target is called. sm_100 needs a Triton whose ptxas knows
# Blackwell (Triton >= 3.3 ships one); `supported_targets` drops it otherwise.
TARGETS = {90: "sm_90 (H100/H200)", 100: "sm_100 (B200)"}
# Shared memory one block may use, bytes: the device property Triton's launcher compares a
# kernel's `shared` against (cudaDevAttrMaxSharedMemoryPerBlockOptin). 228 KiB per SM on
# H100 and B200, of which CUDA reserves 1 KiB per block: 227 KiB. Triton cannot read it
# without a device, so it is stated here, from the CUDA programming guide's table.
SHARED_LIMIT = {90: 227 * 1024, 100: 227 * 1024}
# Tensor memory of one SM on sm_100, in 32-bit columns (Triton's own limit for the check).
TMEM_COLUMNS = 512
# dtypes the grouped GEMM is compiled for: bf16 (GPU training) and fp32 (train.dtype=fp32,
# and the experts' inputs as the MoE layer passes them under autocast today). fp16, which
# the API accepts but no training path produces, is left out.
GEMM_DTYPES = (torch.bfloat16, torch.float32)
# E enters the GEMM kernels only as E_POW2, the width of the tile scheduler's prefix sum:
# they are compiled at one anchor, the one with the most experts.
GEMM_CASE = "qwen3-30b-a3b"
# dtypes of the token rows that permute / unpermute move.
ROW_DTYPES = (torch.bfloat16, torch.float32)
NUM_TOKENS = 256  # a multiple of 16, as a real batch's token count is
# The launch code runs on meta tensors: shapes and strides without memory (an anchor's expert
# weights are GBs). Their data pointer is 0, aligned as every CUDA allocation is.
META = torch.device("meta")
# PTX instruction counts in the table: name -> regex over the PTX text.
INSTRUCTIONS = {
    "wgmma": r"\bwgmma\.mma_async\.",
    "mma": r"\bmma\.sync\.",
    "tcgen05": r"\btcgen05\.mma\.",
    "ldmatrix": r"\bldmatrix\.",
    "cp_async": r"\bcp\.async\.c[ag]\.",
    "tma": r"\bcp\.async\.bulk\.tensor\.",
}
FIELDS = [
    "kernel", "phase", "cases", "target", "dtype", "config", "registers", "stack",
    "spill_stores", "spill_loads", "spills_in_loop", "shared", "shared_limit", "tmem",
    *INSTRUCTIONS, "compiler",
]  # fmt: skip
GEMM_KERNELS = ("grouped_gemm._grouped_mm_kernel", "grouped_gemm._grouped_wgrad_kernel")
KEY_FIELDS = ("kernel", "phase", "target", "dtype", "config")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
OLDEST_TRITON = "3.6.0"
"""The oldest Triton a supported torch brings: torch 2.11, pyproject's floor, pins 3.6.0."""
OLDEST_CSV = os.path.join(REPO, "docs", "data", "kernels_compiled_oldest.csv")
OLDEST_VENV = os.path.join(REPO, ".cache", f"triton-{OLDEST_TRITON}")
# tl.dot's smallest K per operand bit width, for each supported Triton (major.minor): what
# triton.backends.nvidia.compiler.min_dot_size returns (M and N may be 1). 3.6 wants K >= 16
# for 16- and 32-bit operands; 3.9 lowered 32-bit to 8. Every tile must meet all of them.
DOT_MIN_K = {"3.6": {8: 32, 16: 16, 32: 16}, "3.9": {8: 32, 16: 16, 32: 8}}
# The contraction depth of each kernel's tl.dot: the constexpr that sets it.
DOT_K = {"grouped_gemm._grouped_mm_kernel": "BLOCK_K",
         "grouped_gemm._grouped_wgrad_kernel": "BLOCK_R"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Recording the launches
# ---------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One kernel launch as the launcher made it (an autotuned one: per configuration)."""

    fn: JITFunction
    args: tuple
    kwargs: dict
    phase: str
    case: str
    dtype: str
    tune_index: int | None = None  # which autotune configuration, for an autotuned kernel
    # Every launch that compiles to the same kernel (anchor cases, phases, dtypes).
    cases: set[str] = field(default_factory=set)
    phases: set[str] = field(default_factory=set)
    dtypes: set[str] = field(default_factory=set)


def _jit_function(obj) -> JITFunction | None:
    """The JITFunction under an autotune / heuristics wrapper, or None for anything else."""
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj


def op_stem(module: str) -> str:
    """The op a kernel module belongs to: its stem under moetrain.kernels
    ("moetrain.kernels.grouped_gemm.triton_backend" -> "grouped_gemm"). A kernel is named by
    its op and function ("grouped_gemm._grouped_mm_kernel"), not by the file inside the
    op's stem, so the records (docs/kernels_compiled*.csv) outlive a move within it."""
    parts = module.split(".")
    if parts[:2] == ["moetrain", "kernels"] and len(parts) > 2:
        return parts[2]
    return parts[-1]


def kernels_defined() -> set[str]:
    """Names of every @triton.jit kernel defined in the kernel modules."""
    return {
        f"{op_stem(m.__name__)}.{name}"
        for m in kernel_modules()
        for name, obj in vars(m).items()
        if isinstance(obj, JITFunction)
    }


def kernel_name(fn: JITFunction) -> str:
    return f"{op_stem(fn.fn.__module__)}.{fn.fn.__name__}"


class Recorder:
    """Intercepts every Triton launch; the launch code runs on CPU tensors meanwhile."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.phase = self.case = self.dtype = ""
        self.tune_index: int | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        recorder = self

        def jit_run(self, *args, grid, warmup, **kwargs):  # noqa: ARG001 - run's signature
            recorder.launches.append(Launch(self, args, kwargs, recorder.phase, recorder.case,
                                            recorder.dtype, recorder.tune_index))  # fmt: skip

        def autotune_run(self, *args, **kwargs):
            configs = self.configs  # every one the autotuner would time for these arguments
            if self.early_config_prune:
                named = dict(zip(self.arg_names, args, strict=False))
                configs = self.early_config_prune(configs, named, **kwargs)
            for i, config in enumerate(configs):
                recorder.tune_index = i
                self.fn.run(*args, **kwargs, **config.all_kwargs())
            recorder.tune_index = None

        with (
            mock.patch.object(JITFunction, "run", jit_run),
            mock.patch.object(Autotuner, "run", autotune_run),
            mock.patch.object(common, "check_triton_device", lambda op, t: None),
        ):
            yield self

    @contextlib.contextmanager
    def label(self, phase: str, case: str, dtype: torch.dtype) -> Iterator[None]:
        self.phase, self.case, self.dtype = phase, case, DTYPE_NAMES[dtype]
        yield
        self.phase = self.case = self.dtype = ""


def record_gemm(rec: Recorder) -> None:
    """Grouped GEMM forward and backward (dgrad, wgrad), plain and with a row gather."""
    grouped_gemm = kernel_modules()[0]
    for case in (GEMM_CASE,):
        num_experts, hidden, ffn, top_k = bc.ANCHOR_SHAPES[case]
        rt = bc.make_routing(NUM_TOKENS, num_experts, top_k, "uniform", META)
        num_rows = NUM_TOKENS * top_k
        for dtype in GEMM_DTYPES:
            # The up projection (H -> F); the down one (F -> H) specialises the same way.
            w = torch.empty(num_experts, hidden, ffn, dtype=dtype, device=META,
                            requires_grad=True)  # fmt: skip
            for gather in (False, True):
                rows = NUM_TOKENS if gather else num_rows
                x = torch.empty(rows, hidden, dtype=dtype, device=META, requires_grad=True)
                prefix = "gather " if gather else ""
                with rec.label(prefix + "fwd", case, dtype):
                    y = grouped_gemm.GroupedMMFunction.apply(
                        x, rt.src_N if gather else None, w, rt.offs_E
                    )
                with rec.label(prefix + "bwd", case, dtype):  # dgrad, then wgrad
                    y.backward(torch.empty_like(y))


def record_router(rec: Recorder) -> None:
    """The fused router forward and backward (gradients from weights, scores and lse)."""
    router = kernel_modules()[1]
    for case, (num_experts, top_k, score_func, has_bias) in bench_router.ROUTERS.items():
        logits = torch.empty(NUM_TOKENS, num_experts, device=META, requires_grad=True)
        bias = torch.empty(num_experts, device=META) if has_bias else None
        with rec.label("fwd", case, torch.float32):
            out = router.RouteFunction.apply(logits, bias, top_k, score_func, True)
        weights, _ids, scores, lse, _counts = out
        with rec.label("bwd", case, torch.float32):
            torch.autograd.backward(
                (weights, scores, lse),
                (torch.ones_like(weights), torch.ones_like(scores), torch.ones_like(lse)),
            )


def record_permutation(rec: Recorder) -> None:
    """permute and unpermute, forward and backward, with fp32 routing weights."""
    permutation = kernel_modules()[2]
    for case, (num_experts, hidden, _ffn, top_k) in bc.ANCHOR_SHAPES.items():
        dest_TK = bc.make_routing(NUM_TOKENS, num_experts, top_k, "uniform", META).dest_TK
        num_rows = dest_TK.numel()
        weights_TK = torch.empty(NUM_TOKENS, top_k, device=META, requires_grad=True)
        for dtype in ROW_DTYPES:
            x = torch.empty(NUM_TOKENS, hidden, dtype=dtype, device=META, requires_grad=True)
            y = torch.empty(num_rows, hidden, dtype=dtype, device=META, requires_grad=True)
            with rec.label("permute fwd", case, dtype):
                rows = permutation.PermuteFunction.apply(x, dest_TK, num_rows)
            with rec.label("permute bwd", case, dtype):
                rows.backward(torch.empty_like(rows))
            with rec.label("unpermute fwd", case, dtype):
                out = permutation.UnpermuteFunction.apply(y, dest_TK, weights_TK)
            with rec.label("unpermute bwd", case, dtype):
                out.backward(torch.empty_like(out))


RECORDERS = (record_gemm, record_router, record_permutation)


def record_launches() -> list[Launch]:
    """Every launch the launchers make at the anchor shapes, one per distinct compile key
    (kernel, specialisation, options); `cases` lists the anchor cases that share it."""
    rec = Recorder()
    with rec.active():
        for record in RECORDERS:
            record(rec)
    return rec.launches


# ---------------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------------


def supported_targets() -> list[int]:
    """The targets of TARGETS this Triton can compile for (its ptxas knows the arch)."""
    from triton.backends.nvidia.compiler import CUDABackend

    out = []
    for cc in TARGETS:
        try:
            CUDABackend(triton.backends.compiler.GPUTarget("cuda", cc, 32))
        except Exception:  # an older Triton without this arch
            continue
        out.append(cc)
    return out


@dataclass
class Job:
    """What one compile needs, in a form a worker process can receive."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    capability: int


def _job(launch: Launch, capability: int) -> Job:
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(triton.backends.compiler.GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    return Job(fn.fn.__module__, fn.fn.__name__, signature, constexprs, attrs,
               dict(options.__dict__), capability)  # fmt: skip


RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")
LOCAL_ACCESS = re.compile(r"\b(STL|LDL)((?:\.[A-Z0-9]+)*)\b")
ACCESS_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # default 4


MMA_SASS = re.compile(r"\b(?:HGMMA|HMMA|UTC\w*MMA)\b")  # wgmma, mma.sync, tcgen05.mma


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread, stack frame and spill traffic of a cubin, read from the binary
    (so a cached compile gives the same figures): `cuobjdump -res-usage` for registers and
    the stack; the SASS's local stores / loads (STL / LDL, by width) for the bytes ptxas -v
    reports as spill stores / loads (the kernels keep nothing else in local memory); and
    how many of those accesses sit in the tensor-core loop, between its first and last MMA
    instruction (all of them in a kernel without MMA)."""
    import tempfile

    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], check=True, capture_output=True,
                               text=True).stdout  # fmt: skip
        m = RES_USAGE.search(usage)
        # Spills live in the stack frame: without one there is nothing to disassemble.
        sass = "" if m is None or m.group(2) == "0" else subprocess.run(
            [tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout  # fmt: skip
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count:\n{usage}")
    spills = {"STL": 0, "LDL": 0}
    lines = sass.splitlines()
    mma = [i for i, line in enumerate(lines) if MMA_SASS.search(line)]
    in_loop = 0
    for i, line in enumerate(lines):
        for op, suffixes in LOCAL_ACCESS.findall(line):
            parts = suffixes.split(".")[1:]
            spills[op] += next((b for name, b in ACCESS_BYTES.items() if name in parts), 4)
            in_loop += not mma or mma[0] <= i <= mma[-1]
    return {"registers": int(m.group(1)), "stack": int(m.group(2)),
            "spill_stores": spills["STL"], "spill_loads": spills["LDL"],
            "spills_in_loop": in_loop}  # fmt: skip


def compile_job(job: Job) -> dict:
    """Compile one launch for its target (Triton's cache serves a repeat) and read the result."""
    import importlib

    from triton.compiler import ASTSource

    fn = _jit_function(getattr(importlib.import_module(job.module), job.name))
    target = triton.backends.compiler.GPUTarget("cuda", job.capability, 32)
    src = ASTSource(fn, job.signature, job.constexprs, job.attrs)
    compiled = triton.compile(src, target=target, options=job.options)
    ptx = compiled.asm["ptx"]
    return {
        **cubin_resources(compiled.asm["cubin"]),
        "shared": int(compiled.metadata.shared),
        "tmem": int(getattr(compiled.metadata, "tmem_size", 0) or 0),
        **{name: len(re.findall(rx, ptx)) for name, rx in INSTRUCTIONS.items()},
    }


# Constexprs that describe a launch's configuration in the table (the others are derived
# from the dtype, the shape or the phase, which have their own columns).
CONFIG_KEYS = ("BLOCK_N", "BLOCK_M", "BLOCK_K", "BLOCK_R", "BLOCK_T", "BLOCK_D", "BLOCK",
               "TOP_K", "E_POW2", "SIGMOID", "HAS_BIAS", "RENORM", "HAS_W", "EVEN_K")  # fmt: skip


def _config(job: Job) -> str:
    consts = _constexprs(job)
    parts = [f"{k}={int(v) if isinstance(v, bool) else v}" for k in CONFIG_KEYS
             if k in consts for v in [consts[k]]]  # fmt: skip
    parts.append(f"w{job.options['num_warps']}s{job.options['num_stages']}")
    return " ".join(parts)


def phase_name(launch: Launch) -> str:
    """The grouped GEMM's backward is two kernels: dgrad (the forward kernel) and wgrad."""
    if launch.phase.endswith("bwd") and kernel_name(launch.fn) in GEMM_KERNELS:
        op = "dgrad" if kernel_name(launch.fn) == GEMM_KERNELS[0] else "wgrad"
        return launch.phase.replace("bwd", op)
    return launch.phase


SPOT_TARGET = 90


def in_spot(launch: Launch) -> bool:
    """The quick check's subset: one anchor, bf16 rows (fp32 for the router), the first
    autotune configuration, no gather."""
    return (
        launch.case == GEMM_CASE
        and launch.dtype == ("fp32" if kernel_name(launch.fn).startswith("router.") else "bf16")
        and launch.tune_index in (None, 0)
        and not launch.phase.startswith("gather")
    )  # fmt: skip


def plan(targets: list[int], spot: bool = False) -> list[tuple[Launch, Job]]:
    """Record and deduplicate every launch for every target, nothing compiled (`spot`: only
    the quick subset, on sm_90)."""
    unique: dict[tuple, tuple[Launch, Job]] = {}
    spot_keys = set()
    for launch in record_launches():
        for cc in targets:
            job = _job(launch, cc)
            key = (job.module, job.name, repr(job.signature),
                   repr(sorted(job.constexprs.items())), repr(sorted(job.attrs.items())),
                   repr(sorted(job.options.items())), cc)  # fmt: skip
            first = unique.setdefault(key, (launch, job))[0]
            first.cases.add(launch.case)
            first.phases.add(phase_name(launch))
            first.dtypes.add(launch.dtype)
            if cc == SPOT_TARGET and in_spot(launch):
                spot_keys.add(key)
    if spot:  # labelled from every launch, as in the full table
        unique = {k: v for k, v in unique.items() if k in spot_keys}
    return list(unique.values())


def _constexprs(job: Job) -> dict:
    names = list(job.signature)
    return {names[path[0]]: v for path, v in job.constexprs.items() if len(path) == 1}


def label(launch: Launch, job: Job) -> dict:
    """A row's identity and description, before compiling."""
    return {
        "kernel": kernel_name(launch.fn),
        "phase": ", ".join(sorted(launch.phases)),
        "cases": " ".join(sorted(launch.cases)),
        "target": f"sm_{job.capability}",
        "dtype": "/".join(sorted(launch.dtypes)),
        "config": _config(job),
        "shared_limit": SHARED_LIMIT[job.capability],
    }


def dot_tiles(items: list[tuple[Launch, Job]]) -> list[dict]:
    """Each launch's tl.dot: its row label, the operands' bit width and the contraction K."""
    out = []
    for launch, job in items:
        name = kernel_name(launch.fn)
        if name not in DOT_K:
            continue
        consts = _constexprs(job)
        dtypes = {d for d in launch.dtypes}
        # DOT_FP32 casts the tiles to fp32 before the dot (fp32 inputs, the interpreter).
        bits = 32 if consts.get("DOT_FP32") or dtypes == {"fp32"} else 16
        out.append({**label(launch, job), "bits": bits, "k": int(consts[DOT_K[name]])})
    return out


def dot_problems(tiles: list[dict]) -> list[str]:
    """Tiles below tl.dot's minimum K of any supported Triton (DOT_MIN_K)."""
    out = []
    for t in tiles:
        need = {v: mins[t["bits"]] for v, mins in DOT_MIN_K.items()}
        short = {v: k for v, k in need.items() if t["k"] < k}
        if short:
            out.append(
                f"{t['kernel']} {t['phase']} {t['target']} {t['dtype']} [{t['config']}]: "
                f"tl.dot over K={t['k']} with {t['bits']}-bit operands, below the "
                + ", ".join(f"K >= {k} of Triton {v}" for v, k in sorted(short.items()))
            )
    return out


def undeclared_dots() -> list[str]:
    """Kernels whose source calls tl.dot but DOT_K does not say which constexpr is its K."""
    out = []
    for m in kernel_modules():
        for name, obj in vars(m).items():
            full = f"{op_stem(m.__name__)}.{name}"
            if isinstance(obj, JITFunction) and "tl.dot(" in obj.src and full not in DOT_K:
                out.append(f"{full}: calls tl.dot; name its K in DOT_K for the minimum check")
    return out


def source_hash(kernel: str) -> str:
    """A short hash of a kernel's source: the oldest-Triton record is from this source."""
    import hashlib

    module, name = kernel.split(".")
    mods = {op_stem(m.__name__): m for m in kernel_modules()}
    fn = _jit_function(getattr(mods[module], name))
    return hashlib.sha256(fn.src.encode()).hexdigest()[:12]


def build_rows(targets: list[int], jobs: int, spot: bool = False) -> list[dict]:
    """Record, deduplicate and compile every launch for every target (`spot`: only the quick
    subset, on sm_90)."""
    items = plan(targets, spot)
    print(f"compiling {len(items)} kernel variants with {jobs} processes", file=sys.stderr)
    with ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        mapped = (pool.map(compile_job, [j for _, j in items]) if pool
                  else map(compile_job, [j for _, j in items]))  # fmt: skip
        results = []
        for res in mapped:
            results.append(res)
            if len(results) % 25 == 0:
                print(f"  {len(results)}/{len(items)}", file=sys.stderr)
    rows = []
    compiler = versions()
    for (launch, job), res in zip(items, results, strict=True):
        rows.append({**label(launch, job), **res, "compiler": compiler})
    rows.sort(key=lambda r: tuple(str(r[k]) for k in ("kernel", "target", "phase", "dtype",
                                                      "config")))  # fmt: skip
    keys = [row_key(r) for r in rows]
    if len(set(keys)) != len(keys):
        raise RuntimeError("two compiled variants share a table key: extend CONFIG_KEYS")
    return rows


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def problems(rows: list[dict], every_kernel: bool = True) -> list[str]:
    """What must not happen in a compiled kernel (see docs/kernels_compiled.md).
    `every_kernel`: also that every kernel of kernels/ is among the rows."""
    out = []
    missing = kernels_defined() - {r["kernel"] for r in rows} if every_kernel else set()
    for name in sorted(missing):
        out.append(f"{name}: defined in kernels/ but never launched by the compile scenarios "
                   "(tools/kernels_compiled.py RECORDERS): add its launch there")  # fmt: skip
    for r in rows:
        where = f"{r['kernel']} {r['phase']} {r['target']} {r['dtype']} [{r['config']}]"
        if r["shared"] > r["shared_limit"]:
            out.append(f"{where}: shared memory {r['shared']} B > the target's "
                       f"{r['shared_limit']} B: the config cannot launch")  # fmt: skip
        if r["tmem"] > TMEM_COLUMNS:
            out.append(f"{where}: tensor memory {r['tmem']} columns > {TMEM_COLUMNS}")
        if (r["spill_stores"] or r["spill_loads"]) and not spill_allowed(r):
            out.append(f"{where}: spills ({r['spill_stores']} B stored, {r['spill_loads']} B "
                       f"loaded, {r['registers']} registers)")  # fmt: skip
        expect = expected_mma(r)
        if expect is not None:
            got = {k: r[k] for k in ("wgmma", "mma", "tcgen05")}
            if any((got[k] > 0) != (k == expect) for k in got):
                out.append(f"{where}: expected {expect or 'no tensor-core MMA'}, the PTX has "
                           f"{got}")  # fmt: skip
    return out


SPILL_RULE = """ in any configuration, inside a tensor-core K loop, nor anywhere in a
  kernel without one. Every configuration counts: the autotuner times each one of the
  dtype's list on every (K, M) and keeps the fastest, so any of them may be the one that
  runs. A tensor-core tile may spill before its first MMA instruction or after its last
  (values kept across the loop: stored once and loaded once per tile): the `loop` column
  counts the local-memory accesses between the two, which must be 0"""


def spill_allowed(row: dict) -> bool:
    """Spills outside the tensor-core loop only (see SPILL_RULE)."""
    return row["spills_in_loop"] == 0 and (row["wgmma"] or row["mma"] or row["tcgen05"]) > 0


def expected_mma(row: dict) -> str | None:
    """The MMA instruction a GEMM tile must use ('' for none), None for non-GEMM kernels."""
    if row["kernel"] not in GEMM_KERNELS:
        return None
    if row["dtype"] == "fp32":
        return ""  # input_precision="ieee": fp32 products on the FMA units, as torch's matmul
    return {"sm_90": "wgmma", "sm_100": "tcgen05"}[row["target"]]


# ---------------------------------------------------------------------------------------------
# The table: CSV, markdown, comparison
# ---------------------------------------------------------------------------------------------


def row_key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in KEY_FIELDS)


def write_csv(rows: list[dict], path: str, fields: list[str] = FIELDS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: (int(v) if k in INT_FIELDS else v) for k, v in r.items()}
                for r in csv.DictReader(f)]  # fmt: skip


INT_FIELDS = set(FIELDS[FIELDS.index("registers") : FIELDS.index("compiler")])


def compare(rows: list[dict], committed: list[dict], subset: bool = False,
            fields: list[str] = FIELDS) -> list[str]:  # fmt: skip
    """Differences between compiled rows and the committed table. `subset`: only rows that
    were compiled are compared (a partial run), none reported missing."""
    was, now = {r["compiler"] for r in committed}, {r["compiler"] for r in rows}
    if was != now:  # every figure may move with the compiler: one line, not every row
        return [f"the table was compiled with {', '.join(sorted(was))}, this is "
                f"{', '.join(sorted(now))}"]  # fmt: skip
    old = {row_key(r): r for r in committed}
    new = {row_key(r): r for r in rows}
    out = []
    for key in sorted(new):
        if key not in old:
            out.append(f"new row {' | '.join(key)}")
            continue
        changed = [f"{k} {old[key].get(k)} -> {new[key].get(k)}" for k in fields
                   if str(old[key].get(k)) != str(new[key].get(k))]  # fmt: skip
        if changed:
            out.append(f"{' | '.join(key)}: {', '.join(changed)}")
    if not subset:
        out += [f"row gone {' | '.join(key)}" for key in sorted(set(old) - set(new))]
    return out


def versions() -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return f"Triton {triton.__version__}, ptxas {get_ptxas(90).version}"


MD_HEAD = """\
# Kernels compiled for Hopper and Blackwell

Generated by `python tools/kernels_compiled.py` (from its run with {versions}); do not edit.
`docs/data/kernels_compiled.csv` holds the same rows. `tests/tools/test_kernels_compiled.py`
compiles the kernels again and fails when the result differs from this table, so a change
that makes a kernel spill, outgrow shared memory or leave the tensor cores shows in review.
The figures belong to that compiler: under another Triton the test says so, and the table is
written again (`python tools/kernels_compiled.py`) and reviewed like any change.

Every Triton kernel in `kernels/` is compiled ahead of time, without a GPU, for each target
below, at every configuration its launcher uses: each autotune configuration of the grouped
GEMM, and the block sizes the router and permute launchers pick for the anchor shapes of the
benchmarks ([benchmarks.md](benchmarks.md)). The launch code itself runs (on meta tensors)
and its launches are recorded, so the table shows what the launchers really launch, with
the specialisation Triton's launcher gives them. The grouped GEMM is compiled at
{gemm_case} (E={gemm_e}): E reaches its kernels only as E_POW2, the width of the tile
scheduler's prefix sum. dtypes: {gemm_dtypes} for the grouped GEMM (fp16, which the API
accepts and no training path produces, is not compiled), fp32 logits for the router,
{row_dtypes} token rows for permute / unpermute.

Columns: `regs` registers per thread; `spills` bytes stored / loaded by register spills
(local memory, read from the cubin's SASS; what `ptxas -v` reports); `loop` how many of
those local accesses sit between the first and the last tensor-core MMA instruction (the K
loop; all of them in a kernel without MMA); `smem` shared memory
per block in KiB, against the target's limit of {limit_kib} KiB (228 KiB per SM on H100 and
B200, less the 1 KiB CUDA reserves per block: the device property Triton's launcher checks,
stated here since no device is present); `tmem` sm_100 tensor-memory columns (of
{tmem_columns}); then the PTX instruction mix: `wgmma` (Hopper warpgroup MMA), `mma`
(`mma.sync`, the pre-Hopper tensor-core MMA), `tcgen05` (Blackwell's MMA), `ldmatrix`,
`cp.async` (asynchronous global -> shared copies), `TMA` (`cp.async.bulk.tensor`).

## What the test checks

- Every kernel defined in `kernels/` is compiled (a new kernel needs its launch in the
  tool's scenarios) and compiles for every target.
- Shared memory fits the target, and tensor memory fits on sm_100. A grouped-GEMM config
  past the limit would be skipped by the autotuner at run time, every launch of another
  kernel would fail: either is a bug in the config list.
- No register spills{spill_rule}.
- The grouped-GEMM tiles (forward, dgrad, wgrad, with and without the gather) use the
  target's tensor-core MMA: `wgmma` and no `mma.sync` on sm_90, `tcgen05.mma` on sm_100, for
  bf16. fp32 tiles use none, by design: fp32 inputs take `input_precision="ieee"`, products
  in full fp32 on the FMA units, as torch's fp32 matmul computes them (no TF32).
- Every tile of a `tl.dot` meets the minimum shapes of every supported Triton (K >= 16 for
  16- and 32-bit operands under Triton {oldest}, the oldest supported, which torch 2.11
  brings; 8 for fp32 under 3.9; 32 for 8-bit), checked without compiling.
- The same kernels compile under Triton {oldest}: `python tools/kernels_compiled.py --oldest`
  compiles every configuration again in a virtual environment of its own and writes
  `docs/data/kernels_compiled_oldest.csv`, which the test holds to the kernels (the same
  launches, the same kernel source, no problem in any row).
"""


def _capability(target: str) -> int:
    return int(target.split("_")[1])


def findings(rows: list[dict]) -> str:
    """What the rows show, in a few lines (recomputed with the table)."""
    out = ["\n## What the table shows\n"]
    for target in sorted({r["target"] for r in rows}, key=_capability):
        t_rows = [r for r in rows if r["target"] == target]
        big = max(t_rows, key=lambda r: r["shared"])
        regs = max(t_rows, key=lambda r: r["registers"])
        gemm = [r for r in t_rows if r["kernel"] in GEMM_KERNELS and r["dtype"] == "bf16"]
        mma = "wgmma" if target == "sm_90" else "tcgen05"
        on_mma = sum(r[mma] > 0 for r in gemm)
        out.append(f"- {target}: {len(t_rows)} compiled kernels; {on_mma} of {len(gemm)} bf16 "
                   f"grouped-GEMM tiles on `{mma}`; most shared memory "
                   f"{big['shared'] / 1024:.0f} of {big['shared_limit'] / 1024:.0f} KiB "
                   f"({big['kernel']} `{big['config']}`); most registers {regs['registers']} "
                   f"({regs['kernel']} {regs['phase']} {regs['dtype']}).")  # fmt: skip
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    if spilled:
        where = sorted({f"{r['target']} {r['kernel']} {r['phase']} {r['dtype']}"
                        for r in spilled})  # fmt: skip
        sizes = sorted({r["spill_stores"] for r in spilled})
        inside = sum(r["spills_in_loop"] > 0 for r in spilled)
        place = "all outside the K loop" if not inside else f"{inside} inside a K loop"
        out.append(f"- Spills, {place}: {len(spilled)} configurations "
                   f"({'; '.join(where)}), {sizes[0]}-{sizes[-1]} B stored and loaded once "
                   "per tile.")  # fmt: skip
    else:
        out.append("- No spills.")
    if not any(r["tma"] for r in rows):
        out.append("- No kernel uses TMA (`cp.async.bulk.tensor`): the tiles load with "
                   "`cp.async` from computed pointers (TMA needs Triton's tensor "
                   "descriptors).")  # fmt: skip
    return "\n".join(out) + "\n"


def markdown(rows: list[dict]) -> str:
    by_target: dict[str, list[dict]] = {}
    for r in rows:
        by_target.setdefault(r["target"], []).append(r)
    gemm_e = bc.ANCHOR_SHAPES[GEMM_CASE][0]
    text = MD_HEAD.format(
        versions=versions(), gemm_case=GEMM_CASE, gemm_e=gemm_e,
        gemm_dtypes=" and ".join(DTYPE_NAMES[d] for d in GEMM_DTYPES),
        row_dtypes=" and ".join(DTYPE_NAMES[d] for d in ROW_DTYPES),
        limit_kib=SHARED_LIMIT[90] // 1024, tmem_columns=TMEM_COLUMNS,
        spill_rule=SPILL_RULE, oldest=OLDEST_TRITON,
    )  # fmt: skip
    text += findings(rows)
    cols = ["phase", "dtype", "config", "cases", "regs", "spills", "loop", "smem", "tmem",
            "wgmma", "mma", "tcgen05", "ldmatrix", "cp.async", "TMA"]  # fmt: skip
    for target in sorted(by_target, key=_capability):
        cc = _capability(target)
        text += f"\n## {TARGETS[cc]}\n"
        kernels: dict[str, list[dict]] = {}
        for r in by_target[target]:
            kernels.setdefault(r["kernel"], []).append(r)
        for kernel, krows in kernels.items():
            text += f"\n### `{kernel}`\n\n| " + " | ".join(cols) + " |\n"
            text += "|" + "---|" * len(cols) + "\n"
            for r in krows:
                cells = [r["phase"], r["dtype"], f"`{r['config']}`", r["cases"],
                         str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}",
                         str(r["spills_in_loop"]), f"{r['shared'] / 1024:.1f}", str(r["tmem"]),
                         str(r["wgmma"]), str(r["mma"]), str(r["tcgen05"]), str(r["ldmatrix"]),
                         str(r["cp_async"]), str(r["tma"])]  # fmt: skip
                text += "| " + " | ".join(cells) + " |\n"
    return text


def record_problems(record: list[dict]) -> list[str]:
    """What keeps the oldest-Triton record (docs/data/kernels_compiled_oldest.csv) from vouching
    for the kernels as they are, found without compiling: it must come from OLDEST_TRITON,
    hold exactly the launches the kernels make now (same kernels, phases, targets, dtypes,
    configurations) from the same kernel source, each compiled without a problem."""
    out = []
    compilers = {r["compiler"] for r in record}
    if not record or any(not c.startswith(f"Triton {OLDEST_TRITON},") for c in compilers):
        out.append(f"the record was compiled with {sorted(compilers)}, not Triton {OLDEST_TRITON}")
    now = {row_key(label(launch, job)) for launch, job in plan(list(TARGETS))}
    held = {row_key(r) for r in record}
    out += [f"not in the record: {' | '.join(k)}" for k in sorted(now - held)]
    out += [f"in the record, no longer launched: {' | '.join(k)}" for k in sorted(held - now)]
    sources = {r["kernel"]: r["source"] for r in record}
    for kernel, recorded in sorted(sources.items()):
        if kernel in kernels_defined() and source_hash(kernel) != recorded:
            out.append(f"{kernel}: its source changed since the record was compiled")
    out += [f"in the record: {p}" for p in problems(record)]
    if out:
        out.append(f"compile again under Triton {OLDEST_TRITON}: python tools/kernels_compiled.py "
                   "--oldest (builds its virtual environment on first use)")  # fmt: skip
    return out


def build_venv(venv: str) -> float:
    """A virtual environment with torch (this one's version) and OLDEST_TRITON only, nothing
    shared with this Python's packages (two Tritons must not mix). Returns its seconds."""
    import time

    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    torch_version = torch.__version__.split("+")[0]
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q",
                    f"torch=={torch_version}", f"triton=={OLDEST_TRITON}"], check=True)  # fmt: skip
    return time.monotonic() - start


def _shim(venv: str) -> str:
    """A folder that makes this tree importable as moetrain (kernels/ as moetrain.kernels,
    as pyproject maps it) without installing it: symlinks, as tools/gpu_suite.sh does."""
    shim = os.path.join(venv, "shim")
    pkg = os.path.join(shim, "moetrain")
    os.makedirs(pkg, exist_ok=True)
    for name in os.listdir(os.path.join(REPO, "moetrain")) + ["kernels"]:
        link = os.path.join(pkg, name)
        src = os.path.join(REPO, "kernels" if name == "kernels" else os.path.join("moetrain", name))
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(src, link)
    return shim


def run_oldest(argv: list[str], venv: str) -> int:
    """Run this tool again under OLDEST_TRITON, in `venv` (built when it has no Python)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"building {venv}: torch {torch.__version__.split('+')[0]} and Triton "
              f"{OLDEST_TRITON}", file=sys.stderr)  # fmt: skip
        print(f"built in {build_venv(venv):.0f} s", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = _shim(venv)
    env["PYTHONSAFEPATH"] = "1"  # not the repo root first: moetrain/ there lacks kernels
    return subprocess.run([python, os.path.abspath(__file__), *argv], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed CSV instead of writing it; exit 1 on "
                        "a difference")  # fmt: skip
    parser.add_argument("--csv", default=None, help=f"default {DEFAULT_CSV} (--oldest: "
                        f"{OLDEST_CSV})")  # fmt: skip
    parser.add_argument("--md", default=DEFAULT_MD)
    parser.add_argument("--json", help="also write the rows, differences and problems here")
    parser.add_argument("--targets", help="compute capabilities, comma-separated (default: "
                        f"{','.join(map(str, TARGETS))}, those this Triton supports)")  # fmt: skip
    parser.add_argument("--spot", action="store_true",
                        help="only the spot subset (sm_90; one configuration per kernel "
                        "and phase): the quick check")  # fmt: skip
    parser.add_argument("--oldest", action="store_true",
                        help=f"compile under Triton {OLDEST_TRITON} (the oldest supported) in "
                        "its own virtual environment, into the oldest-Triton record")  # fmt: skip
    parser.add_argument("--venv", default=OLDEST_VENV,
                        help="--oldest's virtual environment (built if it has no "
                        "Python)")  # fmt: skip
    parser.add_argument("--check-record", action="store_true",
                        help="check the oldest-Triton record against the kernels and every "
                        "tl.dot tile against DOT_MIN_K, compiling nothing")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4),
                        help="compiles in parallel (processes)")  # fmt: skip
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.oldest and triton.__version__ != OLDEST_TRITON:
        return run_oldest(argv, args.venv)
    if common.interpreter_enabled():  # run again without it (see kernel_modules)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, os.path.abspath(__file__), *argv],
                              env=env).returncode  # fmt: skip
    csv_path = args.csv or (OLDEST_CSV if args.oldest or args.check_record else DEFAULT_CSV)
    if args.check_record:
        found = record_problems(read_csv(csv_path))
        found += dot_problems(dot_tiles(plan(list(TARGETS)))) + undeclared_dots()
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"problems": found, "versions": versions(),
                           "tiles": dot_tiles(plan(list(TARGETS)))}, f, indent=1)  # fmt: skip
        for line in found:
            print("PROBLEM", line)
        return 1 if found else 0
    targets = supported_targets()
    if args.targets:
        asked = [int(t) for t in args.targets.split(",")]
        unknown = [t for t in asked if t not in targets]
        if unknown:
            parser.error(f"--targets {unknown}: this Triton compiles for {targets}")
        targets = asked
    if args.spot and SPOT_TARGET not in targets:
        parser.error(f"--spot compiles for sm_{SPOT_TARGET}, which --targets leaves out")
    rows = build_rows(targets, args.jobs, spot=args.spot)
    if args.oldest:
        for r in rows:
            r["source"] = source_hash(r["kernel"])
    found = problems(rows, every_kernel=not args.spot)
    found += dot_problems(dot_tiles(plan(targets, args.spot))) + undeclared_dots()
    diffs = []
    fields = FIELDS + (["source"] if args.oldest else [])
    if args.check or args.spot:
        if os.path.exists(csv_path):
            diffs = compare(rows, read_csv(csv_path), subset=args.spot, fields=fields)
        else:
            diffs = [f"no committed table at {csv_path}"]
    else:
        write_csv(rows, csv_path, fields)
        if not args.oldest:
            with open(args.md, "w") as f:
                f.write(markdown(rows))
        print(f"wrote {len(rows)} rows to {csv_path}" + ("" if args.oldest else f" and {args.md}"))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"rows": rows, "problems": found, "diffs": diffs,
                       "versions": versions()}, f, indent=1)  # fmt: skip
    for line in found:
        print("PROBLEM", line)
    for line in diffs:
        print("CHANGED", line)
    if diffs:
        again = "python tools/kernels_compiled.py" + (" --oldest" if args.oldest else "")
        print(f"the compiled kernels differ from {csv_path} ({versions()}): if the change is "
              f"intended, run {again} and commit the table")  # fmt: skip
    return 1 if found or diffs else 0


if __name__ == "__main__":
    sys.exit(main())
