"""Shared benchmark helpers: timing, ceilings measured in the same run, routing, CSV rows.

Timing on CUDA: CUDA events around each rep, a 256 MB buffer written between reps so
that no rep starts with its operands in L2, warm-up first, median reported. On CPU (the
`--device cpu --quick` smoke mode) the same loop runs with perf_counter and no flush.

Every benchmark writes rows of one schema (CSV_FIELDS): who measured (device, torch,
triton, commit), what (benchmark, case, routing, dtype, op, impl), the figures (ms,
TFLOP/s, GB/s, ratio to the ceiling measured in the same run, speed-up over a named peer
measured in the same run), a free figure with its unit for what is not a kernel time
(tokens/s, MFU, memory, loss differences, test counts) and a status (ok, mismatch, fail,
timeout, skipped).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CSV = os.path.join(REPO, "docs", "data", "benchmarks.csv")
CSV_FIELDS = [
    "timestamp", "device", "torch", "triton", "commit", "benchmark", "case", "routing",
    "dtype", "op", "impl", "ms", "tflops", "gbs", "ratio_ceiling", "peer", "ratio_peer",
    "value", "unit", "status",
]  # fmt: skip
# A row's identity: a row merged again with the same key replaces the older one.
ROW_KEY = ("timestamp", "device", "benchmark", "case", "routing", "dtype", "op", "impl")

# Mixtral 8x7B, Qwen3-30B-A3B, DeepSeek-V3 per rank (EP=8): (E, H, F, top_k), the anchor
# shapes of the targets in docs/benchmarks.md.
ANCHOR_SHAPES = {
    "mixtral": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3-rank": (32, 7168, 2048, 8),
}
QUICK_SHAPES = {"tiny": (4, 64, 96, 2)}


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few reps (smoke test)")
    parser.add_argument("--no-append", action="store_true", help="do not write to the CSV")
    parser.add_argument("--csv", default=DEFAULT_CSV, help="results file to append to")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts T")
    parser.add_argument("--shapes", nargs="*", default=None, help="subset of shape names")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick)")
    if args.reps is None:
        args.reps = 3 if args.quick else 20
    if args.tokens is None:
        args.tokens = [64] if args.quick else [8192, 16384]
    return args


def shapes_for(args: argparse.Namespace) -> dict[str, tuple[int, int, int, int]]:
    table = QUICK_SHAPES if args.quick else ANCHOR_SHAPES
    if args.shapes:
        unknown = set(args.shapes) - set(table)
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; allowed: {sorted(table)}")
        table = {k: v for k, v in table.items() if k in args.shapes}
    return table


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA, or on CPU only under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Timer:
    """Median milliseconds of fn() over reps, after warm-up, with an L2 flush per rep."""

    def __init__(self, device: torch.device, reps: int, warmup: int | None = None):
        self.device = device
        self.reps = reps
        self.warmup = warmup if warmup is not None else (1 if device.type == "cpu" else 5)
        self._flush = (
            torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
            if device.type == "cuda"
            else None
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            for _ in range(self.reps):
                self._flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbs(timer: Timer, quick: bool) -> float:
    """Measured device copy bandwidth (read + write bytes / time): the HBM ceiling."""
    numel = (16 if quick else 1024) * 1024 * 1024 // 4
    src = torch.empty(numel, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def dense_tflops(timer: Timer, rows: int, k_dim: int, m_dim: int, dtype: torch.dtype) -> float:
    """A plain matmul with the same FLOPs as the grouped GEMM: the compute ceiling."""
    a = torch.randn(rows, k_dim, device=timer.device, dtype=dtype)
    b = torch.randn(k_dim, m_dim, device=timer.device, dtype=dtype)
    ms = timer(lambda: a @ b)
    return 2 * rows * k_dim * m_dim / (ms * 1e-3) / 1e12


@dataclass
class Routing:
    """Expert-sorted layout of T tokens' top-k choices (N = T*K rows, all real)."""

    ids_TK: torch.Tensor
    counts_E: torch.Tensor
    offs_E: torch.Tensor  # int32 cumulative ends
    src_N: torch.Tensor  # token of each sorted row
    dest_TK: torch.Tensor  # sorted row of each (token, slot)


