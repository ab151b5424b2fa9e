"""Where a run's first weights come from when not from its seed: a start.

``model.init_from`` / ``model.upcycle_from`` name a checkpoint of another framework. Reading
one is the interop layer's job, which sits above training (it uses the trainer's checkpoints),
so the trainer never imports it: the caller hands the trainer a start (``Trainer(cfg,
start=...)``), or the trainer finds the installed one through the package's entry points
(group ``moetrain.starts``; moetrain registers ``huggingface`` ->
``moetrain.interop.init:prepare_hf_start`` in pyproject.toml).

A start factory takes the job config, replaces its architecture with the checkpoint's and
checks it (before anything is built), and returns an object whose ``load(engine)`` reads the
weights into the engine's model, each rank only the slices it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from importlib.metadata import entry_points
from typing import Any, Protocol

from moetrain.config import ConfigError, JobConfig

GROUP = "moetrain.starts"


class Start(Protocol):
    def names(self) -> Collection[str]:
        """The full-model names ``load`` fills: the engine leaves their random
        initialisation out."""

    def load(self, engine: Any) -> None:
        """Read the start's weights into ``engine``'s model (every rank its own slices)."""


StartFactory = Callable[[JobConfig], Start]


def start_key(cfg: JobConfig) -> str | None:
    """The config key asking for a start, or None when the run starts from its seed."""
    if cfg.model.upcycle_from is not None:
        return "model.upcycle_from"
    if cfg.model.init_from is not None:
        return "model.init_from"
    return None


def find_start(cfg: JobConfig, name: str = "huggingface") -> Start | None:
    """The installed start ``name`` applied to ``cfg`` (which it edits), or None when ``cfg``
    asks for no start."""
    key = start_key(cfg)
    if key is None:
        return None
    found = entry_points(group=GROUP, name=name)
    if not found:
        raise ConfigError(
            f"{key}: no {name!r} start is installed (entry point group {GROUP!r}); "
            "install moetrain as a package (pip install -e .) so its entry points exist"
        )
    factory: StartFactory = next(iter(found)).load()
    return factory(cfg)
