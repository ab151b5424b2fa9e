"""Job configuration: one dataclass per section, loaded from YAML plus dotted overrides.

The dataclasses are the source of truth for every key (``docs/config.md`` lists them).
Every field has a docstring; each section validates its own fields in ``validate()``, and
``JobConfig.validate()`` checks what spans sections. All of it runs before any model,
dataset or process group is built, and every error names the key and what is allowed.

The package in three parts, each importing only the one before it:

- the schema: one module per section (``model``, ``moe``, ``data``, ``optim``, ``train``
  with ``log``, ``parallel``) and ``job`` (``JobConfig``, ``flat_keys``); ``errors`` holds
  ``ConfigError``;
- ``resume``: the resume policy (``RESUME_KEYS``, ``resume_kind``, ``resume_changes``);
- ``loading``: YAML and overrides in, type checks, ``load_config``, ``config_to_yaml``.

Everything a caller needs is importable from ``moetrain.config`` itself.
"""

from moetrain.config.data import DataConfig
from moetrain.config.errors import ConfigError
from moetrain.config.job import JobConfig, flat_keys
from moetrain.config.loading import config_to_yaml, load_config, parse_overrides
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.optim import BF16_MOMENT_MAX_BETA, MUON_ONLY_KEYS, OptimConfig
from moetrain.config.parallel import V_SCHEDULES, ParallelConfig
from moetrain.config.resume import (
    RESUME_KEYS,
    ResumeChange,
    ResumeKind,
    resume_changes,
    resume_kind,
)
from moetrain.config.train import LogConfig, TrainConfig

__all__ = [
    "BF16_MOMENT_MAX_BETA",
    "MUON_ONLY_KEYS",
    "RESUME_KEYS",
    "V_SCHEDULES",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "LogConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "ResumeChange",
    "ResumeKind",
    "TrainConfig",
    "config_to_yaml",
    "flat_keys",
    "load_config",
    "parse_overrides",
    "resume_changes",
    "resume_kind",
]
