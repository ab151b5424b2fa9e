"""The GPU suite's driver: each part a subprocess under its own time budget, rows into one CSV.

    python tools/gpu_suite.py --out DIR [--parts tests,gemm] [--budget 590] [--dry]

Run it through tools/gpu_suite.sh, which first makes moetrain importable offline. Parts,
in order (default budget in seconds, sized from the first H100 run so that every default
part fits in under ten minutes; --dry: CPU, tiny shapes, Triton interpreter):

    tests    pytest tests/kernels compiled on the GPU (fp32 + bf16, the tolerance table),
             in parallel (-n) where pytest-xdist is installed, then `pytest -m gpu` over
             the other test folders; each failure's message written as it fails       (90)
    tiny     configs/tiny.yaml 50 steps, moe.kernels=triton vs torch, losses compared (45)
    gemm     grouped GEMM fwd/dgrad/wgrad, anchor shapes, uniform + Zipf            (90)
    router   fused router vs the unfused torch router, vs measured HBM copy         (25)
    permute  permute / unpermute vs the torch path, vs measured HBM copy            (25)
    layer    MoE layer time / its grouped GEMMs' time, with the breakdown (Mixtral,
             Qwen3-30B-A3B)                                                         (75)
    attention document-masked attention against causal SDPA                        (40)
    e2e      configs/gpu_1b.yaml, 20 steps a variant: triton and torch eager, triton
             compiled, MFU, memory, moetrain plan's step estimate beside each measured
             step (ARGS_E2E="--variants ..." for the others)                       (140)
    fp8      FP8 vs bf16 in one run: expert GEMMs on Mixtral's shape, a linear,
             configs/gpu_1b.yaml with train.fp8 none / tensorwise / rowwise         (50)
    peer     (only when named) MegaBlocks' grouped_gemm built from its sdist in .whl/, in
             the background while tests/tiny run                                  (420)

A part gets min(its budget, what is left of --budget); one that cannot get 20 s is skipped.
BUDGET_<PART>=seconds overrides a part's budget and ARGS_<PART>="..." appends arguments to
its (last) command, e.g. ARGS_GEMM="--shapes deepseek-v3-rank" to re-run one shape.
Each part writes CSV rows (tools/bench_common.CSV_FIELDS) and a log; the suite adds a row
per part (benchmark "suite": status ok / fail / timeout / skipped, seconds). Under --out,
rewritten after every part so that an outer kill loses only the part in flight:

    results.csv    every row (merge with tools/merge_gpu_results.py)
    summary.txt    one line per part, and the headline figures
    logs.tar.gz    per-part logs, pytest output, profiler tables, loss curves
    suite.log      (written by gpu_suite.sh and appended here) everything printed
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

REPO = bc.REPO
PY = sys.executable
PEER_DIR = "/tmp/moetrain_peer"
MIN_PART_S = 20
# A dry run's parts take the GPU budgets times this: the Triton interpreter on a (shared) CPU
# is slower than the GPU at the tiny shapes it runs; --budget still caps the whole run.
DRY_BUDGET_SCALE = 4.0
RESERVE_S = 10  # kept back for packing the outputs
MAX_TAR_BYTES = 15 * 1024 * 1024
TIMED_PARTS = ("gemm", "router", "permute", "layer", "e2e", "fp8")


@dataclass
class Part:
    name: str
    budget: int
    commands: Callable[[argparse.Namespace, str, str, float], list[list[str]]]
    """(args, part csv, log dir, seconds granted) -> the commands to run, in order."""


def _tool(name: str) -> list[str]:
    return [PY, os.path.join(REPO, "tools", name)]


def xdist_workers() -> int:
    """Processes for `pytest -n` (0: pytest-xdist is not installed, run serially)."""
    if importlib.util.find_spec("xdist") is None:
        return 0
    return max(1, min(8, os.cpu_count() or 1))


def pytest_command(targets: list[str], workers: int | None = None) -> list[str]:
    """pytest with every outcome and each failure's message written as it happens
    (tools/pytest_live_failures.py: a part killed at its budget keeps what failed and why),
    in parallel over `workers` processes when pytest-xdist is there."""
    workers = xdist_workers() if workers is None else workers
    cmd = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_live_failures",
           "--tb=short", "--timeout=300"]  # fmt: skip
    if workers > 1:
        cmd += ["-n", str(workers)]
    elif importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "0"]  # the repository's addopts would start a worker per CPU
    return cmd + targets


def _tests(args, csv_path, log_dir, budget):
    if args.dry:
        return [pytest_command(["tests/kernels/test_kernels_api.py"], workers=0)]
    return [pytest_command(["tests/kernels"]),
            pytest_command(["-m", "gpu", "tests", "--ignore=tests/kernels"])]  # fmt: skip


def _tiny(args, csv_path, log_dir, budget):
    dev = ["--device", "cpu", "--quick"] if args.dry else ["--device", "cuda"]
    return [_tool("compare_kernel_paths.py") + dev + ["--csv", csv_path, "--log-dir", log_dir]]


def _bench(script, gpu_args):
    def commands(args, csv_path, log_dir, budget):
        dev = gpu_args
        if args.dry:
            dev = ["--device", "cpu", "--quick"]
            # e2e: one warm-up, one timed and one profiled step a variant (the interpreter
            # runs the Triton ones at seconds a step); the others: one repetition.
            dev += ["--steps", "2"] if script == "bench_e2e.py" else ["--reps", "1"]
        extra = ["--log-dir", log_dir] if script in ("bench_moe_layer.py", "bench_e2e.py") else []
        if script in ("bench_e2e.py", "bench_fp8.py"):  # they skip what would not fit
            extra += ["--budget-s", f"{max(budget - 30, 10):.0f}"]
        return [_tool(script) + dev + ["--csv", csv_path] + extra]

    return commands


def _attention(args, csv_path, log_dir, budget):
    """Document-masked attention (SDPA with a mask, FlexAttention) against causal SDPA."""
    dev = ["--device", "cpu", "--quick"] if args.dry else [
        "--device", "cuda", "--seq", "2048", "8192", "--docs", "8", "--batch", "2",
        "--heads", "16", "--head-dim", "128", "--repeats", "10"]  # fmt: skip
    return [_tool("bench_attention.py") + dev + ["--csv", csv_path]]


E2E_GPU = ["--steps", "20", "--warmup", "5", "--variants", "triton/eager", "torch/eager",
           "triton/compile"]  # fmt: skip
PARTS = {
    p.name: p
    for p in [
        Part("tests", 90, _tests),
        Part("tiny", 45, _tiny),
        Part("gemm", 90, _bench("bench_grouped_gemm.py", ["--tokens", "16384", "--reps", "10"])),
        Part("router", 25, _bench("bench_router.py", ["--reps", "10"])),
        Part("permute", 25, _bench("bench_permutation.py", ["--tokens", "16384", "--reps", "10"])),
        Part("layer", 75, _bench("bench_moe_layer.py", ["--tokens", "16384", "--reps", "10",
                                                        "--shapes", "mixtral",
                                                        "qwen3-30b-a3b"])),
        Part("attention", 40, _attention),
        Part("e2e", 140, _bench("bench_e2e.py", E2E_GPU)),
        Part("fp8", 50, _bench("bench_fp8.py", ["--tokens", "16384", "--reps", "10",
                                                "--shapes", "mixtral"])),
    ]
}  # fmt: skip
# The whole default suite: every part at its own budget, with room for the set-up and
# the packing of the outputs, within ten minutes of one H100 (the 2026-11-27 run measured
# gemm 85 s, router and permute 17 s each, two e2e variants 127 s, a compiled first step 41 s,
# 96 router/permute/benchmark tests 21 s on 8 xdist workers).
DEFAULT_BUDGET = sum(p.budget for p in PARTS.values()) + RESERVE_S
PEER_BUDGET = 420


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = args.out
        self.work = args.work
        self.log_dir = os.path.join(self.work, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        os.makedirs(self.out, exist_ok=True)
        self.log = open(os.path.join(self.out, "suite.log"), "a", buffering=1)
        self.start = time.monotonic()
        self.rows: list[dict] = []
        self.summary: list[str] = []
        self.meta = _suite_meta(args.dry)
        self.peer: subprocess.Popen | None = None
        self.peer_deadline = 0.0
        self.peer_started = 0.0

    # ---------------------------------------------------------------- output

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def env(self, part: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Autotune results cached on disk: later processes (and calls on a warm machine)
        # reuse them; the chosen configs are printed for the tuning notes.
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        env.setdefault("TRITON_PRINT_AUTOTUNING", "1")
        if self.args.dry:
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)  # compiled kernels, never the interpreter
        if part == "tests":
            # tools/ on the path: pytest loads the live-failures plugin from there.
            tools = os.path.dirname(os.path.abspath(__file__))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), tools) if p)
            # Correctness runs tune nothing (first config only; the benchmarks check the
            # tuned configs against torch._grouped_mm on the anchor shapes).
            env.setdefault("MOETRAIN_TEST_AUTOTUNE", os.environ.get("AUTOTUNE_TESTS", "first"))
        if os.path.isdir(os.path.join(PEER_DIR, "grouped_gemm")):
            env["PYTHONPATH"] = env.get("PYTHONPATH", "") + os.pathsep + PEER_DIR
        return env

    def suite_row(self, part: str, status: str, seconds: float, note: str = "") -> None:
        row = {k: "" for k in bc.CSV_FIELDS}
        row.update(self.meta)
        row.update(case=part, routing="-", dtype="-", op="status", impl="gpu_suite",
                   ms=f"{seconds * 1e3:.0f}", value=f"{seconds:.1f}", unit=note or "s",
                   status=status)  # fmt: skip
        self.rows.append(row)
        self.summary.append(f"{part:8s} {status:8s} {seconds:6.0f} s  {note}")

    def flush_outputs(self) -> None:
        """results.csv, summary.txt, logs.tar.gz: rewritten whole after every part."""
        path = os.path.join(self.out, "results.csv")
        tmp = path + ".tmp"
        if os.path.exists(tmp):
            os.remove(tmp)
        bc.append_rows(tmp, self.rows)
        os.replace(tmp, path)
        with open(os.path.join(self.out, "summary.txt"), "w") as f:
            f.write(f"{self.meta['device']}, torch {self.meta['torch']}, triton "
                    f"{self.meta['triton']}, commit {self.meta['commit']}\n")  # fmt: skip
            f.write("\n".join(self.summary) + "\n\n" + "\n".join(headlines(self.rows)) + "\n")
        self._tar()

    def _tar(self) -> None:
        files = sorted(glob.glob(os.path.join(self.log_dir, "**", "*"), recursive=True))
        files = [f for f in files if os.path.isfile(f)]
        total, kept = 0, []
        for f in sorted(files, key=os.path.getsize):  # smallest first: drop the largest
            total += os.path.getsize(f)
            if total > MAX_TAR_BYTES * 4:  # text compresses ~4x or better
                self.say(f"# logs.tar.gz: left out {os.path.relpath(f, self.log_dir)}")
                continue
            kept.append(f)
        path = os.path.join(self.out, "logs.tar.gz")
        with tarfile.open(path + ".tmp", "w:gz") as tar:
            for f in kept:
                tar.add(f, arcname=os.path.join("logs", os.path.relpath(f, self.log_dir)))
        os.replace(path + ".tmp", path)

    # ---------------------------------------------------------------- running

    def remaining(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def run_command(self, cmd: list[str], env: dict, log_path: str, deadline: float) -> str:
        """Run cmd, its output to the log, the console and suite.log; 'ok', 'fail' or
        'timeout' (the whole process group is killed at the deadline)."""
        self.say(f"$ {' '.join(cmd)}")
        with open(log_path, "a", buffering=1) as log:
            log.write(f"$ {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    start_new_session=True)  # fmt: skip

            def pump():
                for line in proc.stdout:
                    log.write(line)
                    self.log.write(line)
                    sys.stdout.write(line)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                reader.join(timeout=5)
                self.say(f"# TIMEOUT after the part's budget: {' '.join(cmd[:3])}")
                return "timeout"
            reader.join(timeout=5)
        return "ok" if proc.returncode == 0 else f"fail (rc {proc.returncode})"

    def run_part(self, part: Part) -> None:
        own = float(os.environ.get(f"BUDGET_{part.name.upper()}", part.budget))
        scale = self.args.budget_scale * (DRY_BUDGET_SCALE if self.args.dry else 1.0)
        budget = min(own * scale, self.remaining() - RESERVE_S)
        if budget < MIN_PART_S:
            self.say(f"== part {part.name}: skipped ({self.remaining():.0f} s left)")
            self.suite_row(part.name, "skipped", 0.0, "not enough of the suite budget left")
            return
        if part.name in TIMED_PARTS:
            self.wait_peer()  # no background build while timing
        self.say(f"== part {part.name}: budget {budget:.0f} s")
        start = time.monotonic()
        deadline = start + budget
        csv_path = os.path.join(self.work, f"{part.name}.csv")
        log_path = os.path.join(self.log_dir, f"{part.name}.log")
        status = "ok"
        commands = part.commands(self.args, csv_path, self.log_dir, budget)
        commands[-1] += shlex.split(os.environ.get(f"ARGS_{part.name.upper()}", ""))
        for cmd in commands:
            result = self.run_command(cmd, self.env(part.name), log_path, deadline)
            if result != "ok" and not (part.name == "tests" and result == "fail (rc 5)"):
                status = result  # rc 5: pytest collected no test (no gpu mark outside kernels)
            if result == "timeout":
                break
        try:
            rows = bc.read_rows(csv_path)
        except ValueError as exc:
            rows = []
            self.say(f"# {exc}")
        if part.name == "tests":
            rows = pytest_rows(log_path, self.meta)
        self.rows.extend(rows)
        seconds = time.monotonic() - start
        bad = [r for r in rows if r["status"] in ("mismatch", "fail")]
        note = f"{len(rows)} rows" + (f", {len(bad)} failing" if bad else "")
        if bad and status == "ok":
            status = "fail"
        self.suite_row(part.name, status.split(" ")[0], seconds, note)
        self.say(f"== part {part.name}: {status} in {seconds:.0f} s, {note}")
        self.flush_outputs()

    # ---------------------------------------------------------------- the MegaBlocks peer

    def start_peer(self) -> None:
        sdists = sorted(glob.glob(os.path.join(REPO, ".whl", "grouped_gemm-*.tar.gz")))
        if os.path.isdir(os.path.join(PEER_DIR, "grouped_gemm")):
            self.say("== peer: grouped_gemm already built in " + PEER_DIR)
            return
        if not sdists or self.args.dry:
            self.say("== peer: no .whl/grouped_gemm-*.tar.gz (or dry run): MegaBlocks peer absent")
            self.suite_row("peer", "skipped", 0.0, "no grouped_gemm sdist in .whl/")
            return
        env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0", GROUPED_GEMM_CUTLASS="1",
                   MAX_JOBS=str(os.cpu_count() or 8))  # fmt: skip
        cmd = [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--no-cache-dir", "--target", PEER_DIR, sdists[-1]]  # fmt: skip
        self.say(f"== peer: building {os.path.basename(sdists[-1])} in the background "
                 f"(budget {PEER_BUDGET} s): {' '.join(cmd)}")  # fmt: skip
        log = open(os.path.join(self.log_dir, "peer.log"), "w")
        self.peer = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self.peer_started = time.monotonic()
        self.peer_deadline = self.peer_started + min(PEER_BUDGET, self.remaining() - RESERVE_S)

    def wait_peer(self) -> None:
        if self.peer is None:
            return
        try:
            self.peer.wait(timeout=max(self.peer_deadline - time.monotonic(), 1))
            status = "ok" if self.peer.returncode == 0 else f"fail (rc {self.peer.returncode})"
        except subprocess.TimeoutExpired:
            _kill_group(self.peer)
            status = "timeout"
        built = os.path.isdir(os.path.join(PEER_DIR, "grouped_gemm"))
        if status == "ok" and not built:
            status = "fail (nothing installed)"
        seconds = time.monotonic() - self.peer_started
        self.say(f"== peer: {status} in {seconds:.0f} s (log: logs/peer.log)")
        self.suite_row("peer", status.split(" ")[0], seconds, "grouped_gemm build")
        self.peer = None

    def run(self, names: list[str]) -> int:
        self.say(f"== gpu_suite: parts {','.join(names)}, budget {self.args.budget:.0f} s, "
                 f"{'DRY RUN on CPU' if self.args.dry else 'GPU'}")  # fmt: skip
        if "peer" in names:
            self.start_peer()
        for name in names:
            if name != "peer":
                self.run_part(PARTS[name])
        self.wait_peer()
        self.flush_outputs()
        self.say("\n== summary (" + os.path.join(self.out, "summary.txt") + ")")
        with open(os.path.join(self.out, "summary.txt")) as f:
            self.say(f.read())
        parts = [r for r in self.rows if r["benchmark"] == "suite" and r["op"] == "status"]
        return 0 if all(r["status"] in ("ok", "skipped") for r in parts) else 1


def _suite_meta(dry: bool) -> dict[str, str]:
    """bench_common.run_meta, read in a child process: naming the GPU creates a CUDA
    context, which this long-lived driver should not hold while the parts run."""
    import json

    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]); import bench_common as bc; "
        "dev = torch.device('cuda' if torch.cuda.is_available() and sys.argv[2] == '0' "
        "else 'cpu'); print(json.dumps(bc.run_meta('suite', dev)))"
    )
    tools = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([PY, "-c", code, tools, "1" if dry else "0"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# `pytest -v` result lines: "nodeid OUTCOME" serially, "[gwN] [ 4%] OUTCOME nodeid" under
# xdist; and the live-failures plugin's "LIVE OUTCOME nodeid (phase)", preferred when present.
_PYTEST_LINE = re.compile(r"^(\S+::\S+(?:\[.*?\])?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
_XDIST_LINE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) "
                         r"(\S+::\S+(?:\[.*?\])?)")  # fmt: skip
_LIVE_LINE = re.compile(r"^LIVE (PASSED|FAILED|SKIPPED|ERROR) (\S+::\S+(?:\[.*?\])?) \(")


def pytest_rows(log_path: str, meta: dict) -> list[dict]:
    """Rows from the pytest output (what ran before a timeout counts too): per invocation
    the passed / failed / skipped / error counts, and one row per failing test."""
    rows: list[dict] = []
    if not os.path.exists(log_path):
        return rows
    # Per invocation: (target, results from -v lines, results from LIVE lines).
    blocks: list[tuple[str, list[tuple[str, str]], list[tuple[str, str]]]] = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith("$ ") and " pytest " in line:
                words = line.split()
                words = words[words.index("pytest") + 1 :]
                kept, skip_next = [], False
                for w in words:
                    if skip_next:
                        skip_next = False
                    elif w in ("-p", "-n"):
                        skip_next = True
                    elif w != "-v" and not w.startswith(("--timeout", "--tb")):
                        kept.append(w)
                blocks.append(("pytest " + " ".join(kept), [], []))
                continue
            if not blocks:
                continue
            if m := _LIVE_LINE.match(line):
                blocks[-1][2].append((m.group(2), m.group(1)))
            elif m := _PYTEST_LINE.match(line):
                blocks[-1][1].append((m.group(1), m.group(2)))
            elif m := _XDIST_LINE.match(line):
                blocks[-1][1].append((m.group(2), m.group(1)))
    for target, verbose, live in blocks:
        results = _dedup(live) if live else verbose
        counts = {k: 0 for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
        for _, outcome in results:
            key = {"XFAIL": "SKIPPED", "XPASS": "PASSED"}.get(outcome, outcome)
            counts[key] += 1
        failed = counts["FAILED"] + counts["ERROR"]
        case = target
        for op, n in counts.items():
            rows.append(_row(meta, "correctness", case, op.lower(), n, "tests",
                             "fail" if failed else "ok"))  # fmt: skip
        for nodeid, outcome in results:
            if outcome in ("FAILED", "ERROR"):
                rows.append(_row(meta, "correctness", nodeid, outcome.lower(), 1, "test", "fail"))
    return rows


def _dedup(results: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One outcome per test from the plugin's per-phase lines: a failure or an error in any
    phase wins over the call's pass (a teardown error after a passing call)."""
    rank = {"ERROR": 3, "FAILED": 2, "SKIPPED": 1, "PASSED": 0}
    best: dict[str, str] = {}
    for nodeid, outcome in results:
        if nodeid not in best or rank[outcome] > rank[best[nodeid]]:
            best[nodeid] = outcome
    return list(best.items())


