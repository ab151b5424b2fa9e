"""Small seeded sweeps rerun through ``moetrain ablate``'s machinery and compared with the
record of their outputs committed beside this file (``records/<name>_sweep.json``).

The sweeps behind docs/optim.md and docs/fp8.md (configs/sweeps/optim.yaml, fp8.yaml) take
hours; their committed CSVs cannot tell whether the code still computes what they say. These
sweeps are the same comparisons made small (a micro MoE, 4 steps, two seeds, on the golden
corpus of tests/golden_runs.py, which is the same bytes on every machine): the runner trains
every run, ``results.csv`` and ``curves.csv`` come out of the report code, and every per-run
eval loss and per-step train-loss mean and paired difference is held against its record. A
change of what the optimizer or the FP8 recipe computes moves them; a change that should
move them (a deliberate change of the arithmetic) rewrites the record, and its commit says
why:

    python tests/train/sweep_records.py [optim|fp8 ...]

Exact or bounded, as the golden curves: every run computes on ``ORACLE_THREADS`` intra-op
threads (tests/threads.py); in the record's environment (``golden_runs.environment``) every
figure must be equal bit for bit, elsewhere within ``BOUND``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records"
if str(HERE.parent) not in sys.path:  # run as a script: tests/ for threads.py, golden_runs.py
    sys.path.insert(0, str(HERE.parent))

from golden_runs import corpus, environment  # noqa: E402
from threads import one_thread  # noqa: E402

MICRO = {
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
              "max_seq_len": 32, "tie_embeddings": False},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "capacity_factor": 1.0,
            "token_group_seqs": 2, "jitter_eps": 0.01},
    "data": {"seq_len": 32, "format": "text"},
    "optim": {"warmup_steps": 1},
    "train": {"steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "eval_every": 4,
              "eval_batches": 1, "checkpoint_every": 0, "device": "cpu", "dtype": "fp32"},
    "log": {"log_every": 1, "progress_bar": False, "specialization": False,
            "heatmap_every": 0, "histogram_every": 0},
}  # fmt: skip
"""What every run of both sweeps shares: a micro MoE, 4 steps of 4 sequences of 32 tokens,
router jitter on (the seeds then differ in more than the initialisation), fp32."""

SWEEPS: dict[str, dict[str, Any]] = {
    "optim": {
        "overrides": MICRO,
        "variants": [{"name": "adamw", "optim.name": "adamw"},
                     {"name": "muon", "optim.name": "muon", "optim.lr": 1.0e-2,
                      "optim.muon_ns_dtype": "fp32"}],
        "seeds": [0, 1],
    },
    "fp8": {
        "overrides": MICRO,
        "variants": [{"name": "fp32", "train.fp8": "none"},
                     {"name": "fp8-tensorwise", "train.fp8": "tensorwise"},
                     {"name": "fp8-rowwise", "train.fp8": "rowwise"}],
        "seeds": [0, 1],
    },
}  # fmt: skip
"""configs/sweeps/optim.yaml and fp8.yaml, small: AdamW against Muon at its best lr of the
big sweep, and FP8 tensorwise and rowwise (emulated) against the run they sit on. Both on
fp32, Muon's Newton-Schulz included: bf16's roundings are the instruction set's (oneDNN's
bf16 kernels sum in other orders on other processors), which would leave the comparison
elsewhere a bound as wide as FP8's own effect on a micro model (measured with
``ATEN_CPU_CAPABILITY=default`` against AVX2: bf16 losses 2.5e-4 apart, FP8 - bf16
differences 2e-5 to 8e-4)."""

BOUND = {"optim": 1e-5, "fp8": 1e-4}
"""Absolute bound (nats) on every figure of a sweep where the environment differs from its
record's. Measured with the scalar kernels (``ATEN_CPU_CAPABILITY=default``) against this
machine's AVX2 ones: optim within 4.8e-7; fp8 within 4.5e-5 (FP8's roundings turn a last-bit
difference into a different rounding of some elements, and four steps amplify it). What the
planted changes of tests/faults.py move lies outside: ``muon_plain_momentum`` the third
step's mean train loss by 1.2e-4 and the eval losses by 1.4e-4 and 4.1e-4;
``fp8_tensorwise_grads_e4m3`` the third step's by 3.9e-4 and the eval losses by 4.0e-4 and
4.8e-4."""


def rerun(name: str, out_dir: str | Path, variants: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the sweep ``name`` (only its ``variants`` if given) into ``out_dir`` with
    ``moetrain ablate``'s runner; returns ``{"environment": ..., "figures": ...}``
    (``figures``)."""
    from moetrain.ablation import load_sweep, run_sweep

    out = Path(out_dir)
    text, tok = corpus(out / "data")
    data = {"dataset": str(text), "tokenizer": str(tok), "cache_dir": str(out / "cache")}
    spec = dict(SWEEPS[name])
    spec["overrides"] = {**spec["overrides"], "data": {**spec["overrides"]["data"], **data}}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep = load_sweep(path, out_dir=out / "sweep")
    if variants:
        sweep = dataclasses.replace(sweep, runs=[r for r in sweep.runs if r.name in variants])
    with one_thread():
        run_sweep(sweep)
    return {"environment": environment(), "figures": figures(sweep.out_dir, variants)}


