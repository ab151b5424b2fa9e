"""``from_hf``: the moetrain model of a transformers directory, on CPU and eval-ready."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.interop.hf_files import HFDirectory
from moetrain.interop.load import checked_sources, load_model, sections
from moetrain.model import Transformer, empty_model

log = logging.getLogger("moetrain")


def from_hf(
    hf_dir: str | Path,
    *,
    moe_overrides: dict[str, Any] | None = None,
    return_configs: bool = False,
    allow_unused: bool = False,
) -> Transformer | tuple[Transformer, ModelConfig, MoEConfig]:
    """Build the moetrain model of ``hf_dir`` (a directory saved by transformers) on CPU in
    fp32, load its weights and return it in eval mode.

    Routing is dropless (no capacity) with the torch kernels unless ``moe_overrides`` (moe
    section keys) says otherwise; architecture keys come from config.json. A tensor of the
    directory that the model would not use is refused (HFCheckpointError naming it) unless
    ``allow_unused``; the log has the account of every tensor."""
    hf = HFDirectory(hf_dir)
    base = MoEConfig(kernels="torch", capacity_factor=None)
    if moe_overrides:
        base = dataclasses.replace(base, **moe_overrides)
    m, e, family = sections(hf, ModelConfig(), base)
    sources, account = checked_sources(hf, family, m, e, allow_unused=allow_unused,
                                       accept="from_hf(..., allow_unused=True), or generate "
                                       "from moetrain import-hf --allow-unused")  # fmt: skip
    log.info("%s: %s", hf.path, account.summary())
    model = empty_model(m, e)  # every parameter is loaded next: none is drawn first
    load_model(model, hf, sources)
    model.eval()
    return (model, m, e) if return_configs else model
