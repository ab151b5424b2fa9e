"""What a resume may change: the checks a checkpoint's saved step and config go through
before its weights are read (``Trainer.maybe_resume``).

Which config keys a resume accepts changed, warns about or refuses is one table,
``RESUME_KEYS`` in moetrain/config/resume.py; docs/checkpoints.md is the user's version.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moetrain.config import ConfigError, JobConfig, resume_changes
from moetrain.train.checkpoint import CheckpointError

log = logging.getLogger("moetrain")


def check_resume_config(path: Path, saved: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse a resume whose config changes a key that changes what the model computes (or
    the data stream), unless ``train.resume_allow_changes`` lists it; log every change a
    resume accepts. Which key is which: ``RESUME_KEYS`` (moetrain/config/resume.py)."""
    if not isinstance(saved.get("config"), dict):
        return  # a checkpoint written without its config: nothing to compare
    changes = resume_changes(saved["config"], cfg)
    other = [c for c in changes if c.kind == "optimizer"]
    if other:
        raise ConfigError(
            f"train.resume: {path} was trained with another optimizer setup: "
            f"{'; '.join(map(str, other))} (checkpoint -> this run): {other[0].why}. Resume "
            f"with the checkpoint's values, or start a new run from its weights in another "
            f"train.output_dir (moetrain export-hf, then model.init_from); "
            f"train.resume_allow_changes cannot accept this"
        )
    allowed = set(cfg.train.resume_allow_changes)
    refused = [c for c in changes if c.kind == "function" and c.key not in allowed]
    if refused:
        keys = ", ".join(c.key for c in refused)
        raise ConfigError(
            f"train.resume: {path} was trained with other values of keys that change what the "
            f"model computes or the data it reads: {'; '.join(map(str, refused))} (checkpoint "
            f"-> this run). Resume with the checkpoint's values, start a new run in another "
            f"train.output_dir, or accept the change with train.resume_allow_changes=[{keys}]"
        )
    for c in changes:
        if c.kind == "saved":
            log.warning("resume: %s is not used: %s (to change it, start a new run)", c, c.why)
        elif c.kind == "function":
            log.warning("resume: %s accepted (train.resume_allow_changes): %s", c, c.why)
        else:
            log.info("resume: %s (%s)", c, c.why)


def refuse_weights_only(path: Path, extra: dict[str, Any]) -> None:
    """A checkpoint that ``moetrain import-hf`` wrote holds model weights only: resuming it
    would fail deep in DCP (no optimizer state). Say what to do instead."""
    if isinstance(extra, dict) and "source" in extra and "scheduler" not in extra:
        raise CheckpointError(
            f"train.resume: {path} holds only the weights that moetrain import-hf read from "
            f"{extra['source']} (no optimizer state), and is not resumed; train from them with "
            f"model.init_from: {extra['source']} and a train.output_dir of their own (the "
            "config.yaml import-hf wrote beside it does both)"
        )
