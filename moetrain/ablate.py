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
baseline with that difference's interval (``moetrain.stats``); ``results.md`` shows them,
with ``results.png`` (means with error bars), ``differences.png`` and ``curves.png``
(``moetrain.ablate_report``). Every run must train the same number of tokens: variants are
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
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moetrain.ablate_report import COST, FIGURES, write_results
from moetrain.config import ConfigError, JobConfig, config_to_yaml, load_config

log = logging.getLogger("moetrain")

# Every run of a sweep shares the data order; the runner owns the seeds and the output.
FIXED_KEYS = ("data.seed", "train.seed", "train.output_dir", "train.resume")
SWEEP_KEYS = ("base", "output_dir", "overrides", "grid", "variants", "seeds", "baseline")


@dataclass
class RunSpec:
    name: str
    """The variant's name."""
    varied: dict[str, Any]
    """The keys this run sets beyond the sweep's shared overrides."""
    cfg: JobConfig
    seed: int | None = None
    """train.seed of this run; None when the sweep has no ``seeds`` (the base config's)."""

    @property
    def key(self) -> str:
        """The run's id: its name, and its seed when the sweep has seeds."""
        return self.name if self.seed is None else f"{self.name}/seed_{self.seed}"


@dataclass
class Sweep:
    path: Path
    out_dir: Path
    runs: list[RunSpec]
    seeds: list[int] | None = None
    baseline: str = ""
    """The variant the others are compared with (default: the first)."""

    @property
    def varied_keys(self) -> list[str]:
        keys: list[str] = []
        for run in self.runs:
            keys += [k for k in run.varied if k not in keys]
        return keys

    @property
    def variants(self) -> list[str]:
        """Variant names in sweep order."""
        return list(dict.fromkeys(r.name for r in self.runs))


def _dotted(mapping: Any, where: str) -> dict[str, Any]:
    """Accept {"moe.top_k": 2}, {"moe": {"top_k": 2}} or ["moe.top_k=2"]; return flat keys."""
    if mapping is None:
        return {}
    if isinstance(mapping, list):
        out = {}
        for item in mapping:
            key, sep, raw = str(item).partition("=")
            if not sep:
                raise ConfigError(f"{where}: {item!r} is not key=value")
            out[key] = yaml.safe_load(raw)
        return out
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a mapping of dotted keys, got {mapping!r}")
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _dotted(value, f"{where}.{key}").items()})
        else:
            out[str(key)] = value
    return out