def _row(meta: dict, bench: str, case: str, op: str, value: float, unit: str,
         status: str) -> dict:  # fmt: skip
    row = {k: "" for k in bc.CSV_FIELDS}
    row.update(meta)
    row.update(benchmark=bench, case=case, routing="-", dtype="-", op=op, impl="pytest",
               value=str(value), unit=unit, status=status)  # fmt: skip
    return row


def headlines(rows: list[dict]) -> list[str]:
    """The figures a reader wants first: correctness, and each benchmark's key ratios."""
    out = []
    for r in rows:
        b, op, impl = r["benchmark"], r["op"], r["impl"]
        if b == "correctness" and impl == "pytest" and op in ("passed", "failed", "error"):
            out.append(f"{b:12s} {r['case']}: {op} {r['value']}")
        elif b == "kernel_paths" and op == "max_abs_loss_diff":
            out.append(f"{b:12s} {r['case']}: max |dloss| {r['value']} {r['unit']} "
                       f"[{r['status']}]")  # fmt: skip
        elif b in ("grouped_gemm", "router", "permute") and impl == "triton" and r["ratio_peer"]:
            if op in ("fwd", "wgrad", "dgrad", "fwd+bwd", "permute_fwd", "unpermute_fwd"):
                out.append(f"{b:12s} {r['case']} {r['routing']} {op}: {r['tflops'] or r['gbs']}"
                           f" ({r['ratio_ceiling']} of ceiling, {r['ratio_peer']}x "
                           f"{r['peer']}) [{r['status']}]")  # fmt: skip
        elif b == "moe_layer" and op in ("layer/gemms", "host_syncs"):
            out.append(f"{b:12s} {r['case']} {impl} {op}: {r['value']}")
        elif b == "e2e" and op in ("mfu", "tokens_per_s", "mem_ratio", "plan_step"):
            out.append(f"{b:12s} {r['case']} {impl} {op}: {r['value']} [{r['status']}]")
        elif b == "fp8_gemm" and r["ratio_peer"]:
            out.append(f"{b:12s} {r['case']} {op} {impl}: {r['tflops']} TFLOP/s, "
                       f"{r['ratio_peer']}x {r['peer']} [{r['status']}]")  # fmt: skip
        elif b == "fp8_e2e" and op in ("speedup_vs_bf16", "tokens_per_s", "final_loss"):
            out.append(f"{b:12s} {r['case']} {impl} {op}: {r['value']} [{r['status']}]")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.csv, logs.tar.gz, ...")
    parser.add_argument("--work", default=None, help="scratch folder (logs before packing)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}, peer (default: all "
                        "but peer)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=float(DEFAULT_BUDGET),
                        help=f"seconds for all parts (default {DEFAULT_BUDGET})")  # fmt: skip
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every part's own budget")  # fmt: skip
    parser.add_argument("--dry", action="store_true", help="CPU dry run (tiny shapes)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS and n != "peer"]
    if unknown:
        parser.error(f"unknown parts {unknown}; allowed: {', '.join(PARTS)}, peer")
    if args.work is None:
        import tempfile

        args.work = tempfile.mkdtemp(prefix="moetrain_suite.")
    return Suite(args).run(names)


if __name__ == "__main__":
    sys.exit(main())