def make_routing(num_tokens: int, num_experts: int, top_k: int, skew: str, device,
                 seed: int = 0) -> Routing:  # fmt: skip
    """uniform: every expert equally likely; zipf: p(e) ~ 1/(e+1)^1.2, k distinct per token."""
    gen = torch.Generator().manual_seed(seed)
    if skew == "uniform":
        probs_E = torch.ones(num_experts)
    elif skew == "zipf":
        probs_E = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    else:
        raise ValueError(f"unknown routing {skew!r}; allowed: uniform, zipf")
    probs_TE = probs_E.float().expand(num_tokens, num_experts)
    ids_TK = torch.multinomial(probs_TE, top_k, replacement=False, generator=gen)
    flat = ids_TK.flatten()
    order = torch.sort(flat, stable=True).indices
    dest = torch.empty_like(order)
    dest[order] = torch.arange(order.numel())
    counts_E = torch.bincount(flat, minlength=num_experts)
    return Routing(
        ids_TK=ids_TK.to(device),
        counts_E=counts_E.to(device),
        offs_E=counts_E.cumsum(0).to(torch.int32).to(device),
        src_N=(order // top_k).to(device),
        dest_TK=dest.view(num_tokens, top_k).to(device),
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def git_head(cwd: str | os.PathLike[str], length: int | None = None) -> str | None:
    """The short HEAD of the git checkout at ``cwd`` (``length`` digits, git's default
    when None), or None where there is no git or no checkout."""
    short = "--short" if length is None else f"--short={length}"
    try:
        out = subprocess.run(["git", "rev-parse", short, "HEAD"], cwd=cwd,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str:
    """MOETRAIN_COMMIT if set (a copy of the tree without .git, as on the GPU machine),
    else the checkout's short HEAD, else "unknown"."""
    if os.environ.get("MOETRAIN_COMMIT"):
        return os.environ["MOETRAIN_COMMIT"]
    return git_head(REPO) or "unknown"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def run_meta(benchmark: str, device: torch.device) -> dict[str, str]:
    """The columns every row of one run shares: when, where, which versions and commit."""
    return {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version(),
        "commit": git_commit(),
        "benchmark": benchmark,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


class Results:
    """Collects rows, prints them as they come, appends them to the CSV at the end."""

    def __init__(self, benchmark: str, device: torch.device):
        self.benchmark = benchmark
        self.meta = run_meta(benchmark, device)
        self.rows: list[dict] = []
        self._written = 0
        print(f"# {benchmark} on {self.meta['device']}, torch {self.meta['torch']}, "
              f"triton {self.meta['triton']}, commit {self.meta['commit']}")  # fmt: skip

    def add(self, *, case: str, routing: str, dtype: torch.dtype | str, op: str, impl: str,
            ms: float | None = None, tflops: float | None = None, gbs: float | None = None,
            ceiling: float | None = None, value: float | None = None, unit: str = "",
            status: str = "ok") -> dict:  # fmt: skip
        """One row. ratio_ceiling = (tflops or gbs) / ceiling; value/unit hold any other
        figure (tokens/s, MFU, GiB, a loss difference, a test count)."""
        figure = tflops if tflops is not None else gbs
        ratio = figure / ceiling if (figure is not None and ceiling) else None
        row = {
            **self.meta, "case": case, "routing": routing,
            "dtype": str(dtype).replace("torch.", ""), "op": op, "impl": impl,
            "ms": _fmt(ms, ".4f"), "tflops": _fmt(tflops, ".4g"), "gbs": _fmt(gbs, ".4g"),
            "ratio_ceiling": _fmt(ratio, ".3f"), "peer": "", "ratio_peer": "",
            "value": _fmt(value, ".6g"), "unit": unit, "status": status,
        }  # fmt: skip
        self.rows.append(row)
        value_text = f"{value:.6g} {unit}" if value is not None else ""
        if tflops is not None:
            fig = f"{tflops:8.2f} TFLOP/s"
        elif gbs is not None:
            fig = f"{gbs:8.1f} GB/s"
        else:
            fig, value_text = value_text, ""
        ms_text = f"{ms:9.3f} ms" if ms is not None else " " * 12
        extra = f"  ({ratio:.0%} of ceiling)" if ratio is not None else ""
        flag = "" if status == "ok" else f"  [{status}]"
        if value_text:
            extra += f"  {value_text}"
        print(f"{case:18s} {routing:8s} {op:8s} {impl:10s} {ms_text} {fig}{extra}{flag}")
        return row

    def ratio(self, case: str, routing: str, op: str, impl: str, peer: str,
              record: bool = False) -> float | None:  # fmt: skip
        """impl's speed-up over a peer measured in this run (peer time / impl time), printed;
        with record=True also stored in impl's row (peer, ratio_peer)."""
        rows = {
            r["impl"]: r
            for r in self.rows
            if r["case"] == case and r["routing"] == routing and r["op"] == op and r["ms"]
        }
        if impl not in rows or peer not in rows or float(rows[impl]["ms"]) <= 0:
            return None
        speedup = float(rows[peer]["ms"]) / float(rows[impl]["ms"])
        print(f"{'':18s} {routing:8s} {op:8s} {impl} vs {peer}: {speedup:.3g}x")
        if record:
            rows[impl]["peer"] = peer
            rows[impl]["ratio_peer"] = f"{speedup:.3f}"
        return speedup

    def write(self, path: str, append: bool) -> None:
        """Append the rows not written yet. Benchmarks call it after every case, so that a
        run killed at its time budget keeps what it measured."""
        rows = self.rows[self._written :]
        self._written = len(self.rows)
        if not append or not rows:
            return
        append_rows(path, rows)
        print(f"appended {len(rows)} rows to {path}")


def append_rows(path: str, rows: list[dict], fields: list[str] | None = None) -> None:
    """Append rows to a CSV of ``fields`` (default CSV_FIELDS), writing the header when the
    file is new."""
    fields = CSV_FIELDS if fields is None else fields
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new_file = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new_file:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:  # an older schema: rewrite it in this one first
            if fields is CSV_FIELDS:
                rows = read_rows(path) + list(rows)
            else:
                with open(path, newline="") as f:
                    rows = list(csv.DictReader(f)) + list(rows)
            os.remove(path)
            new_file = True
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in rows)


def read_rows(path: str) -> list[dict]:
    """Rows of a results CSV, every CSV_FIELDS column present (blank where an older file
    lacks it). Raises ValueError when the header lacks the identity columns."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in ROW_KEY if k not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a benchmark results CSV (missing columns {missing})")
        return [{k: (r.get(k) or "") for k in CSV_FIELDS} for r in reader]