def figures(sweep_dir: Path, variants: tuple[str, ...] = ()) -> dict[str, float]:
    """A sweep's outputs as ``{key: value}``: ``results <run>/seed_<s> eval_loss`` from
    results.csv, ``curves <run> step <n> train_loss_mean`` and ``... train_loss_diff_mean``
    (the paired difference from the baseline, when the baseline ran) from curves.csv."""
    out: dict[str, float] = {}
    with (sweep_dir / "results.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            out[f"results {row['run']}/seed_{row['seed']} eval_loss"] = float(row["eval_loss"])
    with (sweep_dir / "curves.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            cols = ("train_loss_mean",) if variants else ("train_loss_mean", "train_loss_diff_mean")
            for col in cols:
                out[f"curves {row['run']} step {row['step']} {col}"] = float(row[col])
    return out


def path_of(name: str) -> Path:
    return RECORDS / f"{name}_sweep.json"


def load(name: str) -> dict[str, Any]:
    return json.loads(path_of(name).read_text())


def save(name: str, record: dict[str, Any]) -> Path:
    RECORDS.mkdir(exist_ok=True)
    path_of(name).write_text(json.dumps({"sweep": name, **record}, indent=1) + "\n")
    return path_of(name)


def differences(got: dict[str, Any], want: dict[str, Any], exact: bool | None = None) -> list[str]:
    """Every figure of ``want`` that ``got`` lacks or has elsewhere, and every figure of
    ``got`` that ``want`` lacks, in ``want``'s order; empty when they agree. Bit for bit when
    both come from one environment (or ``exact``), else within ``BOUND``. A rerun of some
    variants (``rerun(variants=...)``) is compared on its own figures."""
    if exact is None:
        exact = got["environment"] == want["environment"]
    a, b = got["figures"], want["figures"]
    out = [f"{k}: not in the record" for k in a if k not in b]
    for key, value in b.items():
        if key not in a:
            continue
        bound = 0.0 if exact else BOUND[want["sweep"]]
        if a[key] != value and not math.isclose(a[key], value, rel_tol=0.0, abs_tol=bound):
            out.append(f"{key}: {a[key]!r}, recorded {value!r} ({a[key] - value:+.3g}, "
                       f"{'bit for bit' if exact else f'bound {bound:g}'})")  # fmt: skip
    return out


def missing(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The recorded figures a full rerun lacks."""
    return [k for k in want["figures"] if k not in got["figures"]]


if __name__ == "__main__":
    for sweep_name in sys.argv[1:] or list(SWEEPS):
        with tempfile.TemporaryDirectory() as tmp:
            print(save(sweep_name, rerun(sweep_name, tmp)))
