"""A sweep file, read: its runs (variant x seed), each a validated ``JobConfig``.

The format is ``moetrain ablate``'s (``moetrain.ablation.runner``); every run must train the
same number of tokens, so variants are compared at equal tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moetrain.config import ConfigError, JobConfig, load_config

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


def fmt_value(value: Any) -> str:
    """A value as a sweep's tables and run names print it (YAML spelling of null/bools)."""
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
            name = ",".join(f"{short[k]}={fmt_value(v)}" for k, v in varied.items())
            variants.append((name, varied))
    for i, item in enumerate(spec.get("variants") or []):
        if not isinstance(item, dict):
            raise ConfigError(f"sweep.variants[{i}]: expected a mapping of dotted keys")
        item = dict(item)
        name = item.pop("name", None)
        varied = _dotted(item, f"sweep.variants[{i}]")
        if name is None:
            short = _short_names(list(varied))
            name = ",".join(f"{short[k]}={fmt_value(v)}" for k, v in varied.items()) or "base"
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

