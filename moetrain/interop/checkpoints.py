"""moetrain checkpoints as the interop layer sees them: where one is, the config it was
trained with, and its model tensors (whole, on CPU), read in groups so that exporting a
large model never holds all of it.

A checkpoint saved under any layout stores every tensor under its full-model name (DCP
reshards on load), so a single process reads it whatever layout wrote it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moetrain.config import ConfigError, DataConfig, ModelConfig, MoEConfig
from moetrain.model import Transformer, empty_model, meta_model
from moetrain.train.checkpoint import CheckpointError, CheckpointManager, read_manifest


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: a ``step_*`` directory itself, the newest
    usable one of a checkpoint root, or of a run directory's ``checkpoints/``."""
    path = Path(path).expanduser()
    if (path / "manifest.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir() and ((root / "latest").exists() or any(root.glob("step_*"))):
            found = CheckpointManager(root, keep_last=1).latest()
            if found is None:
                raise CheckpointError(f"{root} holds no usable checkpoint")
            return found
    raise CheckpointError(
        f"{path} is not a moetrain checkpoint (no manifest.json), a checkpoint root or a run "
        "directory with checkpoints/"
    )


def _section(cls: type, values: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


@dataclasses.dataclass
class CheckpointInfo:
    path: Path
    step: int
    config: dict[str, Any]
    model: ModelConfig
    moe: MoEConfig
    data: DataConfig
    source: str | None = None
    """The Hugging Face directory ``import-hf`` read it from (None: trained by moetrain)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The checkpoint's extra state (step, config, source, model_type, dtype ...)."""

    def read_dirs(self) -> list[tuple[str, str | None]]:
        """(what, path) of every directory this checkpoint's model came from or reads: a
        command writing output must not touch any of them."""
        root = self.path.parent
        dirs: list[tuple[str, str | None]] = []
        if root.name == "checkpoints":
            dirs.append(("its run directory", str(root.parent)))
        dirs += [("its checkpoint root", str(root)), ("the checkpoint", str(self.path))]
        tok = Path(self.data.tokenizer).expanduser()
        if self.data.tokenizer != "default" and tok.is_dir():
            dirs.append(("its tokenizer directory", str(tok)))
        dirs += [
            ("its model.init_from", self.model.init_from),
            ("its model.upcycle_from", self.model.upcycle_from),
            ("the directory it was imported from", self.source),
        ]
        return dirs


def checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Where the checkpoint is, its step and the job config it was saved with."""
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    extra = CheckpointManager(step_dir.parent, keep_last=1).load(step_dir, {})
    cfg = extra.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg or "moe" not in cfg:
        raise CheckpointError(f"checkpoint {step_dir} records no model config")
    model, moe = _section(ModelConfig, cfg["model"]), _section(MoEConfig, cfg["moe"])
    data = _section(DataConfig, cfg.get("data", {}))
    try:
        model.validate()
        moe.validate()
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {step_dir}: its config is invalid: {exc}") from None
    source = extra.get("source")
    return CheckpointInfo(step_dir, int(manifest["step"]), cfg, model, moe, data,
                          source if isinstance(source, str) else None, extra)  # fmt: skip


def tensor_groups(model: Transformer) -> list[list[str]]:
    """State-dict names grouped by layer (embeddings, final norm and output on their own)."""
    groups: dict[str, list[str]] = {}
    for name in model.state_dict():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def saved_dtypes(info: CheckpointInfo) -> dict[str, torch.dtype]:
    """The dtype each model tensor was saved in (an import keeps the checkpoint's: bf16 stays
    bf16; training saves fp32 master weights)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): v.properties.dtype for k, v in md.items()
            if k.startswith("model.") and hasattr(v, "properties")}  # fmt: skip


def saved_dtype(info: CheckpointInfo) -> torch.dtype:
    """The dtype of most of the saved floating-point weights (fp32 when none)."""
    counts: dict[torch.dtype, int] = {}
    for dtype in saved_dtypes(info).values():
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def read_groups(info: CheckpointInfo) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's model tensors, one layer group at a time, as CPU tensors in the dtype
    they were saved in."""
    model = meta_model(info.model, info.moe)
    dtypes = saved_dtypes(info)
    shapes = {k: (v.shape, dtypes.get(k, v.dtype)) for k, v in model.state_dict().items()}
    manager = CheckpointManager(info.path.parent, keep_last=1)
    for names in tensor_groups(model):
        group = {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        manager.load(info.path, {"model": group})
        yield group


def load_model(info: CheckpointInfo) -> Transformer:
    """The checkpoint's model on CPU in fp32 (built empty: the checkpoint fills every
    parameter)."""
    model = empty_model(info.model, info.moe)
    sd = model.state_dict()
    CheckpointManager(info.path.parent, keep_last=1).load(info.path, {"model": sd})
    return model
