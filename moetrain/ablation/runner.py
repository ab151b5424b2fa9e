"""Router ablation sweeps: a grid of router variants, each trained on the same data order
over one or more seeds, collected into one table with means, intervals and differences.

    moetrain ablate configs/sweeps/router.yaml [--parallel N] [--out DIR] [key=value ...]

A sweep file names a base experiment, overrides shared by every run, and the variants: the
cartesian product of ``grid`` and/or a list of named ``variants``; optionally the seeds every
variant runs with and the variant the others are compared with::

    base: ../tiny.yaml            # relative to the sweep file
    output_dir: outputs/sweeps/router
    overrides:                    # every run (dotted keys, as on the command line)
      train.steps: 60
    grid:
      moe.score_func: [softmax, sigmoid]
      moe.top_k: [1, 2]
    variants:
      - {name: cf1-position, moe.capacity_factor: 1.0, moe.drop_policy: position}
    seeds: [0, 1, 2]              # train.seed of each run: init and router jitter vary,
                                  # the data order (data.seed) does not
    baseline: score_func=softmax,top_k=2   # default: the first variant

Each run trains in ``<output_dir>/runs/<name>`` (``runs/<name>/seed_<s>`` with seeds).
Finished runs are rows of ``<output_dir>/results.csv``; ``summary.csv`` has each variant's
mean, standard deviation and 95% interval over its seeds and its difference from the
baseline with that difference's interval (``moetrain.ablation.stats``); ``results.md`` shows them,
with ``results.png`` (means with error bars), ``differences.png`` and ``curves.png``
(``moetrain.ablation.report``). Every run must train the same number of tokens: variants are
compared at equal tokens, and the table states each one's active parameters and FLOPs per
token. Running the sweep again skips runs that have a row and re-runs the others, which
resume from their own checkpoints. ``--parallel N`` trains N runs at once in subprocesses
(their tokens/s then share the machine).

This lives in the package rather than ``tools/`` so that the installed ``moetrain`` command
can run it; it uses only the public API (``load_config``, ``Trainer``, the metrics
read-back), as a tool would.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from moetrain.ablation.report import COST, FIGURES, write_atomic, write_results
from moetrain.ablation.spec import RunSpec, Sweep, fmt_value, load_sweep, run_tokens
from moetrain.config import ConfigError, JobConfig, config_to_yaml, load_config

log = logging.getLogger("moetrain")

def run_one(cfg: JobConfig) -> dict[str, float]:
    """Train one run to the end (resuming from its checkpoints) and summarise it from its
    event files; ``eval_loss`` is the trainer's own final figure."""
    from moetrain.train.metrics import read_scalars, run_summary
    from moetrain.train.trainer import Trainer

    start = time.perf_counter()
    trainer = Trainer(cfg)
    summary = trainer.fit(finished_ok=True)  # a finished run whose row was lost: re-read
    out = run_summary(read_scalars(cfg.train.output_dir))
    out["eval_loss"] = float(summary["eval_loss"])
    out["active_params"] = float(trainer.n_active)
    out["flops_per_token"] = float(trainer.flops_per_token)
    out["tokens"] = float(run_tokens(cfg))
    out["seconds"] = time.perf_counter() - start
    return out


def child_main(config_path: str, result_path: str) -> int:
    """``python -m moetrain.ablate --run-one CONFIG RESULT``: what --parallel spawns."""
    from moetrain.train.runtime import setup_logging

    setup_logging()
    result = run_one(load_config(config_path))
    write_atomic(Path(result_path), json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- the sweep


def read_results(path: Path) -> dict[str, dict[str, str]]:
    """Rows of a results.csv by run key (``RunSpec.key``)."""
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {(r["run"] if not r.get("seed") else f"{r['run']}/seed_{r['seed']}"): r for r in rows}


def _row(run: RunSpec, result: dict[str, float]) -> dict[str, str]:
    row = {"run": run.name, "seed": "" if run.seed is None else str(run.seed),
           **{k: fmt_value(v) for k, v in run.varied.items()}}
    for key in (*FIGURES, *COST, "steps", "seconds"):
        value = result.get(key, float("nan"))
        row[key] = str(int(value)) if key == "steps" else repr(float(value))
    return row


def run_sweep(sweep: Sweep, parallel: int = 1) -> dict[str, dict[str, str]]:
    """Run every run that has no result row yet; return the rows by run name."""
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    (sweep.out_dir / "sweep.yaml").write_text(sweep.path.read_text())
    results_path = sweep.out_dir / "results.csv"
    known = {r.key for r in sweep.runs}
    rows = {key: row for key, row in read_results(results_path).items() if key in known}
    todo = [r for r in sweep.runs if r.key not in rows]
    log.info("sweep %s: %d runs, %d finished, %d to run%s", sweep.path.name, len(sweep.runs),
             len(rows), len(todo), f" ({parallel} at once)" if parallel > 1 and todo else "")
    if parallel <= 1:
        for run in todo:
            log.info("sweep: run %s (%s)", run.key, run.cfg.train.output_dir)
            rows[run.key] = _row(run, run_one(run.cfg))
            write_results(sweep, rows)
    else:
        _run_parallel(sweep, todo, parallel, rows)
    write_results(sweep, rows)
    return rows


def _run_parallel(sweep: Sweep, todo: list[RunSpec], parallel: int,
                  rows: dict[str, dict[str, str]]) -> None:
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // parallel)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    pending = list(todo)
    running: dict[str, tuple[RunSpec, subprocess.Popen, Path]] = {}
    failed = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                run = pending.pop(0)
                run_dir = Path(run.cfg.train.output_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
                cfg_path, result_path = run_dir / "sweep_run.yaml", run_dir / "result.json"
                cfg_path.write_text(config_to_yaml(run.cfg))
                result_path.unlink(missing_ok=True)
                with (run_dir / "train.log").open("a") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "moetrain.ablation", "--run-one", str(cfg_path),
                         str(result_path)], stdout=out, stderr=subprocess.STDOUT, env=env)
                log.info("sweep: started %s (pid %d)", run.key, proc.pid)
                running[run.key] = (run, proc, result_path)
            time.sleep(0.2)
            for name, (run, proc, result_path) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if proc.returncode == 0 and result_path.exists():
                    rows[name] = _row(run, json.loads(result_path.read_text()))
                    write_results(sweep, rows)
                    log.info("sweep: finished %s", name)
                else:
                    failed.append(name)
                    log.error("sweep: run %s failed (exit %s); see %s", name, proc.returncode,
                              Path(run.cfg.train.output_dir) / "train.log")
    finally:
        for _, proc, _ in running.values():
            proc.terminate()
    if failed:
        raise RuntimeError(f"sweep runs failed: {', '.join(failed)}; rerun the sweep to retry "
                           "them (finished runs are kept)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moetrain ablate",
        description="Run a router-ablation sweep (see configs/sweeps/ and docs/dashboards.md).")
    parser.add_argument("sweep", help="sweep YAML file")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (subprocesses)")
    parser.add_argument("--out", help="sweep output directory (default: the file's output_dir)")
    args = parser.parse_intermixed_args(argv)  # options and key=value in any order
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    from moetrain.train.runtime import setup_logging

    setup_logging()
    try:
        sweep = load_sweep(args.sweep, args.overrides, args.out)
    except ConfigError as exc:
        print(f"moetrain ablate: config error: {exc}", file=sys.stderr)
        return 2
    rows = run_sweep(sweep, args.parallel)
    print((sweep.out_dir / "results.md").read_text(), end="")
    log.info("sweep: %d rows in %s", len(rows), sweep.out_dir / "results.csv")
    return 0