def _as_override(key: str, value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()
    return f"{key}={text}"


def _short_names(keys: list[str]) -> dict[str, str]:
    """The last part of each dotted key, or the whole key where two would clash."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last, strict=True)}


def _fmt_value(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_sweep(path: str | Path, overrides: list[str] | None = None,
               out_dir: str | Path | None = None) -> Sweep:
    """Read a sweep file and build and validate every run's config before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep: no such file {str(path)!r}")
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep: {path} must hold a mapping with {', '.join(SWEEP_KEYS)}")
    unknown = sorted(set(spec) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"sweep.{unknown[0]}: unknown key; a sweep has {', '.join(SWEEP_KEYS)}")
    base = spec.get("base")
    base_path = (path.parent / base) if base is not None else None
    shared = _dotted(spec.get("overrides"), "sweep.overrides")
    shared.update(_dotted(overrides or [], "command line"))

    grid = _dotted(spec.get("grid"), "sweep.grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{key}: expected a non-empty list of values")
    variants: list[tuple[str | None, dict[str, Any]]] = []
    if grid:
        keys = list(grid)
        short = _short_names(keys)
        for combo in itertools.product(*(grid[k] for k in keys)):
            varied = dict(zip(keys, combo, strict=True))
            name = ",".join(f"{short[k]}={_fmt_value(v)}" for k, v in varied.items())
            variants.append((name, varied))
    for i, item in enumerate(spec.get("variants") or []):
        if not isinstance(item, dict):
            raise ConfigError(f"sweep.variants[{i}]: expected a mapping of dotted keys")
        item = dict(item)
        name = item.pop("name", None)
        varied = _dotted(item, f"sweep.variants[{i}]")
        if name is None:
            short = _short_names(list(varied))
            name = ",".join(f"{short[k]}={_fmt_value(v)}" for k, v in varied.items()) or "base"
        variants.append((str(name), varied))
    if not variants:
        raise ConfigError("sweep: no runs; give a grid and/or variants")

    seeds = _seeds(spec.get("seeds"))
    root = Path(out_dir or spec.get("output_dir") or Path("outputs/sweeps") / path.stem)
    runs, seen = [], set()
    for name, varied in variants:
        bad = [k for k in (*varied, *shared) if k in FIXED_KEYS]
        if bad:
            raise ConfigError(f"sweep: {bad[0]} is set by the sweep runner (every run shares "
                              "the data order, takes its seed from sweep.seeds and gets its "
                              "own output_dir)")
        if name in seen or "/" in name or name in ("", ".", ".."):
            raise ConfigError(f"sweep: run name {name!r} is empty, repeated or has a '/'")
        seen.add(name)
        for seed in seeds or [None]:
            run_dir = root / "runs" / name
            run_dir = run_dir if seed is None else run_dir / f"seed_{seed}"
            over = [_as_override(k, v) for k, v in {**shared, **varied}.items()]
            over += [f"train.output_dir={run_dir}", "train.resume=auto", "log.tensorboard=true"]
            if seed is not None:
                over.append(f"train.seed={seed}")
            try:
                cfg = load_config(base_path, over)
            except ConfigError as exc:
                raise ConfigError(f"sweep run {name!r}: {exc}") from None
            runs.append(RunSpec(name, varied, cfg, seed))
    baseline = spec.get("baseline", variants[0][0])
    if baseline not in seen:
        raise ConfigError(f"sweep.baseline: {baseline!r} is not a variant of the sweep; it has "
                          f"{', '.join(sorted(seen))}")
    _check_equal_tokens(runs)
    return Sweep(path, root, runs, seeds, str(baseline))


def run_tokens(cfg: JobConfig) -> int:
    """Tokens a run trains: steps x global batch x sequence length."""
    return cfg.train.steps * cfg.train.global_batch_size * cfg.data.seq_len


def _check_equal_tokens(runs: list[RunSpec]) -> None:
    """Variants are compared at equal tokens: refuse a sweep whose runs train different
    numbers of tokens (a variant that wins by training more would look better)."""
    counts = {r.name: run_tokens(r.cfg) for r in runs}
    if len(set(counts.values())) > 1:
        (a, ta), (b, tb) = sorted(counts.items(), key=lambda kv: kv[1])[:: len(counts) - 1]
        raise ConfigError(f"sweep: runs train different numbers of tokens ({a!r}: {ta:,}, "
                          f"{b!r}: {tb:,}); variants are compared at equal tokens: keep "
                          "train.steps x train.global_batch_size x data.seq_len the same")


def _seeds(value: Any) -> list[int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value)):
        raise ConfigError(f"sweep.seeds: expected a non-empty list of seeds (integers >= 0), "
                          f"got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"sweep.seeds: {value} repeats a seed")
    return list(value)


# ----------------------------------------------------------------------------- one run


def run_one(cfg: JobConfig) -> dict[str, float]:
    """Train one run to the end (resuming from its checkpoints) and summarise it from its
    event files; ``eval_loss`` is the trainer's own final figure."""
    from moetrain.train.metrics import read_scalars, run_summary
    from moetrain.train.trainer import Trainer

    start = time.perf_counter()
    trainer = Trainer(cfg)
    summary = trainer.fit()
    out = run_summary(read_scalars(cfg.train.output_dir))
    out["eval_loss"] = float(summary["eval_loss"])
    out["active_params"] = float(trainer.n_active)
    out["flops_per_token"] = float(trainer.flops_per_token)
    out["tokens"] = float(run_tokens(cfg))
    out["seconds"] = time.perf_counter() - start
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _child_main(config_path: str, result_path: str) -> int:
    """``python -m moetrain.ablate --run-one CONFIG RESULT``: what --parallel spawns."""
    from moetrain.train.trainer import setup_logging

    setup_logging()
    result = run_one(load_config(config_path))
    _write_atomic(Path(result_path), json.dumps(result))
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
           **{k: _fmt_value(v) for k, v in run.varied.items()}}
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
                        [sys.executable, "-m", "moetrain.ablate", "--run-one", str(cfg_path),
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
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    from moetrain.train.trainer import setup_logging

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


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run-one":
        sys.exit(_child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
